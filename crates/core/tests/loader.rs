//! The loader's refusals: every way a checkpoint can be wrong (a missing,
//! misshaped, mistyped or unused tensor, a truncated shard, a corrupt
//! header, an index naming a file that is not there) gives an error value
//! whose message names the tensor and/or the file, never a panic; and the
//! tensors real checkpoints carry but the text model does not use (vision
//! tower, `mtp.*`) are ignored.
//!
//! The checkpoints are built here from `expected_tensors` with the
//! `safetensors` crate's own writer, independent of `lily-synth`.

use std::collections::BTreeMap;
use std::path::Path;

use lily_core::config::{mlx_quantization, production, to_config_json, Format, ModelConfig};
use lily_core::tensors::DType;
use lily_core::weights::{expected_tensors, Role, Weights};
use safetensors::tensor::TensorView;

/// A small model of the real architecture.
fn small_config(format: Format) -> ModelConfig {
    let mut cfg = production();
    cfg.hidden_size = 64;
    cfg.num_layers = 4;
    cfg.vocab_size = 128;
    cfg.num_attention_heads = 8;
    cfg.num_kv_heads = 1;
    cfg.head_dim = 16;
    cfg.linear_num_key_heads = 2;
    cfg.linear_num_value_heads = 4;
    cfg.linear_key_head_dim = 16;
    cfg.linear_value_head_dim = 16;
    cfg.num_experts = 4;
    cfg.num_experts_per_tok = 2;
    cfg.moe_intermediate_size = 64;
    cfg.shared_expert_intermediate_size = 64;
    if format == Format::MlxQ4 {
        cfg.quantization = Some(mlx_quantization(&cfg));
    }
    cfg.validated().expect("small config")
}

/// One tensor to write: dtype, shape, bytes.
#[derive(Clone)]
struct Raw {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// The tensors of a valid checkpoint: zeros, except one-centred norms,
/// which hold gains of 1 in the MLX layout (so the convention is detected).
fn valid_tensors(cfg: &ModelConfig) -> BTreeMap<String, Raw> {
    expected_tensors(cfg)
        .into_iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            let mut data = vec![0u8; n * s.dtype.size()];
            if s.role == Role::NormOneCentered && cfg.format() == Format::MlxQ4 {
                let one = half::bf16::from_f32(1.0).to_bits().to_le_bytes();
                for c in data.chunks_exact_mut(2) {
                    c.copy_from_slice(&one);
                }
            }
            (
                s.name,
                Raw {
                    dtype: s.dtype,
                    shape: s.shape,
                    data,
                },
            )
        })
        .collect()
}

const SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];

/// Which shard a tensor goes to: layers 0-1 and the embedding in the
/// first, the rest in the second.
fn shard_of(name: &str) -> usize {
    let first =
        name.contains("embed_tokens") || name.contains("layers.0.") || name.contains("layers.1.");
    if first {
        0
    } else {
        1
    }
}

/// Writes config, two shards and the index into `dir`.
fn write_checkpoint(dir: &Path, cfg: &ModelConfig, tensors: &BTreeMap<String, Raw>) {
    std::fs::write(dir.join("config.json"), to_config_json(cfg).to_string()).expect("config");
    let mut weight_map = BTreeMap::new();
    for (s, file) in SHARDS.iter().enumerate() {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .filter(|(name, _)| shard_of(name) == s)
            .map(|(name, t)| {
                weight_map.insert(name.clone(), file.to_string());
                (
                    name.clone(),
                    TensorView::new(t.dtype.to_st(), t.shape.clone(), &t.data).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).expect("shard");
    }
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
}

/// Writes the checkpoint after `change` and returns the load error message.
fn load_error(format: Format, change: impl FnOnce(&mut BTreeMap<String, Raw>)) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(format);
    let mut tensors = valid_tensors(&cfg);
    change(&mut tensors);
    write_checkpoint(dir.path(), &cfg, &tensors);
    match Weights::load(dir.path()) {
        Ok(_) => panic!("the changed checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

fn valid_dir(format: Format) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(format);
    write_checkpoint(dir.path(), &cfg, &valid_tensors(&cfg));
    dir
}

const L: &str = "language_model.model.layers";

#[test]
fn the_unchanged_checkpoints_load() {
    for format in [Format::MlxQ4, Format::HfBf16] {
        let dir = valid_dir(format);
        let w = Weights::load(dir.path()).unwrap_or_else(|e| panic!("{format:?}: {e}"));
        assert_eq!(w.layers.len(), 4);
        assert_eq!(w.store.files().len(), 2);
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let name = format!("{L}.1.linear_attn.in_proj_z.scales");
    let err = load_error(Format::MlxQ4, |t| {
        t.remove(&name).expect("present");
    });
    assert!(err.contains(&name) && err.contains("missing"), "{err}");
    assert!(err.contains(SHARDS[0]), "names the files searched: {err}");

    let hf = "model.language_model.layers.2.mlp.experts.gate_up_proj";
    let err = load_error(Format::HfBf16, |t| {
        t.remove(hf).expect("present");
    });
    assert!(err.contains(hf) && err.contains("missing"), "{err}");
}

#[test]
fn a_misshaped_tensor_names_tensor_file_and_both_shapes() {
    let name = format!("{L}.3.self_attn.k_proj.weight");
    let err = load_error(Format::MlxQ4, |t| {
        let k = t.get_mut(&name).expect("present");
        // [16, 8] codes stored as [8, 16]: same bytes, wrong shape.
        k.shape = vec![k.shape[1], k.shape[0]];
    });
    assert!(err.contains(&name) && err.contains(SHARDS[1]), "{err}");
    assert!(err.contains("[8, 16]") && err.contains("[16, 8]"), "{err}");
}

#[test]
fn a_mistyped_tensor_names_tensor_and_dtypes() {
    let name = format!("{L}.0.linear_attn.in_proj_qkv.weight");
    let err = load_error(Format::MlxQ4, |t| {
        let k = t.get_mut(&name).expect("present");
        k.dtype = DType::F32;
    });
    assert!(err.contains(&name) && err.contains(SHARDS[0]), "{err}");
    assert!(err.contains("F32") && err.contains("U32"), "{err}");
}

#[test]
fn an_unused_tensor_is_named_with_its_file() {
    let extra = format!("{L}.2.mlp.experts.gate_up_proj.weight");
    let err = load_error(Format::MlxQ4, |t| {
        t.insert(
            extra.clone(),
            Raw {
                dtype: DType::BF16,
                shape: vec![4],
                data: vec![0; 8],
            },
        );
    });
    assert!(err.contains(&extra) && err.contains(SHARDS[1]), "{err}");
    assert!(err.contains("not used"), "{err}");
}

#[test]
fn vision_tower_and_mtp_tensors_are_ignored() {
    for (format, names) in [
        (
            Format::MlxQ4,
            ["vision_tower.blocks.0.attn.qkv.weight", "mtp.fc.weight"],
        ),
        (
            Format::HfBf16,
            [
                "model.visual.blocks.0.attn.qkv.weight",
                "mtp.layers.0.mlp.gate.weight",
            ],
        ),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = small_config(format);
        let mut tensors = valid_tensors(&cfg);
        for name in names {
            tensors.insert(
                name.to_string(),
                Raw {
                    dtype: DType::BF16,
                    shape: vec![2, 2],
                    data: vec![0; 8],
                },
            );
        }
        write_checkpoint(dir.path(), &cfg, &tensors);
        Weights::load(dir.path()).unwrap_or_else(|e| panic!("{format:?}: {e}"));
    }
}

#[test]
fn a_truncated_shard_names_the_file() {
    let dir = valid_dir(Format::MlxQ4);
    let path = dir.path().join(SHARDS[1]);
    let len = std::fs::metadata(&path).expect("meta").len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_len(len - 100).expect("truncate");
    drop(file);
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(SHARDS[1]) && err.contains("not a valid safetensors file"),
        "{err}"
    );

    // Cut inside the header, and down to less than the length field.
    for keep in [20, 3] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open")
            .set_len(keep)
            .expect("truncate");
        let err = Weights::load(dir.path())
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(SHARDS[1]), "{keep} bytes: {err}");
    }
}

#[test]
fn a_corrupt_header_names_the_file() {
    let dir = valid_dir(Format::MlxQ4);
    let path = dir.path().join(SHARDS[0]);
    let original = std::fs::read(&path).expect("read");

    // Broken JSON.
    let mut bytes = original.clone();
    bytes[8] = b'#';
    std::fs::write(&path, &bytes).expect("write");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(SHARDS[0]) && err.contains("not a valid safetensors file"),
        "{err}"
    );

    // A header length far beyond the file.
    let mut bytes = original.clone();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(SHARDS[0]), "{err}");

    // Data offsets with a gap: the first tensor ends one byte early.
    let n = u64::from_le_bytes(original[..8].try_into().expect("8 bytes")) as usize;
    let header = String::from_utf8(original[8..8 + n].to_vec()).expect("utf8");
    let key = "\"data_offsets\":[0,";
    let at = header.find(key).expect("first tensor") + key.len();
    let end: String = header[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let shorter = (end.parse::<u64>().expect("number") - 1).to_string();
    let mut changed = header[..at].to_string() + &shorter + &header[at + end.len()..];
    // Keep the header length: JSON allows the trailing spaces.
    while changed.len() < n {
        changed.push(' ');
    }
    let mut bytes = original.clone();
    bytes[8..8 + n].copy_from_slice(changed.as_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(SHARDS[0]), "{err}");
}

#[test]
fn an_index_naming_a_missing_file_names_it() {
    let dir = valid_dir(Format::MlxQ4);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read")).expect("json");
    let name = format!("{L}.3.mlp.gate.weight");
    index["weight_map"][&name] = "model-00003-of-00003.safetensors".into();
    std::fs::write(&index_path, index.to_string()).expect("write");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("model-00003-of-00003.safetensors"), "{err}");

    // A shard deleted from under a valid index.
    let dir = valid_dir(Format::MlxQ4);
    std::fs::remove_file(dir.path().join(SHARDS[1])).expect("remove");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(SHARDS[1]), "{err}");
}

#[test]
fn an_index_disagreeing_with_the_files_names_tensor_and_file() {
    let dir = valid_dir(Format::MlxQ4);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read")).expect("json");
    // The tensor lives in the second shard; the index says the first.
    let name = format!("{L}.3.mlp.gate.weight");
    index["weight_map"][&name] = SHARDS[0].into();
    std::fs::write(&index_path, index.to_string()).expect("write");
    let err = Weights::load(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&name) && err.contains(SHARDS[0]) && err.contains(SHARDS[1]),
        "{err}"
    );
}
