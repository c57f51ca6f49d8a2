//! A sharded checkpoint directory: a fuzzed `model.safetensors.index.json`
//! next to a few small shards, opened with `TensorStore::open_dir`.
//!
//! The index is hostile: file names that leave the directory, name the index
//! itself or a directory, tensors in the wrong shard or in none. Properties:
//! no panic; every file the store mapped is directly inside the checkpoint
//! directory; a store that opens keeps `check_store`'s promises and holds
//! exactly the tensors the index lists.
#![no_main]

use std::collections::BTreeSet;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lily_core::tensors::TensorStore;
use lily_fuzz::{check_store, json_value, safetensors_bytes, scratch_dir, Hostile};
use serde_json::Value;

/// File names the index may point at; the first three are the shards written.
const FILES: &[&str] = &[
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors",
    "missing.safetensors",
    "model.safetensors.index.json",
    "",
    ".",
    "..",
    "../model-00001-of-00002.safetensors",
    "/etc/hostname",
    "sub/model.safetensors",
    "a\\..\\b",
    "nul\0.safetensors",
    "./model.safetensors",
];
const NAMES: &[&str] = &[
    "model.embed_tokens.weight",
    "lm_head.weight",
    "a",
    "",
    "b.scales",
    "é",
];
const DTYPES: &[&str] = &[
    "BF16", "F16", "F32", "U32", "U8", "I64", "F8_E4M3", "BOOL", "bf16",
];

#[derive(Debug)]
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl<'a> Arbitrary<'a> for Tensor {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let name = if u.ratio(3, 4)? {
            u.choose(NAMES)?.to_string()
        } else {
            u.arbitrary::<Hostile>()?.0
        };
        let dtype = u.choose(DTYPES)?.to_string();
        let rank = u.int_in_range(0..=3)?;
        let shape: Vec<usize> = (0..rank)
            .map(|_| {
                if u.ratio(1, 16)? {
                    u.arbitrary()
                } else {
                    u.int_in_range(0..=4)
                }
            })
            .collect::<arbitrary::Result<_>>()?;
        let numel: usize = shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .unwrap_or(0)
            .min(64);
        let size = match dtype.as_str() {
            "BF16" | "F16" | "bf16" => 2,
            "F32" | "U32" => 4,
            "I64" => 8,
            _ => 1,
        };
        // Mostly the right length; sometimes off, to test the size check.
        let len = if u.ratio(7, 8)? {
            numel * size
        } else {
            u.int_in_range(0..=64)?
        };
        let data = (0..len)
            .map(|_| u.arbitrary())
            .collect::<arbitrary::Result<_>>()?;
        Ok(Tensor {
            name,
            dtype,
            shape,
            data,
        })
    }
}

#[derive(Arbitrary, Debug)]
enum Shard {
    Built(Vec<Tensor>),
    Raw(Vec<u8>),
}

#[derive(Debug)]
enum Index {
    /// `{"metadata": ..., "weight_map": {tensor: file}}`.
    Map(Vec<(String, String)>, Option<Value>),
    Raw(String),
}

impl<'a> Arbitrary<'a> for Index {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        if u.ratio(1, 8)? {
            return Ok(Index::Raw(u.arbitrary::<Hostile>()?.0));
        }
        let n = u.int_in_range(0..=6)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let name = if u.ratio(3, 4)? {
                u.choose(NAMES)?.to_string()
            } else {
                u.arbitrary::<Hostile>()?.0
            };
            let file = if u.ratio(7, 8)? {
                u.choose(FILES)?.to_string()
            } else {
                u.arbitrary::<Hostile>()?.0
            };
            entries.push((name, file));
        }
        let meta = if u.arbitrary()? {
            Some(json_value(u, 3)?)
        } else {
            None
        };
        Ok(Index::Map(entries, meta))
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    shards: [Option<Shard>; 3],
    index: Index,
    /// A non-string file name in the map.
    odd_value: Option<(u8, i64)>,
}

fuzz_target!(|input: Input| {
    let dir = scratch_dir().join("ckpt");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut total = 0;
    for (shard, file) in input.shards.iter().zip(FILES) {
        let bytes = match shard {
            None => continue,
            Some(Shard::Raw(b)) => b.clone(),
            Some(Shard::Built(ts)) => {
                let ts: Vec<_> = ts
                    .iter()
                    .map(|t| {
                        (
                            t.name.clone(),
                            t.dtype.clone(),
                            t.shape.clone(),
                            t.data.clone(),
                        )
                    })
                    .collect();
                safetensors_bytes(&ts, None)
            }
        };
        total += bytes.len();
        std::fs::write(dir.join(file), &bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let index_text = match &input.index {
        Index::Raw(s) => s.clone(),
        Index::Map(entries, meta) => {
            let mut map = serde_json::Map::new();
            for (t, f) in entries {
                map.insert(t.clone(), Value::String(f.clone()));
            }
            if let Some((i, v)) = input.odd_value {
                let key = NAMES[i as usize % NAMES.len()].to_string();
                map.insert(key, Value::from(v));
            }
            let mut root = serde_json::Map::new();
            if let Some(m) = meta {
                root.insert("metadata".into(), m.clone());
            }
            root.insert("weight_map".into(), Value::Object(map));
            Value::Object(root).to_string()
        }
    };
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, &index_text)
        .unwrap_or_else(|e| panic!("{}: {e}", index_path.display()));

    let Ok(store) = TensorStore::open_dir(&dir) else {
        return;
    };
    for f in store.files() {
        assert_eq!(
            f.parent(),
            Some(dir.as_path()),
            "mapped {} outside the checkpoint",
            f.display()
        );
        assert!(f.is_file(), "mapped {} which is not a file", f.display());
    }
    check_store(&store, total);
    if let Ok(Value::Object(root)) = serde_json::from_str::<Value>(&index_text) {
        if let Some(Value::Object(map)) = root.get("weight_map") {
            let listed: BTreeSet<&str> = map.keys().map(String::as_str).collect();
            let held: BTreeSet<&str> = store.names().collect();
            assert_eq!(
                listed, held,
                "the store must hold exactly the tensors the index lists"
            );
        }
    }
});
