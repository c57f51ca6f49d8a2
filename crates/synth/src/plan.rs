//! The on-disk plan of a checkpoint, computed before a byte of tensor data
//! exists: which shard each tensor of `expected_tensors` goes to, at which
//! offset, and the exact safetensors header of every shard.
//!
//! Because every size is known in advance, a writer can create each shard at
//! its final length, write the header, and then fill tensors in any order
//! and in parallel; nothing has to be held in memory to learn its size. The
//! plan is also what the `full`-preset test inspects without writing 20 GB.

use std::collections::BTreeMap;

use lily_core::config::{Format, ModelConfig};
use lily_core::weights::{expected_tensors, TensorSpec};
use lily_core::{Error, Result};
use serde_json::{json, Map, Value};

/// One tensor's place in the checkpoint.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    pub spec: TensorSpec,
    pub shard: usize,
    /// Absolute byte offset of the tensor's data in its shard file.
    pub offset: u64,
    pub bytes: u64,
}

/// One `model-0000i-of-0000N.safetensors` file.
#[derive(Clone, Debug)]
pub struct PlannedShard {
    pub file_name: String,
    /// The first bytes of the file: the 8-byte little-endian header length,
    /// then the JSON header padded with spaces to a multiple of 8 bytes.
    pub header: Vec<u8>,
    /// Bytes of tensor data after the header.
    pub data_bytes: u64,
    /// Indices into `Plan::tensors`, in file order.
    pub tensors: Vec<usize>,
}

impl PlannedShard {
    pub fn file_bytes(&self) -> u64 {
        self.header.len() as u64 + self.data_bytes
    }
}

/// Where every tensor of a checkpoint goes.
#[derive(Clone, Debug)]
pub struct Plan {
    pub config: ModelConfig,
    /// `expected_tensors(&config)`, in that order, placed.
    pub tensors: Vec<PlannedTensor>,
    pub shards: Vec<PlannedShard>,
}

impl Plan {
    /// Places `expected_tensors(config)` into shards of at most
    /// `max_shard_bytes` of data each (a single larger tensor gets a shard
    /// of its own), in list order, as transformers and mlx-lm do.
    pub fn new(config: &ModelConfig, max_shard_bytes: u64) -> Result<Self> {
        let specs = expected_tensors(config);
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = 0u64;
        for (i, spec) in specs.iter().enumerate() {
            let bytes = tensor_bytes(spec);
            match groups.last_mut() {
                Some(g) if current + bytes <= max_shard_bytes => {
                    g.push(i);
                    current += bytes;
                }
                _ => {
                    groups.push(vec![i]);
                    current = bytes;
                }
            }
        }
        let n = groups.len();
        let format_tag = match config.format() {
            Format::MlxQ4 => "mlx",
            Format::HfBf16 => "pt",
        };
        let mut tensors: Vec<PlannedTensor> = specs.into_iter().map(|spec| PlannedTensor { bytes: tensor_bytes(&spec), spec, shard: 0, offset: 0 }).collect();
        let mut shards = Vec::with_capacity(n);
        for (s, group) in groups.into_iter().enumerate() {
            // Data offsets inside the data section, in file order.
            let mut header = Map::new();
            header.insert("__metadata__".into(), json!({ "format": format_tag }));
            let mut pos = 0u64;
            for &i in &group {
                let t = &tensors[i];
                header.insert(
                    t.spec.name.clone(),
                    json!({
                        "dtype": t.spec.dtype.name(),
                        "shape": t.spec.shape,
                        "data_offsets": [pos, pos + t.bytes],
                    }),
                );
                pos += t.bytes;
            }
            let mut text = serde_json::to_vec(&Value::Object(header)).map_err(|e| Error::Other(format!("serialising a safetensors header: {e}")))?;
            // Pad so the data section starts 8-byte aligned, as the
            // safetensors writers do; mapped U32/F32 tensors then stay aligned.
            while (8 + text.len()) % 8 != 0 {
                text.push(b' ');
            }
            let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(&text);
            let base = bytes.len() as u64;
            let mut pos = 0u64;
            for &i in &group {
                tensors[i].shard = s;
                tensors[i].offset = base + pos;
                pos += tensors[i].bytes;
            }
            shards.push(PlannedShard { file_name: shard_file_name(s, n), header: bytes, data_bytes: pos, tensors: group });
        }
        Ok(Plan { config: config.clone(), tensors, shards })
    }

    /// Sum of all tensor data (the index's `metadata.total_size`).
    pub fn total_data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// Sum of the shard file sizes, headers included.
    pub fn total_file_bytes(&self) -> u64 {
        self.shards.iter().map(PlannedShard::file_bytes).sum()
    }

    /// The tensor called `name`, if the plan has it.
    pub fn tensor(&self, name: &str) -> Option<&PlannedTensor> {
        self.tensors.iter().find(|t| t.spec.name == name)
    }

    /// `model.safetensors.index.json`: `metadata.total_size` and the
    /// `weight_map` from tensor name to shard file (sorted by name).
    pub fn index_json(&self) -> Value {
        let map: BTreeMap<&str, &str> = self.tensors.iter().map(|t| (t.spec.name.as_str(), self.shards[t.shard].file_name.as_str())).collect();
        json!({
            "metadata": { "total_size": self.total_data_bytes() },
            "weight_map": map,
        })
    }
}

/// Bytes of one tensor's data.
pub fn tensor_bytes(spec: &TensorSpec) -> u64 {
    spec.shape.iter().product::<usize>() as u64 * spec.dtype.size() as u64
}

/// `model-00001-of-00004.safetensors`, the name both releases use.
pub fn shard_file_name(index: usize, count: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", index + 1, count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{preset_config, Preset};

    #[test]
    fn shards_respect_the_limit_and_headers_are_aligned() {
        let cfg = preset_config(Preset::Tiny, None, Format::MlxQ4).expect("tiny");
        let plan = Plan::new(&cfg, 4 << 20).expect("plan");
        assert!(plan.shards.len() > 2);
        for (s, shard) in plan.shards.iter().enumerate() {
            assert_eq!(shard.header.len() % 8, 0);
            let big_single = shard.tensors.len() == 1;
            assert!(big_single || shard.data_bytes <= 4 << 20, "shard {s} holds {} bytes", shard.data_bytes);
            assert_eq!(shard.file_name, shard_file_name(s, plan.shards.len()));
        }
        let placed: usize = plan.shards.iter().map(|s| s.tensors.len()).sum();
        assert_eq!(placed, plan.tensors.len());
        assert_eq!(plan.index_json()["weight_map"].as_object().map(|m| m.len()), Some(plan.tensors.len()));
    }
}
