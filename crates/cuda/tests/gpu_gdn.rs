//! The Gated DeltaNet kernels (kernels/gdn.cu) against lily-cpu's reference
//! (`lily_cpu::reference::deltanet`: conv step, per-token preparation, the
//! delta-rule recurrence, gated norm), at the real shape and at the tiny
//! fixture's and the tiny synthetic preset's shapes (head dims 128, 32, 64).
//!
//! Prefill cases: calls of 37, 150, 1, 64 and 65 tokens on one sequence
//! (partial last chunks, one token, exactly one chunk, one past a chunk, each
//! call starting from the state the previous ones left), gates with strong
//! decay, 4,096 tokens in one call at the real shape after an earlier
//! prefill, a decode step continuing from a prefill, and 19 sequences' pieces
//! in one `prefill_pieces` call (launch groups by piece count and by
//! scratch rows, a snapshot inside one piece) against each alone, bit for
//! bit. Scratch buffers start
//! as NaN, so a kernel reading something no kernel wrote fails the check.
//!
//! Tolerance: relative L2 error 1e-4 for the prefill outputs and states (the
//! gate the fp32 kernels had), 5e-5 for the fp32 decode step. The prefill
//! runs every product as three bf16 tensor-core products (see the header of
//! gdn.cu); a model of that arithmetic predicts 4e-6 .. 1.6e-5, and the
//! printed errors say what the device measures.
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1` there); without a GPU each test
//! prints "skipped: no CUDA device" and returns.

mod common;

use std::sync::Arc;

use common::*;
use lily_cpu::reference::deltanet::{self as dn, DeltaDims, DeltaInputs};
use lily_cuda::device::{DeviceBuffer, Gpu};
use lily_cuda::dims::Dims;
use lily_cuda::gdn::{self, GdnScratch, GdnState, MixOut};
use lily_cuda::kernels::Kernels;
use lily_cuda::weights::{DeltaNetDev, QMat};
use rayon::prelude::*;

const NAN: f32 = f32::NAN;
const PREFILL_TOL: f64 = 1e-4;
const DECODE_TOL: f64 = 5e-5;

fn three() -> [(&'static str, Dims); 3] {
    [("tiny", tiny_dims()), ("synth tiny", synth_tiny_dims()), ("production", prod_dims())]
}

/// The parameters of the mixer the kernels read (the projections are given
/// as their outputs, random rows).
struct HostGdn {
    conv_w: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
}

/// How fast the state forgets: g = -exp(A_log) softplus(a + dt_bias) per token.
#[derive(Clone, Copy)]
enum Decay {
    /// g from about -0.8 to -0.0003, so early tokens still matter at the end
    /// of a chunk and of a call.
    Mild,
    /// g down to about -40: a chunk's early tokens are forgotten by its end
    /// (exp(G) underflows to zero inside a chunk).
    Strong,
}

fn gdn_setup(gpu: &Arc<Gpu>, d: &Dims, seed: u64, decay: Decay) -> (HostGdn, Vec<DeviceBuffer>, DeltaNetDev) {
    let mut rng = Rng::new(seed);
    let (a_log, dt_bias) = match decay {
        Decay::Mild => (rng.vec(d.gv_heads, -4.0, -1.0), rng.vec(d.gv_heads, -2.0, 0.0)),
        Decay::Strong => (rng.vec(d.gv_heads, 0.5, 2.5), rng.vec(d.gv_heads, 0.0, 2.0)),
    };
    let w = HostGdn { conv_w: rng.vec(d.conv_dim * 4, -0.6, 0.6), a_log, dt_bias, norm: rng.vec(d.gv_dim, 0.5, 1.5) };
    let bufs = vec![upload(gpu, &w.conv_w), upload(gpu, &w.a_log), upload(gpu, &w.dt_bias), upload(gpu, &w.norm)];
    let q = QMat::default();
    let dev =
        DeltaNetDev { in_qkv: q, in_z: q, in_a: q, in_b: q, out: q, conv_w: bufs[0].ptr(), a_log: bufs[1].ptr(), dt_bias: bufs[2].ptr(), norm: bufs[3].ptr() };
    (w, bufs, dev)
}

/// `n` in-projection rows [qkv | z | a | b | padding] of stride proj_stride.
fn gdn_proj_rows(rng: &mut Rng, d: &Dims, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n * d.proj_stride());
    for _ in 0..n {
        v.extend(rng.vec(d.conv_dim, -1.0, 1.0));
        v.extend(rng.vec(d.gdn_val_dim(), -2.0, 2.0));
        v.extend(rng.vec(2 * d.gv_heads, -2.0, 2.0));
        v.extend(vec![0.0; d.proj_stride() - d.gdn_proj()]);
    }
    v
}

/// One sequence as lily-cpu's reference runs it: conv window and recurrent state.
struct RefSeq {
    window: Vec<f32>,
    state: Vec<f32>,
}

impl RefSeq {
    fn new(d: &Dims) -> Self {
        RefSeq { window: vec![0.0; 3 * d.conv_dim], state: vec![0.0; d.gdn_state_floats()] }
    }

    /// The mixer output (after the gated norm) of the `n` tokens of `proj`,
    /// [n][value heads * dv]; advances the window and the state.
    fn run(&mut self, d: &Dims, w: &HostGdn, proj: &[f32], n: usize) -> Vec<f64> {
        let ps = d.proj_stride();
        let dims = DeltaDims { key_heads: d.gk_heads, value_heads: d.gv_heads, key_dim: d.gk_dim, value_dim: d.gv_dim };
        let mut x = DeltaInputs { tokens: 0, q: vec![], k: vec![], v: vec![], g: vec![], beta: vec![] };
        let gates = d.conv_dim + d.gdn_val_dim();
        for t in 0..n {
            let row = &proj[t * ps..(t + 1) * ps];
            let conv = dn::conv_step(&mut self.window, &w.conv_w, 4, &row[..d.conv_dim]);
            let (a, b) = (&row[gates..gates + d.gv_heads], &row[gates + d.gv_heads..gates + 2 * d.gv_heads]);
            dn::prepare_token_with(&dims, &w.a_log, &w.dt_bias, &conv, a, b, &mut x);
        }
        let o = self.delta_rule(d, &x);
        let (hv, dv) = (d.gv_heads, d.gv_dim);
        let mut out = Vec::with_capacity(n * hv * dv);
        for t in 0..n {
            for h in 0..hv {
                let z = &proj[t * ps + d.conv_dim + h * dv..][..dv];
                out.extend(dn::gated_norm(&o[(t * hv + h) * dv..][..dv], z, &w.norm, d.rms_eps).into_iter().map(f64::from));
            }
        }
        out
    }

    /// `dn::delta_rule_recurrent` run per key head (its value heads share
    /// nothing with the others), in parallel; o as [tokens][value heads][dv].
    fn delta_rule(&mut self, d: &Dims, x: &DeltaInputs) -> Vec<f32> {
        let (hk, hv, dk, dv, n) = (d.gk_heads, d.gv_heads, d.gk_dim, d.gv_dim, x.tokens);
        let r = hv / hk;
        let group = DeltaDims { key_heads: 1, value_heads: r, key_dim: dk, value_dim: dv };
        let outs: Vec<Vec<f32>> = self
            .state
            .par_chunks_mut(r * dk * dv)
            .enumerate()
            .map(|(kh, st)| {
                let pick = |src: &[f32], heads: usize, h0: usize, len: usize| -> Vec<f32> {
                    (0..n).flat_map(|t| src[(t * heads + h0) * len..][..r.min(heads) * len].to_vec()).collect()
                };
                let xi = DeltaInputs {
                    tokens: n,
                    q: (0..n).flat_map(|t| x.q[(t * hk + kh) * dk..][..dk].to_vec()).collect(),
                    k: (0..n).flat_map(|t| x.k[(t * hk + kh) * dk..][..dk].to_vec()).collect(),
                    v: pick(&x.v, hv, kh * r, dv),
                    g: pick(&x.g, hv, kh * r, 1),
                    beta: pick(&x.beta, hv, kh * r, 1),
                };
                dn::delta_rule_recurrent(&group, st, &xi)
            })
            .collect();
        let mut o = vec![0f32; n * hv * dv];
        for (kh, og) in outs.iter().enumerate() {
            for t in 0..n {
                o[(t * hv + kh * r) * dv..][..r * dv].copy_from_slice(&og[t * r * dv..][..r * dv]);
            }
        }
        o
    }
}

/// Prefill scratch for `max_t` tokens, every buffer filled with NaN.
fn nan_scratch(gpu: &Arc<Gpu>, d: &Dims, max_t: usize) -> (Vec<DeviceBuffer>, GdnScratch) {
    let b: Vec<DeviceBuffer> = GdnScratch::sizes(d, max_t).iter().map(|n| upload(gpu, &vec![NAN; *n])).collect();
    let s = GdnScratch {
        q: b[0].ptr(),
        k: b[1].ptr(),
        vu: b[2].ptr(),
        gg: b[3].ptr(),
        bb: b[4].ptr(),
        w: b[5].ptr(),
        gc: b[6].ptr(),
        hs: b[7].ptr(),
        o: b[8].ptr(),
        max_tokens: max_t,
    };
    (b, s)
}

/// One sequence on the device (slot 0 of a one-slot state) with its reference.
struct DevSeq {
    conv: DeviceBuffer,
    state: DeviceBuffer,
    r: RefSeq,
    pos: usize,
}

impl DevSeq {
    fn new(gpu: &Arc<Gpu>, d: &Dims) -> Self {
        DevSeq { conv: zeros(gpu, d.gdn_conv_floats() * 4), state: zeros(gpu, d.gdn_state_floats() * 4), r: RefSeq::new(d), pos: 0 }
    }

    /// Prefills `t` random tokens on the device and in the reference and
    /// checks the outputs and the state after the call.
    #[allow(clippy::too_many_arguments)]
    fn prefill_and_check(
        &mut self,
        gpu: &Arc<Gpu>,
        k: &Kernels,
        d: &Dims,
        w: &HostGdn,
        dev: &DeltaNetDev,
        s: &GdnScratch,
        rng: &mut Rng,
        t: usize,
        label: &str,
    ) {
        let ps = d.proj_stride();
        let proj = gdn_proj_rows(rng, d, t);
        let pb = upload(gpu, &proj);
        let mix = upload(gpu, &vec![NAN; t * d.gdn_val_dim()]);
        gdn::prefill(gpu, k, d, dev, self.conv.ptr(), self.state.ptr(), pb.ptr(), ps, t, self.pos, s, MixOut::F32(mix.ptr()), None).expect("launch");
        let got: Vec<f32> = download(gpu, mix.ptr(), t * d.gdn_val_dim());
        let want = self.r.run(d, w, &proj, t);
        assert_close(&format!("gdn prefill {label}: {t} tokens at {}", self.pos), &got, &want, PREFILL_TOL);
        let st: Vec<f32> = download(gpu, self.state.ptr(), d.gdn_state_floats());
        let want_st: Vec<f64> = self.r.state.iter().map(|v| *v as f64).collect();
        assert_close(&format!("gdn prefill {label}: state after {} tokens", self.pos + t), &st, &want_st, PREFILL_TOL);
        self.pos += t;
    }

    /// One decode step continuing from the conv ring and state.
    #[allow(clippy::too_many_arguments)]
    fn decode_and_check(&mut self, gpu: &Arc<Gpu>, k: &Kernels, d: &Dims, w: &HostGdn, dev: &DeltaNetDev, rng: &mut Rng, label: &str) {
        let ps = d.proj_stride();
        let st = GdnState { conv: self.conv.ptr(), conv_slot_stride: d.gdn_conv_floats(), state: self.state.ptr(), state_slot_stride: d.gdn_state_floats() };
        let proj = gdn_proj_rows(rng, d, 1);
        let pb = upload(gpu, &proj);
        let (pos, slot) = (upload(gpu, &[self.pos as i32]), upload(gpu, &[0i32]));
        let mix = upload(gpu, &vec![NAN; d.gdn_val_dim()]);
        gdn::decode(gpu, k, d, dev, &st, pb.ptr(), ps, pos.ptr(), slot.ptr(), MixOut::F32(mix.ptr()), 1).expect("decode");
        let got: Vec<f32> = download(gpu, mix.ptr(), d.gdn_val_dim());
        assert_close(&format!("gdn decode after prefill {label} at {}", self.pos), &got, &self.r.run(d, w, &proj, 1), PREFILL_TOL);
        self.pos += 1;
    }
}

#[test]
fn deltanet_decode_step_matches_recurrence() {
    let Some(gpu) = gpu("deltanet_decode_step_matches_recurrence") else {
        return;
    };
    // Head dims 32, 64 and 128: clusters of 1, 2 and 4 blocks a head.
    for (label, d) in three() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let (w, _wb, dev) = gdn_setup(&gpu, &d, 900, Decay::Mild);
        let slots = 3;
        let state_of = |conv: &DeviceBuffer, state: &DeviceBuffer| GdnState {
            conv: conv.ptr(),
            conv_slot_stride: d.gdn_conv_floats(),
            state: state.ptr(),
            state_slot_stride: d.gdn_state_floats(),
        };
        let conv = zeros(&gpu, slots * d.gdn_conv_floats() * 4);
        let state = zeros(&gpu, slots * d.gdn_state_floats() * 4);
        let st = state_of(&conv, &state);
        // A second copy stepped with packed output (the decode step's qmm
        // input), where a head's 64-column groups exist.
        let packed = d.gv_dim.is_multiple_of(64);
        let conv2 = zeros(&gpu, slots * d.gdn_conv_floats() * 4);
        let state2 = zeros(&gpu, slots * d.gdn_state_floats() * 4);
        let st2 = state_of(&conv2, &state2);
        // A third copy stepped one sequence at a time: one token takes the
        // split kernel (a head over a cluster of blocks), two the
        // whole-head one; both must give the same bits.
        let conv3 = zeros(&gpu, slots * d.gdn_conv_floats() * 4);
        let state3 = zeros(&gpu, slots * d.gdn_state_floats() * 4);
        let st3 = state_of(&conv3, &state3);
        let mut refs = [RefSeq::new(&d), RefSeq::new(&d)];
        let mut rng = Rng::new(901);
        let ps = d.proj_stride();
        let val = d.gdn_val_dim();
        // Two sequences in slots 2 and 0, stepped together for 6 positions.
        for step in 0..6i32 {
            let proj = gdn_proj_rows(&mut rng, &d, 2);
            let pb = upload(&gpu, &proj);
            let pos = upload(&gpu, &[step, step]);
            let slot = upload(&gpu, &[2i32, 0]);
            let mix = upload(&gpu, &vec![NAN; 2 * val]);
            gdn::decode(&gpu, &k, &d, &dev, &st, pb.ptr(), ps, pos.ptr(), slot.ptr(), MixOut::F32(mix.ptr()), 2).expect("launch");
            let got: Vec<f32> = download(&gpu, mix.ptr(), 2 * val);
            let mut want = refs[0].run(&d, &w, &proj[..ps], 1);
            want.extend(refs[1].run(&d, &w, &proj[ps..], 1));
            assert_close(&format!("gdn decode {label} step {step}"), &got, &want, DECODE_TOL);
            for r in 0..2 {
                let one = upload(&gpu, &vec![NAN; val]);
                let (p1, s1) = (upload(&gpu, &[step]), upload(&gpu, &[[2i32, 0][r]]));
                let row = pb.ptr() + (r * ps * 4) as u64;
                gdn::decode(&gpu, &k, &d, &dev, &st3, row, ps, p1.ptr(), s1.ptr(), MixOut::F32(one.ptr()), 1).expect("launch alone");
                let alone: Vec<f32> = download(&gpu, one.ptr(), val);
                let same = alone.iter().zip(&got[r * val..(r + 1) * val]).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "gdn decode {label} step {step}: sequence {r} alone differs from the batch of two");
            }
            if packed {
                let px = upload(&gpu, &vec![0xFFFFu16; 2 * 2 * val]);
                let csum = upload(&gpu, &vec![NAN; 2 * val / 64]);
                let out = MixOut::Packed { px: px.ptr(), csum: csum.ptr() };
                gdn::decode(&gpu, &k, &d, &dev, &st2, pb.ptr(), ps, pos.ptr(), slot.ptr(), out, 2).expect("launch packed");
                check_packed(&format!("gdn decode {label} step {step}"), &gpu, &got, &px, &csum, val);
            }
        }
        let s2: Vec<f32> = download(&gpu, state.ptr() + (2 * d.gdn_state_floats() * 4) as u64, d.gdn_state_floats());
        let want: Vec<f64> = refs[0].state.iter().map(|v| *v as f64).collect();
        assert_close(&format!("gdn decode {label} final state"), &s2, &want, DECODE_TOL);
        let n = slots * d.gdn_state_floats();
        let (a, b): (Vec<f32>, Vec<f32>) = (download(&gpu, state.ptr(), n), download(&gpu, state3.ptr(), n));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "gdn decode {label}: the states stepped alone differ from the batch's");
        if packed {
            // The packed run computed the same state, bit for bit.
            let n = slots * d.gdn_state_floats();
            let (a, b): (Vec<f32>, Vec<f32>) = (download(&gpu, state.ptr(), n), download(&gpu, state2.ptr(), n));
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "gdn decode {label}: the packed run's state differs from the f32 run's");
        }
    }
    finish();
}

/// The packed output of a decode step against its f32 output (`want`, the
/// same step): hi + lo through qmm's column permutation equals y to fp16
/// hi/lo precision, and each 64-column group sum is the sum of the stored
/// hi + lo.
fn check_packed(what: &str, gpu: &Arc<Gpu>, want: &[f32], px: &DeviceBuffer, csum: &DeviceBuffer, val: usize) {
    let ntok = want.len() / val;
    let px: Vec<u16> = download(gpu, px.ptr(), ntok * 2 * val);
    let cs: Vec<f32> = download(gpu, csum.ptr(), ntok * val / 64);
    for t in 0..ntok {
        let row = &px[t * 2 * val..(t + 1) * 2 * val];
        let unpacked: Vec<f32> = (0..val)
            .map(|c| {
                let pos = lily_cuda::qmm::px_position(c);
                half::f16::from_bits(row[pos]).to_f32() + half::f16::from_bits(row[val + pos]).to_f32()
            })
            .collect();
        let y: Vec<f64> = want[t * val..(t + 1) * val].iter().map(|v| *v as f64).collect();
        assert_close(&format!("{what}: packed hi + lo of token {t}"), &unpacked, &y, 1e-6);
        for (gi, got) in cs[t * val / 64..(t + 1) * val / 64].iter().enumerate() {
            let sum: f64 = unpacked[gi * 64..(gi + 1) * 64].iter().map(|v| *v as f64).sum();
            assert!(((*got as f64) - sum).abs() <= 1e-5 * sum.abs().max(1.0), "{what}: group sum {gi} of token {t}: {got} vs {sum}");
        }
    }
}

#[test]
fn chunked_deltanet_prefill_matches_recurrence() {
    let Some(gpu) = gpu("chunked_deltanet_prefill_matches_recurrence") else {
        return;
    };
    for (label, d) in three() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let (w, _wb, dev) = gdn_setup(&gpu, &d, 950, Decay::Mild);
        let (_sb, s) = nan_scratch(&gpu, &d, 256);
        let mut seq = DevSeq::new(&gpu, &d);
        let mut rng = Rng::new(951);
        // Partial chunks, one token, one chunk, one past a chunk; each call
        // starts from the state (and conv ring) the previous ones left.
        for t in [37usize, 150, 1, 64, 65] {
            seq.prefill_and_check(&gpu, &k, &d, &w, &dev, &s, &mut rng, t, label);
        }
        seq.decode_and_check(&gpu, &k, &d, &w, &dev, &mut rng, label);
        // And a prefill after that decode step.
        seq.prefill_and_check(&gpu, &k, &d, &w, &dev, &s, &mut rng, 100, label);
    }
    finish();
}

#[test]
fn pieces_of_many_sequences_in_one_call_equal_each_alone() {
    let Some(gpu) = gpu("pieces_of_many_sequences_in_one_call_equal_each_alone") else {
        return;
    };
    for (label, d) in three() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let (_w, _wb, dev) = gdn_setup(&gpu, &d, 960, Decay::Mild);
        // Lengths with partial chunks, a single token, whole chunks; 19
        // pieces: more than one launch group (gdn::MAX_PIECES), and the
        // 256-row scratch forces groups by rows too. Piece 2 takes a
        // prefix snapshot after its first chunk. Each sequence starts from
        // its own earlier state (a first prefill of a few tokens).
        let lens: Vec<usize> = (0..19).map(|i| [37usize, 150, 130, 1, 64, 65][i % 6]).collect();
        let n = lens.len();
        let (cf, sf) = (d.gdn_conv_floats(), d.gdn_state_floats());
        let val = d.gdn_val_dim();
        let ps = d.proj_stride();
        let mut rng = Rng::new(961);
        let warm: Vec<Vec<f32>> = (0..n).map(|i| gdn_proj_rows(&mut rng, &d, 3 + i % 4)).collect();
        let rows: Vec<Vec<f32>> = lens.iter().map(|&t| gdn_proj_rows(&mut rng, &d, t)).collect();
        let (_sb, scratch) = nan_scratch(&gpu, &d, 256);
        // Two copies of every sequence's state, slots 0..n (and n for the
        // snapshot): `a` stepped alone, `b` in one call.
        let run = |together: bool| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let conv = zeros(&gpu, (n + 1) * cf * 4);
            let state = zeros(&gpu, (n + 1) * sf * 4);
            let slot = |i: usize| (conv.ptr() + (i * cf * 4) as u64, state.ptr() + (i * sf * 4) as u64);
            for (i, wr) in warm.iter().enumerate() {
                let pb = upload(&gpu, wr);
                let mix = upload(&gpu, &vec![NAN; wr.len() / ps * val]);
                let (c, st) = slot(i);
                gdn::prefill(&gpu, &k, &d, &dev, c, st, pb.ptr(), ps, wr.len() / ps, 0, &scratch, MixOut::F32(mix.ptr()), None).expect("warm-up");
            }
            let total: usize = lens.iter().sum();
            let all: Vec<f32> = rows.concat();
            let pb = upload(&gpu, &all);
            let out = upload(&gpu, &vec![NAN; total * val]);
            let mut pieces = Vec::new();
            let mut row0 = 0;
            for (i, &t) in lens.iter().enumerate() {
                let (c, st) = slot(i);
                let (cc, cst) = slot(n);
                let capture = (i == 2).then_some(gdn::GdnCapture { conv: cc, state: cst, at: 64 });
                let p0 = warm[i].len() / ps;
                let mix = MixOut::F32(out.ptr() + (row0 * val * 4) as u64);
                pieces.push(gdn::PrefillPiece { conv: c, state: st, proj: pb.ptr() + (row0 * ps * 4) as u64, t, p0, mix, capture });
                row0 += t;
            }
            if together {
                gdn::prefill_pieces(&gpu, &k, &d, &dev, &pieces, ps, &scratch).expect("pieces");
            } else {
                for p in &pieces {
                    gdn::prefill_pieces(&gpu, &k, &d, &dev, std::slice::from_ref(p), ps, &scratch).expect("alone");
                }
            }
            (download(&gpu, out.ptr(), total * val), download(&gpu, state.ptr(), (n + 1) * sf), download(&gpu, conv.ptr(), (n + 1) * cf))
        };
        let (oa, sa, ca) = run(false);
        let (ob, sb, cb) = run(true);
        let same = |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(oa.iter().all(|v| v.is_finite()), "gdn pieces {label}: an output row was not written");
        assert!(same(&oa, &ob), "gdn pieces {label}: outputs of the pieces in one call differ from each alone");
        assert!(same(&sa, &sb), "gdn pieces {label}: states (and the snapshot's) differ");
        assert!(same(&ca, &cb), "gdn pieces {label}: conv rings (and the snapshot's) differ");
        println!("gdn pieces {label}: {n} sequences of {} tokens in one call equal each alone, bit for bit", lens.iter().sum::<usize>());
    }
    finish();
}

#[test]
fn chunked_deltanet_prefill_with_strong_decay() {
    let Some(gpu) = gpu("chunked_deltanet_prefill_with_strong_decay") else {
        return;
    };
    for (label, d) in three() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let (w, _wb, dev) = gdn_setup(&gpu, &d, 960, Decay::Strong);
        let (_sb, s) = nan_scratch(&gpu, &d, 192);
        let mut seq = DevSeq::new(&gpu, &d);
        let mut rng = Rng::new(961);
        for t in [130usize, 64, 1] {
            seq.prefill_and_check(&gpu, &k, &d, &w, &dev, &s, &mut rng, t, &format!("{label}, strong decay"));
        }
    }
    finish();
}

#[test]
fn chunked_deltanet_prefill_of_4096_tokens_at_the_real_shape() {
    let Some(gpu) = gpu("chunked_deltanet_prefill_of_4096_tokens_at_the_real_shape") else {
        return;
    };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let (w, _wb, dev) = gdn_setup(&gpu, &d, 970, Decay::Mild);
    let n = 4096;
    let (_sb, s) = nan_scratch(&gpu, &d, n);
    let mut seq = DevSeq::new(&gpu, &d);
    let mut rng = Rng::new(971);
    seq.prefill_and_check(&gpu, &k, &d, &w, &dev, &s, &mut rng, 37, "production");
    seq.prefill_and_check(&gpu, &k, &d, &w, &dev, &s, &mut rng, n, "production");

    // Time of one 4,096-token call (informative, not asserted; `lily bench`
    // is the measurement of record), on a copy of the state.
    let proj = upload(&gpu, &gdn_proj_rows(&mut rng, &d, n));
    let mix = zeros(&gpu, n * d.gdn_val_dim() * 4);
    let ps = d.proj_stride();
    let run =
        || gdn::prefill(&gpu, &k, &d, &dev, seq.conv.ptr(), seq.state.ptr(), proj.ptr(), ps, n, seq.pos, &s, MixOut::F32(mix.ptr()), None).expect("launch");
    run();
    gpu.synchronize().expect("warm-up");
    let reps = 10;
    let t0 = std::time::Instant::now();
    for _ in 0..reps {
        run();
    }
    gpu.synchronize().expect("timed runs");
    eprintln!("gdn prefill, 4096 tokens, real shape: {:.3} ms per call (mean of {reps})", t0.elapsed().as_secs_f64() * 1e3 / reps as f64);
    finish();
}

/// No GPU needed: the reference run per key head (in parallel) is the
/// reference run on all heads at once, so the GPU checks above compare with
/// lily-cpu's recurrence itself.
#[test]
fn reference_split_by_key_head_equals_the_whole_recurrence() {
    for (label, d) in [("tiny", tiny_dims()), ("synth tiny", synth_tiny_dims())] {
        let mut rng = Rng::new(990);
        let w = HostGdn {
            conv_w: rng.vec(d.conv_dim * 4, -0.6, 0.6),
            a_log: rng.vec(d.gv_heads, -4.0, 2.0),
            dt_bias: rng.vec(d.gv_heads, -2.0, 1.0),
            norm: rng.vec(d.gv_dim, 0.5, 1.5),
        };
        let n = 70;
        let proj = gdn_proj_rows(&mut rng, &d, n);
        let mut split = RefSeq::new(&d);
        let got = split.run(&d, &w, &proj, n);

        let ps = d.proj_stride();
        let dims = DeltaDims { key_heads: d.gk_heads, value_heads: d.gv_heads, key_dim: d.gk_dim, value_dim: d.gv_dim };
        let mut window = vec![0f32; 3 * d.conv_dim];
        let mut x = DeltaInputs { tokens: 0, q: vec![], k: vec![], v: vec![], g: vec![], beta: vec![] };
        let gates = d.conv_dim + d.gdn_val_dim();
        for t in 0..n {
            let row = &proj[t * ps..(t + 1) * ps];
            let conv = dn::conv_step(&mut window, &w.conv_w, 4, &row[..d.conv_dim]);
            dn::prepare_token_with(
                &dims,
                &w.a_log,
                &w.dt_bias,
                &conv,
                &row[gates..gates + d.gv_heads],
                &row[gates + d.gv_heads..gates + 2 * d.gv_heads],
                &mut x,
            );
        }
        let mut state = vec![0f32; d.gdn_state_floats()];
        let o = dn::delta_rule_recurrent(&dims, &mut state, &x);
        let dv = d.gv_dim;
        let want: Vec<f32> = (0..n * d.gv_heads)
            .flat_map(|th| {
                let (t, h) = (th / d.gv_heads, th % d.gv_heads);
                dn::gated_norm(&o[th * dv..][..dv], &proj[t * ps + d.conv_dim + h * dv..][..dv], &w.norm, d.rms_eps)
            })
            .collect();
        assert_eq!(got.len(), want.len(), "{label}");
        assert!(got.iter().zip(&want).all(|(a, b)| *a == *b as f64), "{label}: outputs differ");
        assert_eq!(split.state, state, "{label}: states differ");
    }
}
