//! Speed probe of the attention kernels at the real shape, one layer: decode
//! attention (`attn_decode` + `attn_combine`, prep excluded) for several
//! batches and context lengths, and prefill attention (`attn_prefill`) for
//! chunks from position 0 and at the end of a long prompt. K/V are random
//! fp16 made on the GPU (bf16 bit patterns of values below 1, which read as
//! fp16 are finite values below 2), block tables a scrambled permutation.
//! Prints one line per case: time per call (mean
//! of `--iters` back-to-back calls after one warm-up), the KV bytes a decode
//! reads per call and the bandwidth that makes, or prefill TFLOP/s (QK^T
//! and PV, 2 FLOP per multiply-add, causal). Numbers only; the kernels'
//! correctness is tests/gpu_attention.rs.
//!
//!   attn_probe [--iters 20]

use std::time::Instant;

use lily_core::config::production;
use lily_cuda::attention::{self, DecodeScratch, KvView};
use lily_cuda::device::DeviceBuffer;
use lily_cuda::dims::KV_BLOCK;
use lily_cuda::gdn::MixOut;
use lily_cuda::kernels::Kernels;
use lily_cuda::synth::{self, Fill};
use lily_cuda::{Dims, Gpu};

fn main() {
    if let Err(e) = run() {
        eprintln!("attn_probe: {e}");
        std::process::exit(1);
    }
}

/// Decode cases: (batch, context length of every sequence).
const DECODE: &[(usize, usize)] = &[(1, 256), (1, 4096), (1, 32768), (1, 131_072), (8, 32768), (64, 4096), (128, 1024)];
/// Prefill cases: (chunk tokens, position of the chunk's first token).
const PREFILL: &[(usize, usize)] = &[(256, 0), (4096, 0), (4096, 28672), (4096, 126_976)];

fn run() -> Result<(), String> {
    let mut iters = 20usize;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--iters" => iters = args.next().ok_or("--iters needs a value")?.parse().map_err(|e| format!("--iters: {e}"))?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let iters = iters.max(1);
    let e = |x: lily_cuda::CudaError| x.to_string();
    let gpu = Gpu::open(0).map_err(e)?;
    let d = Dims::from_config(&production()).map_err(e)?;
    let k = Kernels::load(&gpu, &d).map_err(e)?;
    println!("{}: {} SMs; one layer, {} query heads, {} KV heads of {}", gpu.name, gpu.sm_count, d.a_heads, d.a_kv_heads, d.a_head_dim);

    // One cache large enough for the largest case, as a pool of blocks.
    let blocks_of = |b: usize, len: usize| b * len.div_ceil(KV_BLOCK);
    let max_blocks = DECODE.iter().map(|&(b, l)| blocks_of(b, l)).chain(PREFILL.iter().map(|&(t, p0)| blocks_of(1, t + p0))).max().unwrap_or(1);
    let block_halves = d.a_kv_heads * KV_BLOCK * d.a_head_dim;
    let kc = DeviceBuffer::zeroed(&gpu, max_blocks * block_halves * 2, "probe K").map_err(e)?;
    let vc = DeviceBuffer::zeroed(&gpu, max_blocks * block_halves * 2, "probe V").map_err(e)?;
    synth::fill(&gpu, &k, kc.ptr(), max_blocks * block_halves, Fill::Bf16(-1.0, 1.0), 1).map_err(e)?;
    synth::fill(&gpu, &k, vc.ptr(), max_blocks * block_halves, Fill::Bf16(-1.0, 1.0), 2).map_err(e)?;
    let max_batch = DECODE.iter().map(|c| c.0).max().unwrap_or(1);
    let max_tok = PREFILL.iter().map(|c| c.0).max().unwrap_or(1).max(max_batch);
    let q = DeviceBuffer::zeroed(&gpu, max_tok * d.attn_out_dim() * 4, "probe q").map_err(e)?;
    synth::fill(&gpu, &k, q.ptr(), max_tok * d.attn_out_dim(), Fill::F32(-1.0, 1.0), 3).map_err(e)?;
    let proj = DeviceBuffer::zeroed(&gpu, max_tok * d.proj_stride() * 4, "probe proj").map_err(e)?;
    synth::fill(&gpu, &k, proj.ptr(), max_tok * d.proj_stride(), Fill::F32(-2.0, 2.0), 4).map_err(e)?;
    // fp16 queries of the prefill (bf16 bit patterns of values below 1 read
    // as fp16 are finite values below 2).
    let q16 = DeviceBuffer::zeroed(&gpu, max_tok * d.attn_out_dim() * 2, "probe q16").map_err(e)?;
    synth::fill(&gpu, &k, q16.ptr(), max_tok * d.attn_out_dim(), Fill::Bf16(-1.0, 1.0), 5).map_err(e)?;
    let mix = DeviceBuffer::zeroed(&gpu, max_tok * d.attn_out_dim() * 4, "probe mix").map_err(e)?;
    let max_splits = attention::splits_for(262_144, 128);
    let part_o = DeviceBuffer::zeroed(&gpu, max_batch * d.a_heads * max_splits * d.a_head_dim * 4, "probe part_o").map_err(e)?;
    let part_ml = DeviceBuffer::zeroed(&gpu, max_batch * d.a_heads * max_splits * 2 * 4, "probe part_ml").map_err(e)?;
    let scratch = DecodeScratch { part_o: part_o.ptr(), part_ml: part_ml.ptr(), max_splits };

    // A scrambled permutation of the pool, cut into rows of `stride` blocks.
    let mut perm: Vec<i32> = (0..max_blocks as i32).collect();
    let mut s = 0x9e37_79b9u64;
    for i in (1..perm.len()).rev() {
        s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        perm.swap(i, (s >> 33) as usize % (i + 1));
    }
    let table = DeviceBuffer::zeroed(&gpu, perm.len() * 4, "probe table").map_err(e)?;
    table.upload_sync_at(0, &perm).map_err(e)?;

    let time = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        f()?;
        gpu.synchronize().map_err(e)?;
        let t0 = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        gpu.synchronize().map_err(e)?;
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    };

    for &(batch, len) in DECODE {
        let stride = len.div_ceil(KV_BLOCK);
        let pos = DeviceBuffer::zeroed(&gpu, batch * 4, "probe pos").map_err(e)?;
        pos.upload_sync_at(0, &vec![(len - 1) as i32; batch]).map_err(e)?;
        let slot = DeviceBuffer::zeroed(&gpu, batch * 4, "probe slot").map_err(e)?;
        slot.upload_sync_at(0, &(0..batch as i32).collect::<Vec<_>>()).map_err(e)?;
        let kv = KvView { k: kc.ptr(), v: vc.ptr(), block_table: table.ptr(), bt_stride: stride };
        let ps = d.proj_stride();
        let secs = time(&mut || {
            attention::decode(&gpu, &k, &d, q.ptr(), &kv, pos.ptr(), slot.ptr(), &scratch, proj.ptr(), ps, MixOut::F32(mix.ptr()), batch).map_err(e)
        })?;
        let bytes = (batch * len * 2 * d.a_kv_heads * d.a_head_dim * 2) as f64;
        println!(
            "decode  batch {batch:>3} context {len:>7}: {:>9.1} us, {:>7.1} MB of K/V, {:>5.2} TB/s ({} splits per sequence)",
            secs * 1e6,
            bytes / 1e6,
            bytes / secs / 1e12,
            attention::splits_for(len, max_splits)
        );
    }
    for &(t, p0) in PREFILL {
        let ps = d.proj_stride();
        let secs = time(&mut || {
            attention::prefill(&gpu, &k, &d, q16.ptr(), kc.ptr(), vc.ptr(), table.ptr(), proj.ptr(), ps, t, p0, MixOut::F16(mix.ptr())).map_err(e)
        })?;
        // Query i sees p0 + i + 1 keys; 4 FLOP per (query, key, dim, head).
        let pairs = (t * p0 + t * (t + 1) / 2) as f64;
        let flop = pairs * 4.0 * (d.a_head_dim * d.a_heads) as f64;
        println!("prefill chunk {t:>5} at position {p0:>7}: {:>9.1} us, {:>6.1} TFLOP/s", secs * 1e6, flop / secs / 1e12);
    }
    Ok(())
}
