//! Support for the GPU tests: the skip rule, random packed matrices, device
//! upload/download, and small naive f64 reference functions written next to
//! docs/design.md §2 (independent of the kernels and of lily-cpu's internals).
#![allow(dead_code)]

use std::sync::Arc;

use half::{bf16, f16};
use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use lily_core::config::{production, Format};
use lily_core::weights::Weights;
use lily_core::ModelConfig;
use lily_cuda::device::{read_device, DeviceBuffer, Gpu};
use lily_cuda::dims::Dims;
use lily_cuda::weights::QMat;

/// tests/fixtures/tiny of the repository: the path known at build time, or
/// the one under the working directory (test binaries are built on one
/// machine and run from the repository root on the GPU machine).
pub fn fixtures_dir() -> std::path::PathBuf {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    if built.is_dir() {
        return built;
    }
    std::path::PathBuf::from("tests/fixtures/tiny")
}

/// A synthetic checkpoint written by lily-synth into a temp dir (RAM-backed
/// when /dev/shm exists).
pub fn synth_checkpoint(preset: lily_synth::Preset, layers: usize, seed: u64) -> (tempfile::TempDir, Arc<Weights>) {
    let base = if std::path::Path::new("/dev/shm").is_dir() { std::path::PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = tempfile::tempdir_in(base).expect("temp dir");
    let mut opts = lily_synth::SynthOptions::new(preset, dir.path());
    opts.layers = Some(layers);
    opts.seed = seed;
    lily_synth::synth(&opts).expect("synth");
    let w = Arc::new(Weights::load(dir.path()).expect("load synthetic"));
    (dir, w)
}

/// The real Qwen3.6-35B-A3B shape.
pub fn prod_dims() -> Dims {
    Dims::from_config(&production()).expect("production dims")
}

/// The tiny fixture's shape (head dim 32).
pub fn tiny_dims() -> Dims {
    let dir = fixtures_dir().join("mlx-q4");
    Dims::from_config(&ModelConfig::from_dir(&dir).expect("fixture config")).expect("tiny dims")
}

/// The tiny synthetic preset's shape (head dim 64).
pub fn synth_tiny_dims() -> Dims {
    let cfg = lily_synth::preset_config(lily_synth::Preset::Tiny, None, Format::MlxQ4).expect("tiny preset");
    Dims::from_config(&cfg).expect("synth tiny dims")
}

/// The tiny fixture's shape and the real one.
pub fn both() -> [(&'static str, Dims); 2] {
    [("tiny", tiny_dims()), ("production", prod_dims())]
}

/// The GPU, or None after printing a visible skip line. With
/// LILY_REQUIRE_GPU=1 a missing GPU fails the test instead.
pub fn gpu(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("LILY_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: LILY_REQUIRE_GPU=1 but {e}");
            }
            eprintln!("{test}: skipped: no CUDA device ({e})");
            None
        }
    }
}

pub struct Rng(pub ChaCha8Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(ChaCha8Rng::seed_from_u64(seed))
    }
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        self.0.random_range(lo..hi)
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0.random_range(0..n)
    }
    pub fn seed(&mut self) -> u64 {
        self.0.random()
    }
}

pub fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
pub fn bf16_val(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}
pub fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}
pub fn f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}
pub fn f16_val(b: u16) -> f32 {
    f16::from_bits(b).to_f32()
}

/// A packed matrix on the host, MLX layout, with its exact dequantisation.
pub struct HostQ {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub codes: Vec<u32>,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
}

impl HostQ {
    /// Random codes; per-group scale ~ `amp / levels` and a bias that
    /// roughly centres the weights, so weights lie in about [-amp, amp].
    pub fn random(seed: u64, experts: usize, rows: usize, cols: usize, bits: u32, amp: f32) -> HostQ {
        let per_word = 32 / bits as usize;
        let words = experts * rows * cols / per_word;
        let groups = experts * rows * cols / 64;
        let codes: Vec<u32> = (0..words)
            .into_par_iter()
            .chunks(1 << 16)
            .flat_map_iter(|chunk| {
                let mut r = ChaCha8Rng::seed_from_u64(seed ^ (chunk[0] as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                chunk.into_iter().map(move |_| r.random::<u32>())
            })
            .collect();
        let levels = ((1u32 << bits) - 1) as f32;
        let mut r = ChaCha8Rng::seed_from_u64(seed.wrapping_add(1));
        let mut scales = Vec::with_capacity(groups);
        let mut biases = Vec::with_capacity(groups);
        for _ in 0..groups {
            let s = 2.0 * amp / levels * r.random_range(0.5f32..1.5);
            scales.push(bf16_bits(s));
            biases.push(bf16_bits(-s * levels / 2.0 * r.random_range(0.8f32..1.2)));
        }
        HostQ { experts, rows, cols, bits, codes, scales, biases }
    }

    pub fn code(&self, e: usize, r: usize, c: usize) -> u32 {
        let per_word = 32 / self.bits as usize;
        let idx = (e * self.rows + r) * self.cols + c;
        (self.codes[idx / per_word] >> ((idx % per_word) as u32 * self.bits)) & ((1u32 << self.bits) - 1)
    }

    /// Row `r` of expert `e`, dequantised exactly in f32 (w = s * q + b).
    pub fn row(&self, e: usize, r: usize) -> Vec<f32> {
        let g0 = (e * self.rows + r) * self.cols / 64;
        (0..self.cols)
            .map(|c| {
                let g = g0 + c / 64;
                bf16_val(self.scales[g]).mul_add(self.code(e, r, c) as f32, bf16_val(self.biases[g]))
            })
            .collect()
    }

    /// W x in f64 for every row of expert `e`.
    pub fn matvec(&self, e: usize, x: &[f32]) -> Vec<f64> {
        (0..self.rows).into_par_iter().map(|r| dot(&self.row(e, r), x)).collect()
    }

    /// W x with W rounded to fp16 (as the GEMM dequantises) and x as given.
    pub fn matvec_f16w(&self, e: usize, x: &[f32]) -> Vec<f64> {
        (0..self.rows)
            .into_par_iter()
            .map(|r| {
                let w: Vec<f32> = self.row(e, r).into_iter().map(f16_round).collect();
                dot(&w, x)
            })
            .collect()
    }

    pub fn upload(&self, gpu: &Arc<Gpu>) -> (DeviceBuffer, QMat) {
        let cb = self.codes.len() * 4;
        let sb = self.scales.len() * 2;
        let align = |n: usize| n.div_ceil(256) * 256;
        let buf = DeviceBuffer::zeroed(gpu, align(cb) + 2 * align(sb), "test matrix").expect("alloc");
        buf.upload_sync_at(0, &self.codes).expect("codes");
        buf.upload_sync_at(align(cb), &self.scales).expect("scales");
        buf.upload_sync_at(align(cb) + align(sb), &self.biases).expect("biases");
        let p = buf.ptr();
        let m = QMat {
            codes: p,
            scales: p + align(cb) as u64,
            biases: p + (align(cb) + align(sb)) as u64,
            rows: self.rows,
            cols: self.cols,
            experts: self.experts,
            bits: self.bits,
        };
        (buf, m)
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

pub fn upload<T: Copy>(gpu: &Arc<Gpu>, data: &[T]) -> DeviceBuffer {
    let buf = DeviceBuffer::zeroed(gpu, std::mem::size_of_val(data).max(4), "test data").expect("alloc");
    buf.upload_sync_at(0, data).expect("upload");
    buf
}

pub fn zeros(gpu: &Arc<Gpu>, bytes: usize) -> DeviceBuffer {
    DeviceBuffer::zeroed(gpu, bytes, "test scratch").expect("alloc")
}

pub fn download<T: Copy + Default>(gpu: &Gpu, ptr: u64, n: usize) -> Vec<T> {
    gpu.synchronize().expect("kernel ran without a fault");
    read_device(gpu, ptr, n).expect("download")
}

/// ||got - want|| / ||want|| (f64), NaN-safe (NaN gives infinity).
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let mut num = 0f64;
    let mut den = 0f64;
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (*g as f64 - w).powi(2);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let e = rel_err(got, want);
    let worst = got
        .iter()
        .zip(want)
        .enumerate()
        .max_by(|a, b| (*a.1 .0 as f64 - a.1 .1).abs().total_cmp(&(*b.1 .0 as f64 - b.1 .1).abs()))
        .map(|(i, (g, w))| format!("index {i}: got {g}, want {w}"))
        .unwrap_or_default();
    eprintln!("{what}: relative error {e:.3e} (tolerance {tol:.0e})");
    check(e <= tol, format!("{what}: relative error {e:.3e} > {tol:.1e}; worst {worst}"));
}

thread_local! {
    static FAILURES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records a failed check (printed at once) so one device run reports every
/// failing case of a test; `finish` fails the test if any was recorded.
pub fn check(ok: bool, msg: impl Into<String>) {
    if !ok {
        let m = msg.into();
        eprintln!("FAILED CHECK: {m}");
        FAILURES.with(|f| f.borrow_mut().push(m));
    }
}

pub fn finish() {
    let failures = FAILURES.with(|f| std::mem::take(&mut *f.borrow_mut()));
    assert!(failures.is_empty(), "{} check(s) failed:\n{}", failures.len(), failures.join("\n"));
}

// ---- naive references (f64) -------------------------------------------------

pub fn rmsnorm(x: &[f32], gain: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(gain).map(|(v, g)| (*v as f64 * r * *g as f64) as f32).collect()
}
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
pub fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Top-k of router logits with renormalised softmax weights (ties: lower index).
pub fn topk(logits: &[f32], k: usize) -> (Vec<usize>, Vec<f64>) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
    idx.truncate(k);
    let m = logits[idx[0]] as f64;
    let e: Vec<f64> = idx.iter().map(|i| (logits[*i] as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    (idx, e.iter().map(|v| v / s).collect())
}

/// log-softmax in f64.
pub fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

pub fn argmax(v: &[f32]) -> usize {
    lily_model::argmax(v) as usize
}
