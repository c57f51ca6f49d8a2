//! The memory budget of the benchmark contract, checked without a GPU: the
//! real model's packed weights plus the memory plan for one 262,144-token
//! sequence (KV cache, DeltaNet state, every scratch buffer) fit in 28 GB.
//! The sizes are the ones the backend allocates (`weights::planned_bytes`
//! lays out exactly what the upload lays out; `Memory::planned_bytes` is the
//! memory plan's own sum).

use lily_core::config::production;
use lily_cuda::dims::Dims;
use lily_cuda::state::{Memory, Options};
use lily_cuda::weights;

#[test]
fn model_plus_a_262144_token_context_fits_in_28_gb() {
    let dims = Dims::from_config(&production()).expect("dims");
    let w = weights::planned_bytes(&dims);
    let opts = Options::default();
    assert_eq!(opts.max_seq_len, 262_144);
    let plan = Memory::planned_bytes(&dims, &opts);
    let total = w + plan;
    eprintln!("weights {:.2} GB + KV/state/scratch {:.2} GB = {:.2} GB", w as f64 / 1e9, plan as f64 / 1e9, total as f64 / 1e9);
    // The 4-bit checkpoint is about 19.4 GB of text weights.
    assert!((18.5e9..20.5e9).contains(&(w as f64)), "weights {w} bytes");
    assert!(total as f64 <= 28e9, "{total} bytes > 28 GB");
}

#[test]
fn kv_cache_holds_the_whole_context() {
    let dims = Dims::from_config(&production()).expect("dims");
    let opts = Options::default();
    assert!(opts.kv_tokens >= opts.max_seq_len, "KV pool smaller than one full sequence");
    // 20 KiB of fp16 K and V per token over the 10 attention layers.
    assert_eq!(dims.kv_block_bytes() * 10 / lily_cuda::dims::KV_BLOCK, 20 * 1024);
}
