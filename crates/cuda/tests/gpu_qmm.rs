//! qmm.cu (the decode step's matrix work) against lily-cpu's reference, on
//! the real shapes of a synthetic full-width checkpoint: the dense
//! projections, the lm_head with its greedy argmax, the packer with the
//! RMSNorm and the MoE combine, and the MoE (router, top-k, device plan,
//! grouped experts) for batch sizes crossing every kernel variant. Also: a
//! token's result is bit-identical whatever the batch it is computed in.
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1`); elsewhere each test prints
//! "skipped: no CUDA device" and returns.

mod common;

use std::sync::Arc;

use common::{check, finish, gpu, Rng};
use lily_core::weights::{Mixer, Weights};
use lily_cpu::reference::{moe, ops};
use lily_cuda::device::{read_device, write_device, DevSlice};
use lily_cuda::qmm::{self, DenseSeg, Epilogue, PLAN_HEAD};
use lily_cuda::weights::MixerDev;
use lily_cuda::{CudaBackend, Options};

/// The exact packed input (both halves), what every decode step used
/// before `DecodeMatrices::f16_from`.
const HILO: qmm::XPrecision = qmm::XPrecision::HiLo;
/// The two routers: `moe_router` (every size's default up to the GEMM
/// path) and `moe_router_mma` (the GEMM path's, `Options::router_mma_from`).
const CORES: qmm::RouterMath = qmm::RouterMath::CudaCores;
const TENSOR: qmm::RouterMath = qmm::RouterMath::TensorCores;

/// Batch sizes crossing the variants: 1-4 and 5+ tokens, token chunks of 8
/// beyond 8 (16 chunks at 128).
const SIZES: &[usize] = &[1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128];

fn setup() -> (tempfile::TempDir, Arc<Weights>, CudaBackend) {
    let g = gpu("qmm setup").expect("gpu");
    let base = if std::path::Path::new("/dev/shm").is_dir() { std::path::PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = tempfile::tempdir_in(base).expect("tempdir");
    let mut o = lily_synth::SynthOptions::new(lily_synth::Preset::Full, dir.path());
    o.layers = Some(4);
    o.seed = 21;
    lily_synth::synth(&o).expect("synth");
    let w = Arc::new(Weights::load(dir.path()).expect("load"));
    let mut opts = Options::for_context(256);
    opts.max_sequences = 2;
    let be = CudaBackend::from_weights(&g, &w, opts, &mut |_, _| {}).expect("backend");
    (dir, w, be)
}

/// ‖got − want‖ / ‖want‖ with the reference in f64.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Tokens whose outputs are compared with the reference (all of a small
/// batch; first, middle and last of a large one).
fn probes(n: usize) -> Vec<usize> {
    if n <= 3 {
        (0..n).collect()
    } else {
        vec![0, n / 2, n - 1]
    }
}

#[test]
fn dense_projections_match_the_reference_at_every_batch_size() {
    let Some(_) = gpu("dense_projections_match_the_reference_at_every_batch_size") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let (MixerDev::DeltaNet(gd), Mixer::DeltaNet(gh)) = (&m.weights.layers[0].mixer, &w.layers[0].mixer) else { panic!("layer 0 is DeltaNet") };
    let mut rng = Rng::new(5);
    let width = d.gdn_proj();
    let ps = d.proj_stride();
    let mut solo: Vec<Vec<f32>> = Vec::new();
    for &n in SIZES {
        let x = rng.vec(n * d.hidden, -2.0, 2.0);
        write_device(g, dec.h.ptr(), &x).expect("upload x");
        qmm::xnorm(g, k, d, dec.h, d.hidden, None, None, dec.moe.px_in, n).expect("pack");
        let offs = [0, d.conv_dim, d.conv_dim + d.gdn_val_dim(), d.conv_dim + d.gdn_val_dim() + d.gv_heads];
        let mats = [&gd.in_qkv, &gd.in_z, &gd.in_a, &gd.in_b];
        let segs: Vec<DenseSeg> = mats
            .iter()
            .zip(offs)
            .map(|(q, off)| DenseSeg { w: q, out: dec.proj.from(off).expect("view"), out_stride: ps, epilogue: Epilogue::Store })
            .collect();
        qmm::dense(g, k, &segs, dec.moe.px_in, n, HILO, None).expect("dense");
        let out: Vec<f32> = read_device(g, dec.proj.ptr(), n * ps).expect("read");
        for t in probes(n) {
            let xt = &x[t * d.hidden..(t + 1) * d.hidden];
            let mut want = Vec::with_capacity(width);
            for lin in [&gh.in_qkv, &gh.in_z, &gh.in_a, &gh.in_b] {
                want.extend(ops::linear(lin, 0, xt));
            }
            let got = &out[t * ps..t * ps + width];
            let e = rel(got, &want);
            check(e < 1e-5, format!("in-projections, batch {n}, token {t}: relative error {e:.2e}"));
        }
        // Batch invariance: each probed token against itself alone (the
        // narrow kernel at 1 token; above 8 tokens the wide kernels run, in
        // passes past 64).
        if n == 1 {
            solo.push(out[..width].to_vec());
        } else {
            for t in probes(n) {
                write_device(g, dec.h.ptr(), &x[t * d.hidden..(t + 1) * d.hidden]).expect("upload");
                qmm::xnorm(g, k, d, dec.h, d.hidden, None, None, dec.moe.px_in, 1).expect("pack");
                qmm::dense(g, k, &segs, dec.moe.px_in, 1, HILO, None).expect("dense 1");
                let one: Vec<f32> = read_device(g, dec.proj.ptr(), width).expect("read");
                check(bits_equal(&one, &out[t * ps..t * ps + width]), format!("batch {n}: token {t} bit-identical to the same token alone"));
            }
        }
    }
    check(!solo.is_empty(), "batch 1 ran");

    // The out-projection (K = 4096, a wide matrix: QMM_WIDE_KQ K slices a
    // task in blocks of as many warps; 1, 5-8 and chunked entries) adds
    // into the residual.
    let mut out_solo: Vec<Vec<f32>> = Vec::new();
    let (mix_first, h_first) = (rng.vec(d.gdn_val_dim(), -1.0, 1.0), rng.vec(d.hidden, -1.0, 1.0));
    for &n in &[1usize, 7, 40, 100] {
        let mut mix = mix_first.clone();
        mix.extend(rng.vec((n - 1) * d.gdn_val_dim(), -1.0, 1.0));
        let mut h0 = h_first.clone();
        h0.extend(rng.vec((n - 1) * d.hidden, -1.0, 1.0));
        write_device(g, dec.mix_f32.ptr(), &mix).expect("upload");
        write_device(g, dec.h.ptr(), &h0).expect("upload");
        qmm::xnorm(g, k, d, dec.mix_f32, d.gdn_val_dim(), None, None, dec.px_mix, n).expect("pack");
        qmm::dense(g, k, &[DenseSeg { w: &gd.out, out: dec.h, out_stride: d.hidden, epilogue: Epilogue::Add }], dec.px_mix, n, HILO, None).expect("out");
        let h1: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("read");
        for t in probes(n) {
            let y = ops::linear(&gh.out, 0, &mix[t * d.gdn_val_dim()..(t + 1) * d.gdn_val_dim()]);
            let got: Vec<f32> = (0..d.hidden).map(|c| h1[t * d.hidden + c] - h0[t * d.hidden + c]).collect();
            let e = rel(&got, &y);
            check(e < 1e-5, format!("out-projection (add), batch {n}, token {t}: relative error {e:.2e}"));
        }
        // Token 0 has the same inputs at every size: its result must be
        // bit-identical to batch 1's.
        let row0 = h1[..d.hidden].to_vec();
        match out_solo.first() {
            None => out_solo.push(row0),
            Some(f) => check(bits_equal(f, &row0), format!("out-projection, batch {n}: token 0 bit-identical to batch 1")),
        }
    }
    finish();
}

/// The final norm and the lm_head of `n` residual rows `x` read as `xp`
/// says: the logits, after checking each token's greedy argmax key against
/// its row's first maximum.
fn lm_head_with_keys(m: &lily_cuda::model::Model, x: &[f32], n: usize, xp: qmm::XPrecision, what: &str) -> Vec<f32> {
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    write_device(g, dec.h.ptr(), x).expect("upload");
    write_device(g, dec.argmax.ptr(), &vec![0u64; n]).expect("clear keys");
    qmm::xnorm(g, k, d, dec.h, d.hidden, None, Some(m.weights.final_norm), dec.moe.px_in, n).expect("pack");
    let seg = DenseSeg { w: &m.weights.lm_head, out: dec.logits, out_stride: d.vocab, epilogue: Epilogue::Logits };
    qmm::dense(g, k, &[seg], dec.moe.px_in, n, xp, Some(dec.argmax)).expect("lm_head");
    let logits: Vec<f32> = read_device(g, dec.logits.ptr(), n * d.vocab).expect("logits");
    let keys: Vec<u64> = read_device(g, dec.argmax.ptr(), n).expect("keys");
    for t in 0..n {
        let first_max = lily_model::argmax(&logits[t * d.vocab..(t + 1) * d.vocab]);
        let id = lily_cuda::sampling::key_index(keys[t]);
        check(id == first_max, format!("{what}, batch {n}, token {t}: argmax key {id} vs first maximum {first_max}"));
    }
    logits
}

#[test]
fn lm_head_logits_and_argmax_match_the_reference() {
    let Some(_) = gpu("lm_head_logits_and_argmax_match_the_reference") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let d = &m.dims;
    let mut rng = Rng::new(9);
    for &n in &[1usize, 5, 37, 128] {
        let x = rng.vec(n * d.hidden, -2.0, 2.0);
        let logits = lm_head_with_keys(m, &x, n, HILO, "lm_head");
        for t in probes(n) {
            let xn = ops::rms_norm_vec(&x[t * d.hidden..(t + 1) * d.hidden], &w.final_norm, d.rms_eps);
            let want = ops::linear(&w.lm_head, 0, &xn);
            let e = rel(&logits[t * d.vocab..(t + 1) * d.vocab], &want);
            check(e < 1e-5, format!("lm_head, batch {n}, token {t}: relative error {e:.2e}"));
        }
    }
    finish();
}

/// What the fp16-input dense kernels compute for one token (qmm.cu
/// `stage_math_groups`, F16): the exact codes times the packed hi halves,
/// and each group's bias times the packed sum of hi + lo, i.e.
/// sum_k w_k hi_k + sum_g b_g sum_{k in g} lo_k, in f64 (`hi`, `lo`: the
/// token's packed halves, unpermuted).
fn f16_input_reference(lin: &lily_core::weights::Linear, hi: &[f32], lo: &[f32]) -> Vec<f32> {
    let lily_core::weights::Linear::Quant(q) = lin else { panic!("a 4-bit matrix") };
    let (cols, gs) = (lin.cols(), q.spec.group_size);
    let groups = cols / gs;
    let lo_sums: Vec<f64> = lo.chunks(gs).map(|c| c.iter().map(|v| *v as f64).sum()).collect();
    let mut row = vec![0f32; cols];
    (0..lin.rows())
        .map(|r| {
            lin.row_f32(0, r, &mut row);
            let biases = lily_core::weights::half_row(&q.biases, r * groups, groups);
            let dot: f64 = row.iter().zip(hi).map(|(w, x)| *w as f64 * *x as f64).sum();
            let bias: f64 = biases.iter().zip(&lo_sums).map(|(b, l)| *b as f64 * l).sum();
            (dot + bias) as f32
        })
        .collect()
}

/// Token `t`'s packed halves (hi, lo), in column order, from the packed rows.
fn packed_halves(px: &[u16], t: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let row = &px[t * 2 * cols..(t + 1) * 2 * cols];
    let half = |i: usize| half::f16::from_bits(row[i]).to_f32();
    (0..cols).map(qmm::px_position).map(|p| (half(p), half(cols + p))).unzip()
}

#[test]
fn fp16_input_dense_kernels_match_the_reference_on_the_packed_hi_halves() {
    let Some(_) = gpu("fp16_input_dense_kernels_match_the_reference_on_the_packed_hi_halves") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let (MixerDev::DeltaNet(gd), Mixer::DeltaNet(gh)) = (&m.weights.layers[0].mixer, &w.layers[0].mixer) else { panic!("layer 0 is DeltaNet") };
    let f16 = qmm::XPrecision::F16;
    let mut rng = Rng::new(31);
    let ps = d.proj_stride();
    let width = d.gdn_proj();
    let offs = [0, d.conv_dim, d.conv_dim + d.gdn_val_dim(), d.conv_dim + d.gdn_val_dim() + d.gv_heads];
    let segs: Vec<DenseSeg> = [&gd.in_qkv, &gd.in_z, &gd.in_a, &gd.in_b]
        .iter()
        .zip(offs)
        .map(|(q, off)| DenseSeg { w: q, out: dec.proj.from(off).expect("view"), out_stride: ps, epilogue: Epilogue::Store })
        .collect();
    // In-projections (four matrices, one launch) at 1, 2, 5, 8 tokens (one
    // n-tile) and 12, 16 (two): every token against the reference on its
    // packed halves (as exact as the hi/lo path: 1e-5) and against the
    // exact input (what fp16 x costs); token 0 has the same input at every
    // size, so its result is bit-identical (the K split does not depend on
    // the batch, nor a token's arithmetic on the n-tiles beside it).
    let x0 = rng.vec(d.hidden, -2.0, 2.0);
    let mut first: Option<Vec<f32>> = None;
    for n in [1usize, 2, 5, 8, 12, 16] {
        let mut x = x0.clone();
        x.extend(rng.vec((n - 1) * d.hidden, -2.0, 2.0));
        write_device(g, dec.h.ptr(), &x).expect("upload x");
        qmm::xnorm(g, k, d, dec.h, d.hidden, None, None, dec.moe.px_in, n).expect("pack");
        qmm::dense(g, k, &segs, dec.moe.px_in, n, f16, None).expect("dense f16");
        let out: Vec<f32> = read_device(g, dec.proj.ptr(), n * ps).expect("read");
        let px: Vec<u16> = read_device(g, dec.moe.px_in.px.ptr(), qmm::packed_len(n, d.hidden)).expect("px");
        for t in 0..n {
            let (hi, lo) = packed_halves(&px, t, d.hidden);
            let xt = &x[t * d.hidden..(t + 1) * d.hidden];
            let (mut want, mut exact) = (Vec::with_capacity(width), Vec::with_capacity(width));
            for lin in [&gh.in_qkv, &gh.in_z, &gh.in_a, &gh.in_b] {
                want.extend(f16_input_reference(lin, &hi, &lo));
                exact.extend(ops::linear(lin, 0, xt));
            }
            let got = &out[t * ps..t * ps + width];
            let e = rel(got, &want);
            check(e < 1e-5, format!("fp16 in-projections, batch {n}, token {t}: relative error {e:.2e} against the packed hi halves"));
            let ex = rel(got, &exact);
            check(ex < 2e-3, format!("fp16 in-projections, batch {n}, token {t}: relative error {ex:.2e} against the exact input"));
            if t == 0 && n == 8 {
                eprintln!("fp16 in-projections: relative error against the exact input {ex:.2e} (fp16 x), against the packed halves {e:.2e}");
            }
        }
        let row0 = out[..width].to_vec();
        match &first {
            None => first = Some(row0),
            Some(f) => check(bits_equal(f, &row0), format!("fp16 in-projections, batch {n}: token 0 bit-identical to batch 1")),
        }
    }

    // The wide out-projection (QMM_WIDE_KQ slices of a task, the residual
    // add) at 7 tokens (one n-tile) and 13 (two chunks of one n-tile).
    for n in [7usize, 13] {
        let mix = rng.vec(n * d.gdn_val_dim(), -1.0, 1.0);
        let h0 = rng.vec(n * d.hidden, -1.0, 1.0);
        write_device(g, dec.mix_f32.ptr(), &mix).expect("upload");
        write_device(g, dec.h.ptr(), &h0).expect("upload");
        qmm::xnorm(g, k, d, dec.mix_f32, d.gdn_val_dim(), None, None, dec.px_mix, n).expect("pack");
        qmm::dense(g, k, &[DenseSeg { w: &gd.out, out: dec.h, out_stride: d.hidden, epilogue: Epilogue::Add }], dec.px_mix, n, f16, None).expect("out");
        let h1: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("read");
        let px: Vec<u16> = read_device(g, dec.px_mix.px.ptr(), qmm::packed_len(n, d.gdn_val_dim())).expect("px");
        for t in 0..n {
            let (hi, lo) = packed_halves(&px, t, d.gdn_val_dim());
            let want = f16_input_reference(&gh.out, &hi, &lo);
            let got: Vec<f32> = (0..d.hidden).map(|c| h1[t * d.hidden + c] - h0[t * d.hidden + c]).collect();
            let e = rel(&got, &want);
            check(e < 1e-5, format!("fp16 out-projection (add), batch {n}, token {t}: relative error {e:.2e}"));
        }
    }

    // The lm_head (logits and the greedy argmax keys) at 5, 8 and 16 tokens.
    for n in [5usize, 8, 16] {
        let x = rng.vec(n * d.hidden, -2.0, 2.0);
        let logits = lm_head_with_keys(m, &x, n, f16, "fp16 lm_head");
        let px: Vec<u16> = read_device(g, dec.moe.px_in.px.ptr(), qmm::packed_len(n, d.hidden)).expect("px");
        for t in probes(n) {
            let (hi, lo) = packed_halves(&px, t, d.hidden);
            let e = rel(&logits[t * d.vocab..(t + 1) * d.vocab], &f16_input_reference(&w.lm_head, &hi, &lo));
            check(e < 1e-5, format!("fp16 lm_head, batch {n}, token {t}: relative error {e:.2e}"));
        }
    }

    // More than two n-tiles of 8 are refused, not cut short.
    let too_many = qmm::dense(g, k, &segs, dec.moe.px_in, 17, f16, None).unwrap_err().to_string();
    check(too_many.contains("fp16"), format!("17 tokens on fp16 inputs: {too_many}"));
    finish();
}

#[test]
fn xnorm_packs_the_norm_and_the_moe_combine_exactly() {
    let Some(_) = gpu("xnorm_packs_the_norm_and_the_moe_combine_exactly") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let slots = d.topk + 1;
    let mut rng = Rng::new(13);
    let n = 6;
    let h = rng.vec(n * d.hidden, -3.0, 3.0);
    let y = rng.vec(n * slots * d.hidden, -1.0, 1.0);
    let wt = rng.vec(n * slots, 0.0, 1.0);
    write_device(g, dec.h.ptr(), &h).expect("h");
    write_device(g, dec.moe.y.ptr(), &y).expect("y");
    write_device(g, dec.moe.topk_w.ptr(), &wt).expect("w");
    qmm::xnorm(g, k, d, dec.h, d.hidden, Some((dec.moe.y, dec.moe.topk_w)), Some(m.weights.layers[0].input_norm), dec.moe.px_in, n).expect("xnorm");
    let h1: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("h");
    let px: Vec<u16> = read_device(g, dec.moe.px_in.px.ptr(), qmm::packed_len(n, d.hidden)).expect("px");
    let csum: Vec<f32> = read_device(g, dec.moe.px_in.csum.ptr(), n * d.hidden / 64).expect("sums");
    for t in 0..n {
        // h + sum_s w_s y_s in slot order (what the kernel promises).
        let want_h: Vec<f32> = (0..d.hidden)
            .map(|c| {
                let mut add = 0f32;
                for s in 0..slots {
                    add = wt[t * slots + s].mul_add(y[(t * slots + s) * d.hidden + c], add);
                }
                h[t * d.hidden + c] + add
            })
            .collect();
        let hr = &h1[t * d.hidden..(t + 1) * d.hidden];
        check(rel(hr, &want_h) < 1e-6, format!("combine, token {t}: relative error {:.2e}", rel(hr, &want_h)));
        let normed = ops::rms_norm_vec(hr, &w.layers[0].input_norm, d.rms_eps);
        // Unpack hi + lo through the permutation.
        let row = &px[t * 2 * d.hidden..(t + 1) * 2 * d.hidden];
        let unpacked: Vec<f32> = (0..d.hidden)
            .map(|c| {
                let pos = lily_cuda::qmm::px_position(c);
                half::f16::from_bits(row[pos]).to_f32() + half::f16::from_bits(row[d.hidden + pos]).to_f32()
            })
            .collect();
        let e = rel(&unpacked, &normed);
        check(e < 1e-6, format!("packed RMSNorm, token {t}: hi + lo vs the reference, relative error {e:.2e}"));
        // The group sums are the sums of the stored hi + lo of each group.
        for (gi, got) in csum[t * d.hidden / 64..(t + 1) * d.hidden / 64].iter().enumerate() {
            let want: f64 = unpacked[gi * 64..(gi + 1) * 64].iter().map(|v| *v as f64).sum();
            check(((*got as f64) - want).abs() <= 1e-5 * want.abs().max(1.0), format!("group sum {gi} of token {t}: {got} vs {want}"));
        }
    }
    finish();
}

#[test]
fn combine_norm_f16_equals_the_combine_then_rmsnorm_f16() {
    let Some(_) = gpu("combine_norm_f16_equals_the_combine_then_rmsnorm_f16") else { return };
    let (_dir, _w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let s = &m.mem.scratch;
    let slots = d.topk + 1;
    let mut rng = Rng::new(29);
    let n = 9;
    let h = rng.vec(n * d.hidden, -3.0, 3.0);
    let y = rng.vec(n * slots * d.hidden, -1.0, 1.0);
    let wt = rng.vec(n * slots, 0.0, 1.0);
    let gain = m.weights.final_norm;
    write_device(g, dec.moe.y.ptr(), &y).expect("y");
    write_device(g, dec.moe.topk_w.ptr(), &wt).expect("w");
    // Apart: the combine (xnorm, its packed rows unused), then rmsnorm_f16.
    write_device(g, dec.h.ptr(), &h).expect("h");
    qmm::xnorm(g, k, d, dec.h, d.hidden, Some((dec.moe.y, dec.moe.topk_w)), None, dec.moe.px_in, n).expect("combine");
    lily_cuda::gemm::rmsnorm_f16(g, k, dec.h.ptr(), gain, s.xn, n, d.rms_eps).expect("rmsnorm_f16");
    let h_apart: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("h");
    let xn_apart: Vec<u16> = read_device(g, s.xn, n * d.hidden).expect("xn");
    // Together.
    write_device(g, dec.h.ptr(), &h).expect("h");
    write_device(g, s.xn, &vec![0u16; n * d.hidden]).expect("clear xn");
    qmm::combine_norm_f16(g, k, d, dec.h, (dec.moe.y, dec.moe.topk_w), gain, s.xn, n).expect("combine_norm_f16");
    let h_together: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("h");
    let xn_together: Vec<u16> = read_device(g, s.xn, n * d.hidden).expect("xn");
    check(h_apart.iter().zip(&h_together).all(|(a, b)| a.to_bits() == b.to_bits()), "the combined rows are the same bits");
    let differ = xn_apart.iter().zip(&xn_together).filter(|(a, b)| a != b).count();
    check(differ == 0, format!("the fused norm differs from rmsnorm_f16 in {differ} of {} values", xn_apart.len()));
    finish();
}

/// The device plan of a routed step of `n` tokens (experts reading `x`):
/// shared expert first, then experts ascending, each expert's pairs in
/// token order, every (token, slot) exactly once. Returns the top-k ids.
fn check_plan(be: &CudaBackend, n: usize, x: qmm::XPrecision, what: &str) -> Vec<i32> {
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let slots = d.topk + 1;
    let plan: Vec<i32> = read_device(g, dec.moe.plan.ptr(), PLAN_HEAD + 3 * dec.moe.max_items + n * slots).expect("plan");
    let idx: Vec<i32> = read_device(g, dec.moe.topk_idx.ptr(), n * d.topk).expect("topk");
    let nitems = plan[0] as usize;
    let items = &plan[PLAN_HEAD..PLAN_HEAD + 3 * nitems];
    let pairs = &plan[PLAN_HEAD + 3 * dec.moe.max_items..];
    let mut seen = vec![0u32; n * slots];
    let mut last_expert = -1i32;
    for it in items.chunks_exact(3) {
        let (e, start, cnt) = (it[0], it[1] as usize, it[2] as usize);
        check(cnt >= 1 && cnt <= qmm::moe_chunk(&k.qmm, n, x), format!("{what}batch {n}: item of {cnt} pairs"));
        if e as usize != d.n_experts {
            check(e >= last_expert, format!("{what}batch {n}: experts in ascending order"));
            last_expert = e;
        } else {
            check(last_expert < 0, format!("{what}batch {n}: shared-expert items come first"));
        }
        let ps = &pairs[start..start + cnt];
        check(ps.windows(2).all(|p| p[0] < p[1]), format!("{what}batch {n}: expert {e}'s pairs in token order"));
        for &p in ps {
            let (t, s) = (p as usize / slots, p as usize % slots);
            let routed = if s == d.topk { e as usize == d.n_experts } else { idx[t * d.topk + s] == e };
            check(routed, format!("{what}batch {n}: pair (token {t}, slot {s}) filed under expert {e}"));
            seen[p as usize] += 1;
        }
    }
    check(seen.iter().all(|&c| c == 1), format!("{what}batch {n}: every (token, slot) pair planned exactly once"));
    idx
}

#[test]
fn moe_router_plan_and_experts_match_the_reference() {
    let Some(_) = gpu("moe_router_plan_and_experts_match_the_reference") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let bufs = dec.moe;
    let l = &m.weights.layers[0];
    let lw = &w.layers[0];
    let mut rng = Rng::new(17);
    let mut first_token: Option<Vec<f32>> = None;
    let h_first = rng.vec(d.hidden, -2.0, 2.0);
    for &n in &[1usize, 4, 8, 9, 33, 64, 128] {
        let mut h = h_first.clone();
        h.extend(rng.vec((n - 1) * d.hidden, -2.0, 2.0));
        write_device(g, dec.h.ptr(), &h).expect("h");
        qmm::router(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, HILO, CORES).expect("router");
        qmm::experts(g, k, d, &l.moe, true, &bufs, n, HILO).expect("gate/up");
        qmm::experts(g, k, d, &l.moe, false, &bufs, n, HILO).expect("down");
        let idx = check_plan(&be, n, HILO, "");

        // Fold the outputs into h (what the next layer's packer does).
        qmm::xnorm(g, k, d, dec.h, d.hidden, Some((dec.moe.y, dec.moe.topk_w)), None, dec.moe.px_in, n).expect("combine");
        let h1: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("h");
        for t in probes(n) {
            let xt = ops::rms_norm_vec(&h[t * d.hidden..(t + 1) * d.hidden], &lw.post_norm, d.rms_eps);
            let logits = ops::linear(&lw.moe.router, 0, &xt);
            let want_route: Vec<i32> = moe::route(&logits, d.topk).into_iter().map(|(e, _)| e as i32).collect();
            check(
                idx[t * d.topk..(t + 1) * d.topk] == want_route[..],
                format!("batch {n}, token {t}: top-k {:?} vs {want_route:?}", &idx[t * d.topk..(t + 1) * d.topk]),
            );
            let want = moe::moe(&lw.moe, d.topk, &xt);
            let got: Vec<f32> = (0..d.hidden).map(|c| h1[t * d.hidden + c] - h[t * d.hidden + c]).collect();
            let e = rel(&got, &want);
            check(e < 1e-5, format!("MoE, batch {n}, token {t}: relative error {e:.2e}"));
        }
        let t0: Vec<f32> = h1[..d.hidden].to_vec();
        match &first_token {
            None => first_token = Some(t0),
            Some(f) => check(bits_equal(f, &t0), format!("MoE, batch {n}: token 0 bit-identical to batch 1")),
        }
    }

    // The experts on fp16 activations (qmm_moe_f16, Options::moe_f16_from:
    // the GEMM path's precision of x): plan items of up to 8 pairs, every
    // probed token against the reference on the exact input within fp16's
    // tolerance, and token 0 bit-identical at every size (a token's column
    // never depends on the tokens beside it).
    let f16 = qmm::XPrecision::F16;
    let mut first_f16: Option<Vec<f32>> = None;
    for &n in &[9usize, 33, 64, 128] {
        let mut h = h_first.clone();
        h.extend(rng.vec((n - 1) * d.hidden, -2.0, 2.0));
        write_device(g, dec.h.ptr(), &h).expect("h");
        qmm::router(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, f16, TENSOR).expect("router");
        qmm::experts(g, k, d, &l.moe, true, &bufs, n, f16).expect("gate/up f16");
        qmm::experts(g, k, d, &l.moe, false, &bufs, n, f16).expect("down f16");
        let plan: Vec<i32> = read_device(g, dec.moe.plan.ptr(), PLAN_HEAD + 3 * dec.moe.max_items).expect("plan");
        let items = &plan[PLAN_HEAD..PLAN_HEAD + 3 * plan[0] as usize];
        check(items.chunks_exact(3).all(|it| it[2] >= 1 && it[2] <= 8), format!("fp16 experts, batch {n}: items of 1..=8 pairs"));
        check(items.chunks_exact(3).any(|it| it[2] > 4) || n < 64, format!("fp16 experts, batch {n}: some item holds more than 4 pairs"));
        qmm::xnorm(g, k, d, dec.h, d.hidden, Some((dec.moe.y, dec.moe.topk_w)), None, dec.moe.px_in, n).expect("combine");
        let h1: Vec<f32> = read_device(g, dec.h.ptr(), n * d.hidden).expect("h");
        for t in probes(n) {
            let xt = ops::rms_norm_vec(&h[t * d.hidden..(t + 1) * d.hidden], &lw.post_norm, d.rms_eps);
            let want = moe::moe(&lw.moe, d.topk, &xt);
            let got: Vec<f32> = (0..d.hidden).map(|c| h1[t * d.hidden + c] - h[t * d.hidden + c]).collect();
            let e = rel(&got, &want);
            check(e < 3e-3, format!("fp16 experts, batch {n}, token {t}: relative error {e:.2e} against the exact input"));
            if t == 0 && n == 64 {
                eprintln!("fp16 experts: relative error against the exact input {e:.2e} (batch 64, token 0)");
            }
        }
        let t0: Vec<f32> = h1[..d.hidden].to_vec();
        match &first_f16 {
            None => first_f16 = Some(t0),
            Some(f) => check(bits_equal(f, &t0), format!("fp16 experts, batch {n}: token 0 bit-identical to batch 9")),
        }
    }
    finish();
}

/// What a router launch leaves for the experts and the plan.
struct RouterOut {
    logits: Vec<f32>,
    sg: Vec<f32>,
    px: Vec<u16>,
    csum: Vec<f32>,
    idx: Vec<i32>,
    w: Vec<f32>,
}

/// `moe_router_mma` (the GEMM path's router: its dot products on mma.sync)
/// against `moe_router` on the same tokens: the experts' packed input and
/// group sums bit for bit (the same staging code), the logits and the
/// shared gate to 1e-6 (another summation order of the same exact
/// products), the logits to 1e-5 of lily-cpu's reference, the same top-k
/// except on a near tie, a valid plan, and a token's logits bit-identical
/// at every batch size.
#[test]
fn moe_router_mma_matches_the_fp32_router_and_the_reference() {
    let Some(_) = gpu("moe_router_mma_matches_the_fp32_router_and_the_reference") else { return };
    let (_dir, w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    check(qmm::router_mma_fits(d), "the full-width model runs moe_router_mma");
    let dec = m.mem.decode;
    let bufs = dec.moe;
    let (e, slots) = (d.n_experts, d.topk + 1);
    let mut rng = Rng::new(29);
    let h_first = rng.vec(d.hidden, -2.0, 2.0);
    let mut first: Option<Vec<f32>> = None;
    let mut worst = 0f64;
    for (i, &n) in [9usize, 16, 33, 64, 100, 128].iter().enumerate() {
        // A different layer's router each size.
        let (l, lw) = (&m.weights.layers[i % d.layers], &w.layers[i % d.layers]);
        let mut h = h_first.clone();
        h.extend(rng.vec((n - 1) * d.hidden, -2.0, 2.0));
        write_device(g, dec.h.ptr(), &h).expect("h");
        let read = |what: &str| RouterOut {
            logits: read_device(g, bufs.logits.ptr(), n * e).expect(what),
            sg: read_device(g, bufs.sg.ptr(), n).expect(what),
            px: read_device(g, bufs.px_in.px.ptr(), n * 2 * d.hidden).expect(what),
            csum: read_device(g, bufs.px_in.csum.ptr(), n * (d.hidden / d.group_size)).expect(what),
            idx: read_device(g, bufs.topk_idx.ptr(), n * d.topk).expect(what),
            w: read_device(g, bufs.topk_w.ptr(), n * slots).expect(what),
        };
        qmm::router(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, HILO, CORES).expect("moe_router");
        let RouterOut { logits: l0, sg: sg0, px: px0, csum: cs0, idx: idx0, w: w0 } = read("moe_router");
        qmm::router(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, HILO, TENSOR).expect("moe_router_mma");
        check_plan(&be, n, HILO, "moe_router_mma, ");
        let RouterOut { logits: l1, sg: sg1, px: px1, csum: cs1, idx: idx1, w: w1 } = read("moe_router_mma");
        check(px0 == px1, format!("batch {n}: packed input bit-identical to moe_router's"));
        check(bits_equal(&cs0, &cs1), format!("batch {n}: group sums bit-identical to moe_router's"));
        let (el, es) = (rel(&l1, &l0), rel(&sg1, &sg0));
        worst = worst.max(el).max(es);
        check(el < 1e-6, format!("batch {n}: logits {el:.2e} from moe_router's"));
        check(es < 1e-6, format!("batch {n}: shared gate {es:.2e} from moe_router's"));
        for t in 0..n {
            let (a, b) = (&idx0[t * d.topk..(t + 1) * d.topk], &idx1[t * d.topk..(t + 1) * d.topk]);
            if a == b {
                let r = rel(&w1[t * slots..(t + 1) * slots], &w0[t * slots..(t + 1) * slots]);
                check(r < 1e-5, format!("batch {n}, token {t}: routing weights {r:.2e} from moe_router's"));
                continue;
            }
            // Another choice only where moe_router's 8th and 9th logits tie
            // within the two routers' difference.
            let mut row: Vec<f32> = l0[t * e..(t + 1) * e].to_vec();
            row.sort_by(|x, y| y.total_cmp(x));
            let gap = (row[d.topk - 1] - row[d.topk]).abs();
            check(gap < 1e-4 * row[0].abs().max(1.0), format!("batch {n}, token {t}: top-k {b:?} vs moe_router's {a:?} with a gap of {gap:.2e}"));
        }
        for t in probes(n) {
            let xt = ops::rms_norm_vec(&h[t * d.hidden..(t + 1) * d.hidden], &lw.post_norm, d.rms_eps);
            let want = ops::linear(&lw.moe.router, 0, &xt);
            let er = rel(&l1[t * e..(t + 1) * e], &want);
            check(er < 1e-5, format!("batch {n}, token {t}: logits {er:.2e} from the reference"));
        }
        if i % d.layers == 0 {
            let t0 = l1[..e].to_vec();
            match &first {
                None => first = Some(t0),
                Some(f) => check(bits_equal(f, &t0), format!("batch {n}: token 0's logits bit-identical to batch 9's")),
            }
        }
    }
    eprintln!("moe_router_mma: largest relative difference from moe_router {worst:.2e}");
    finish();
}

/// The fused MoE of a small step (one launch, grid barriers) computes what
/// the router and the two expert launches compute, bit for bit: top-k,
/// routing weights, the packed expert input and every expert output.
#[test]
fn moe_fused_equals_the_three_launches() {
    let Some(_) = gpu("moe_fused_equals_the_three_launches") else { return };
    let (_dir, _w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let bufs = dec.moe;
    let slots = d.topk + 1;
    let mut rng = Rng::new(23);
    let read = |n: usize| {
        let y: Vec<f32> = read_device(g, bufs.y.ptr(), n * slots * d.hidden).expect("y");
        let w: Vec<f32> = read_device(g, bufs.topk_w.ptr(), n * slots).expect("weights");
        let idx: Vec<i32> = read_device(g, bufs.topk_idx.ptr(), n * d.topk).expect("top-k");
        let px: Vec<u16> = read_device(g, bufs.px_in.px.ptr(), qmm::packed_len(n, d.hidden)).expect("px");
        let cs: Vec<f32> = read_device(g, bufs.px_in.csum.ptr(), n * d.hidden / 64).expect("sums");
        (y, w, idx, px, cs)
    };
    // Every layer (each its own router and experts), several sizes, and the
    // barrier counter reused across launches.
    for (i, &n) in [1usize, 2, 5, 8, 1, 8].iter().enumerate() {
        let l = &m.weights.layers[i % d.layers];
        let h = rng.vec(n * d.hidden, -2.0, 2.0);
        write_device(g, dec.h.ptr(), &h).expect("h");
        qmm::router(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, HILO, CORES).expect("router");
        qmm::experts(g, k, d, &l.moe, true, &bufs, n, HILO).expect("gate/up");
        qmm::experts(g, k, d, &l.moe, false, &bufs, n, HILO).expect("down");
        let (y3, w3, idx3, px3, cs3) = read(n);
        // Poison the outputs, then the fused launch.
        write_device(g, bufs.y.ptr(), &vec![f32::NAN; n * slots * d.hidden]).expect("poison y");
        write_device(g, bufs.topk_w.ptr(), &vec![f32::NAN; n * slots]).expect("poison w");
        write_device(g, bufs.topk_idx.ptr(), &vec![-7i32; n * d.topk]).expect("poison ids");
        write_device(g, bufs.px_in.px.ptr(), &vec![0xFFFFu16; qmm::packed_len(n, d.hidden)]).expect("poison px");
        qmm::moe_fused(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, n, None).expect("fused");
        let (y1, w1, idx1, px1, cs1) = read(n);
        check(idx1 == idx3, format!("batch {n}, layer {}: fused top-k equals the router's", i % d.layers));
        check(bits_equal(&w1, &w3), format!("batch {n}: fused routing weights bit-identical"));
        check(px1 == px3 && bits_equal(&cs1, &cs3), format!("batch {n}: fused packed expert input bit-identical"));
        let diff = y1.iter().zip(&y3).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        check(diff == 0, format!("batch {n}: fused expert outputs bit-identical ({diff} of {} differ)", y1.len()));
    }
    let l = &m.weights.layers[0];
    let nine = qmm::moe_fused(g, k, d, &l.moe, l.post_norm, dec.h, &bufs, qmm::MOE_FUSED_TOK + 1, None).unwrap_err().to_string();
    check(nine.contains("tokens"), nine);
    finish();
}

#[test]
fn launchers_refuse_what_the_kernels_cannot_run() {
    let Some(_) = gpu("launchers_refuse_what_the_kernels_cannot_run") else { return };
    let (_dir, _w, be) = setup();
    let m = be.model();
    let (g, k, d) = (&*m.gpu, &m.kernels, &m.dims);
    let dec = m.mem.decode;
    let l = &m.weights.layers[0];
    let MixerDev::DeltaNet(gd) = &l.mixer else { panic!("layer 0 is DeltaNet") };
    let seg = |w| DenseSeg { w, out: dec.proj, out_stride: d.proj_stride(), epilogue: Epilogue::Store };
    let too_many = qmm::dense(g, k, &[seg(&gd.in_qkv)], dec.moe.px_in, qmm::MAX_DECODE_BATCH + 1, HILO, None).unwrap_err().to_string();
    check(too_many.contains("tokens"), too_many);
    let mixed = qmm::dense(g, k, &[seg(&gd.in_qkv), seg(&gd.out)], dec.moe.px_in, 1, HILO, None).unwrap_err().to_string();
    check(mixed.contains("columns"), mixed);
    let eight_bit = qmm::dense(g, k, &[seg(&l.moe.router)], dec.moe.px_in, 1, HILO, None).unwrap_err().to_string();
    check(eight_bit.contains("4-bit"), eight_bit);
    let short = qmm::PackedRows { px: DevSlice::<u16>::new(dec.moe.px_in.px.ptr(), 10), csum: dec.moe.px_in.csum };
    let small = qmm::dense(g, k, &[seg(&gd.in_qkv)], short, 1, HILO, None).unwrap_err().to_string();
    check(small.contains("holds 10"), small);
    let logits = DenseSeg { w: &m.weights.lm_head, out: dec.logits, out_stride: d.vocab, epilogue: Epilogue::Logits };
    let nokeys = qmm::dense(g, k, &[logits], dec.moe.px_in, 1, HILO, None).unwrap_err().to_string();
    check(nokeys.contains("argmax"), nokeys);
    finish();
}
