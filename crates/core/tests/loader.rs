//! The loader's refusals: every way a checkpoint can be wrong (a missing,
//! misshaped, mistyped or unused tensor, a truncated shard, a corrupt
//! header, an index naming a file that is not there) gives an error value
//! whose message names the tensor and/or the file, never a panic; and the
//! tensors real checkpoints carry but the text model does not use (vision
//! tower, `mtp.*`) are ignored.
//!
//! The checkpoints are built from `expected_tensors` with the `safetensors`
//! crate's own writer (`support`), independent of `lily-synth`.

mod support;

use std::collections::BTreeMap;

use lily_core::config::Format;
use lily_core::tensors::DType;
use lily_core::weights::Weights;
use support::{small_config, valid_tensors, write_checkpoint, Raw, SHARDS};

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
        t.insert(extra.clone(), Raw { dtype: DType::BF16, shape: vec![4], data: vec![0; 8] });
    });
    assert!(err.contains(&extra) && err.contains(SHARDS[1]), "{err}");
    assert!(err.contains("not used"), "{err}");
}

#[test]
fn vision_tower_and_mtp_tensors_are_ignored() {
    for (format, names) in [
        (Format::MlxQ4, ["vision_tower.blocks.0.attn.qkv.weight", "mtp.fc.weight"]),
        (Format::HfBf16, ["model.visual.blocks.0.attn.qkv.weight", "mtp.layers.0.mlp.gate.weight"]),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = small_config(format);
        let mut tensors = valid_tensors(&cfg);
        for name in names {
            tensors.insert(name.to_string(), Raw { dtype: DType::BF16, shape: vec![2, 2], data: vec![0; 8] });
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
    let file = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    file.set_len(len - 100).expect("truncate");
    drop(file);
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(SHARDS[1]) && err.contains("not a valid safetensors file"), "{err}");

    // Cut inside the header, and down to less than the length field.
    for keep in [20, 3] {
        std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(keep).expect("truncate");
        let err = Weights::load(dir.path()).err().expect("refused").to_string();
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
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(SHARDS[0]) && err.contains("not a valid safetensors file"), "{err}");

    // A header length far beyond the file.
    let mut bytes = original.clone();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(SHARDS[0]), "{err}");

    // Data offsets with a gap: the first tensor ends one byte early.
    let n = u64::from_le_bytes(original[..8].try_into().expect("8 bytes")) as usize;
    let header = String::from_utf8(original[8..8 + n].to_vec()).expect("utf8");
    let key = "\"data_offsets\":[0,";
    let at = header.find(key).expect("first tensor") + key.len();
    let end: String = header[at..].chars().take_while(|c| c.is_ascii_digit()).collect();
    let shorter = (end.parse::<u64>().expect("number") - 1).to_string();
    let mut changed = header[..at].to_string() + &shorter + &header[at + end.len()..];
    // Keep the header length: JSON allows the trailing spaces.
    while changed.len() < n {
        changed.push(' ');
    }
    let mut bytes = original.clone();
    bytes[8..8 + n].copy_from_slice(changed.as_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(SHARDS[0]), "{err}");
}

#[test]
fn an_index_naming_a_missing_file_names_it() {
    let dir = valid_dir(Format::MlxQ4);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read")).expect("json");
    let name = format!("{L}.3.mlp.gate.weight");
    index["weight_map"][&name] = "model-00003-of-00003.safetensors".into();
    std::fs::write(&index_path, index.to_string()).expect("write");
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains("model-00003-of-00003.safetensors"), "{err}");

    // A shard deleted from under a valid index.
    let dir = valid_dir(Format::MlxQ4);
    std::fs::remove_file(dir.path().join(SHARDS[1])).expect("remove");
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(SHARDS[1]), "{err}");
}

#[test]
fn an_index_disagreeing_with_the_files_names_tensor_and_file() {
    let dir = valid_dir(Format::MlxQ4);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read")).expect("json");
    // The tensor lives in the second shard; the index says the first.
    let name = format!("{L}.3.mlp.gate.weight");
    index["weight_map"][&name] = SHARDS[0].into();
    std::fs::write(&index_path, index.to_string()).expect("write");
    let err = Weights::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains(&name) && err.contains(SHARDS[0]) && err.contains(SHARDS[1]), "{err}");
}
