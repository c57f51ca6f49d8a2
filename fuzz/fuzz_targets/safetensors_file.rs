//! A safetensors file of arbitrary bytes, opened as a checkpoint shard.
//!
//! `TensorStore::open_files` maps the file and parses its header; a bad file
//! must be an error naming it, never a panic or an out-of-bounds view.
//! When it opens, every tensor's bytes match its shape and dtype and every
//! accessor works (`check_store`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use lily_core::tensors::TensorStore;
use lily_fuzz::{check_store, scratch_dir};

fuzz_target!(|data: &[u8]| {
    let path = scratch_dir().join("model.safetensors");
    std::fs::write(&path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    match TensorStore::open_files(std::slice::from_ref(&path)) {
        Ok(store) => check_store(&store, data.len()),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("model.safetensors"),
                "error does not name the file: {msg}"
            );
        }
    }
});
