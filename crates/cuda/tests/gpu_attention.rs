//! The attention family (kernels/attention.cu) against a naive f64
//! reference: q/k norm + RoPE + KV-cache write, split-KV decode + combine,
//! causal flash prefill; at the real Qwen3.6-35B-A3B shape and at the tiny
//! fixture's shape, on random inputs (fresh per case; outputs poisoned
//! before each launch). The paged cache of every case holds NaN in each
//! sequence's rows past its last key and in the blocks no sequence owns,
//! and -1 in unused block-table entries, so a kernel that reads past a
//! context fails loudly.
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1` there); without a GPU each test
//! prints "skipped: no CUDA device" and returns.
//!
//! Tolerances (relative L2 error against f64 math on the same fp16 cache):
//! decode 2e-5 (q and the softmax weights enter the tensor cores as fp16 hi +
//! lo pairs, ~22 significant bits, fp32 accumulation); prefill 2e-3 (q and
//! the weights in fp16, 11 significant bits); prep q 1e-5, K and V in the
//! cache 1e-3 (fp16).

mod common;

use std::sync::Arc;

use common::*;
use lily_cuda::attention::{self, DecodeScratch, KvView, QOut};
use lily_cuda::device::{DeviceBuffer, Gpu};
use lily_cuda::dims::{Dims, KV_BLOCK};
use lily_cuda::gdn::MixOut;
use lily_cuda::kernels::Kernels;
use lily_cuda::weights::{AttentionDev, QMat};
use rayon::prelude::*;

const NAN: f32 = f32::NAN;

/// One layer's paged KV cache holding several sequences (slots), each with
/// its own scrambled block table over one shared pool of blocks.
struct Cache {
    k: Vec<f32>,
    v: Vec<f32>,
    kb: DeviceBuffer,
    vb: DeviceBuffer,
    table: Vec<i32>,
    tb: DeviceBuffer,
    bt_stride: usize,
}

impl Cache {
    /// Slot s holds `lens[s]` positions of random fp16-exact values; rows
    /// past them and the two spare blocks hold NaN, table entries past a
    /// slot's blocks are -1.
    fn random(gpu: &Arc<Gpu>, d: &Dims, lens: &[usize], seed: u64) -> Cache {
        let blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(KV_BLOCK).max(1)).collect();
        let nblk = blocks.iter().sum::<usize>() + 2;
        let bt_stride = blocks.iter().max().copied().unwrap_or(1) + 1;
        let mut rng = Rng::new(seed);
        let mut perm: Vec<i32> = (0..nblk as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let row = KV_BLOCK * d.a_head_dim;
        let per = d.a_kv_heads * row;
        let mut k = vec![NAN; nblk * per];
        let mut v = vec![NAN; nblk * per];
        let mut table = vec![-1i32; lens.len() * bt_stride];
        let mut next = 0;
        for (s, (&len, &nb)) in lens.iter().zip(&blocks).enumerate() {
            for b in 0..nb {
                let phys = perm[next] as usize;
                next += 1;
                table[s * bt_stride + b] = phys as i32;
                let keys = len.saturating_sub(b * KV_BLOCK).min(KV_BLOCK);
                for g in 0..d.a_kv_heads {
                    let base = (phys * d.a_kv_heads + g) * row;
                    for x in &mut k[base..base + keys * d.a_head_dim] {
                        *x = f16_round(rng.uniform(-1.5, 1.5));
                    }
                    for x in &mut v[base..base + keys * d.a_head_dim] {
                        *x = f16_round(rng.uniform(-2.0, 2.0));
                    }
                }
            }
        }
        let kb = upload(gpu, &k.iter().map(|x| f16_bits(*x)).collect::<Vec<_>>());
        let vb = upload(gpu, &v.iter().map(|x| f16_bits(*x)).collect::<Vec<_>>());
        let tb = upload(gpu, &table);
        Cache { k, v, kb, vb, table, tb, bt_stride }
    }

    /// Head `g`'s row of `which` (self.k or self.v, or a download of them)
    /// at position `pos` of slot `slot`.
    fn at<'a>(&self, d: &Dims, which: &'a [f32], slot: usize, pos: usize, g: usize) -> &'a [f32] {
        let blk = self.table[slot * self.bt_stride + pos / KV_BLOCK] as usize;
        let off = ((blk * d.a_kv_heads + g) * KV_BLOCK + pos % KV_BLOCK) * d.a_head_dim;
        &which[off..off + d.a_head_dim]
    }

    fn view(&self) -> KvView {
        KvView { k: self.kb.ptr(), v: self.vb.ptr(), block_table: self.tb.ptr(), bt_stride: self.bt_stride }
    }

    /// Device address of slot `slot`'s block-table row.
    fn row_ptr(&self, slot: usize) -> u64 {
        self.tb.ptr() + (slot * self.bt_stride * 4) as u64
    }
}

/// sigmoid(gate) * softmax(q K^T / sqrt(hd)) V over keys 0..=last of `slot`.
fn attend(d: &Dims, c: &Cache, slot: usize, q: &[f32], head: usize, last: usize, gate: &[f32]) -> Vec<f64> {
    let g = head / (d.a_heads / d.a_kv_heads);
    let scale = 1.0 / (d.a_head_dim as f64).sqrt();
    let scores: Vec<f64> = (0..=last).map(|p| dot(q, c.at(d, &c.k, slot, p, g)) * scale).collect();
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut o = vec![0f64; d.a_head_dim];
    for (p, w) in e.iter().enumerate() {
        for (j, x) in c.at(d, &c.v, slot, p, g).iter().enumerate() {
            o[j] += w / z * *x as f64;
        }
    }
    o.iter().zip(gate).map(|(x, gt)| x * sigmoid(*gt as f64)).collect()
}

/// A decode batch: token t attends over slot `slots[t]`'s first `lens[t]`
/// keys (its position is lens[t] - 1).
struct DecodeCase {
    label: &'static str,
    lens: Vec<usize>,
    slots: Vec<usize>,
    /// Valid positions of every slot (at least the longest token using it).
    slot_lens: Vec<usize>,
}

impl DecodeCase {
    /// One slot per token, as long as the token's context.
    fn own(label: &'static str, lens: &[usize]) -> Self {
        DecodeCase { label, lens: lens.to_vec(), slots: (0..lens.len()).collect(), slot_lens: lens.to_vec() }
    }
    /// `n` tokens of random lengths 1..=max over `nslots` slots of `max` keys.
    fn random(label: &'static str, n: usize, max: usize, nslots: usize, seed: u64) -> Self {
        let mut r = Rng::new(seed);
        let lens: Vec<usize> = (0..n).map(|_| 1 + r.below(max)).collect();
        DecodeCase { label, lens, slots: (0..n).map(|t| t % nslots).collect(), slot_lens: vec![max; nslots] }
    }
}

/// Device inputs of one decode case, and the reference output.
struct DecodeRun {
    cache: Cache,
    qb: DeviceBuffer,
    pb: DeviceBuffer,
    posb: DeviceBuffer,
    slotb: DeviceBuffer,
    want: Vec<f64>,
}

fn decode_setup(gpu: &Arc<Gpu>, d: &Dims, case: &DecodeCase, seed: u64) -> DecodeRun {
    let cache = Cache::random(gpu, d, &case.slot_lens, seed);
    let ntok = case.lens.len();
    let mut rng = Rng::new(seed + 1);
    let q = rng.vec(ntok * d.attn_out_dim(), -1.0, 1.0);
    let ps = d.proj_stride();
    let proj = rng.vec(ntok * ps, -2.0, 2.0);
    let pos: Vec<i32> = case.lens.iter().map(|l| (*l - 1) as i32).collect();
    let slots: Vec<i32> = case.slots.iter().map(|s| *s as i32).collect();
    let want: Vec<f64> = (0..ntok * d.a_heads)
        .into_par_iter()
        .flat_map_iter(|th| {
            let (t, h) = (th / d.a_heads, th % d.a_heads);
            let qh = &q[(t * d.a_heads + h) * d.a_head_dim..][..d.a_head_dim];
            let gate = &proj[t * ps + h * 2 * d.a_head_dim + d.a_head_dim..][..d.a_head_dim];
            attend(d, &cache, case.slots[t], qh, h, case.lens[t] - 1, gate)
        })
        .collect();
    DecodeRun { qb: upload(gpu, &q), pb: upload(gpu, &proj), posb: upload(gpu, &pos), slotb: upload(gpu, &slots), cache, want }
}

/// Runs decode + combine for tokens `first .. first + ntok` of the run with
/// a scratch of `max_splits` splits; returns the f32 mixer rows.
fn decode_launch(gpu: &Arc<Gpu>, k: &Kernels, d: &Dims, r: &DecodeRun, first: usize, ntok: usize, max_splits: usize) -> Vec<f32> {
    let part_o = zeros(gpu, ntok * d.a_heads * max_splits * d.a_head_dim * 4);
    let part_ml = zeros(gpu, ntok * d.a_heads * max_splits * 2 * 4);
    let sc = DecodeScratch { part_o: part_o.ptr(), part_ml: part_ml.ptr(), max_splits };
    let mix = upload(gpu, &vec![NAN; ntok * d.attn_out_dim()]);
    let ps = d.proj_stride();
    let q = r.qb.ptr() + (first * d.attn_out_dim() * 4) as u64;
    let proj = r.pb.ptr() + (first * ps * 4) as u64;
    let pos = r.posb.ptr() + (first * 4) as u64;
    let slot = r.slotb.ptr() + (first * 4) as u64;
    attention::decode(gpu, k, d, q, &r.cache.view(), pos, slot, &sc, proj, ps, MixOut::F32(mix.ptr()), ntok).expect("launch");
    download(gpu, mix.ptr(), ntok * d.attn_out_dim())
}

#[test]
fn decode_attention_matches_reference_across_splits() {
    let Some(gpu) = gpu("decode_attention_matches_reference_across_splits") else { return };
    // Lengths around the block (64) and tile (16) boundaries and long ones,
    // each sequence in its own slot; the maximum split count (40,960 and
    // 16,384 keys cut into 128 splits under a limit of 128); 64 and 128
    // tokens of random lengths sharing 8 and 16 slots (the item list spans
    // several 32-token scan chunks and every CTA runs many items). Split
    // limits 1 (no split), 7, 64 and 128 (the memory plan's cap).
    let cases = [
        DecodeCase::own("6 tokens", &[1, 63, 64, 65, 1000, 20000]),
        DecodeCase::own("mixed lengths", &[1, 63, 64, 65, 4097, 40000]),
        DecodeCase::own("maximum splits", &[40960, 16384, 1024, 17]),
        DecodeCase::random("64 tokens", 64, 5000, 8, 1002),
        DecodeCase::random("128 tokens", 128, 1500, 16, 1003),
    ];
    check(attention::splits_for(40960, 128) == 128 && attention::splits_for(16384, 128) == 128, "the maximum-splits case reaches 128 splits");
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        for (i, case) in cases.iter().enumerate() {
            let r = decode_setup(&gpu, &d, case, 1000 + 10 * i as u64);
            let ntok = case.lens.len();
            for max_splits in [1usize, 7, 64, 128] {
                let got = decode_launch(&gpu, &k, &d, &r, 0, ntok, max_splits);
                assert_close(&format!("decode attention {label} {} max_splits {max_splits}", case.label), &got, &r.want, 2e-5);
            }
        }
    }
    finish();
}

#[test]
fn decode_attention_is_the_same_alone_and_in_a_batch() {
    let Some(gpu) = gpu("decode_attention_is_the_same_alone_and_in_a_batch") else { return };
    // A token's splits follow its own length only, so its result is the same
    // bits whatever else is in the batch (the graph of a batch and of a
    // single sequence agree exactly).
    let case = DecodeCase::own("batch", &[1, 65, 3000, 20000, 777]);
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let r = decode_setup(&gpu, &d, &case, 1500);
        let n = case.lens.len();
        let row = d.attn_out_dim();
        let batch = decode_launch(&gpu, &k, &d, &r, 0, n, 128);
        for t in 0..n {
            let alone = decode_launch(&gpu, &k, &d, &r, t, 1, 128);
            let same = alone.iter().zip(&batch[t * row..(t + 1) * row]).all(|(a, b)| a.to_bits() == b.to_bits());
            check(same, format!("decode {label}: token {t} (length {}) alone differs from the batch", case.lens[t]));
        }
        // Sanity of the comparison itself: the batch matches the reference.
        assert_close(&format!("decode {label} batch"), &batch, &r.want, 2e-5);
    }
    finish();
}

#[test]
fn decode_attention_refuses_a_batch_beyond_shared_memory() {
    let Some(gpu) = gpu("decode_attention_refuses_a_batch_beyond_shared_memory") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    // The kernel keeps three ints per batch token in shared memory beside its
    // pipeline; a batch that cannot fit is an error, not a launch.
    let ntok = gpu.max_smem_optin as usize / 12 + 1;
    check(attention::decode_smem(&d, ntok) > gpu.max_smem_optin as usize, "the probe batch is too large");
    let sc = DecodeScratch { part_o: 0, part_ml: 0, max_splits: 1 };
    let kv = KvView { k: 0, v: 0, block_table: 0, bt_stride: 1 };
    let err = attention::decode(&gpu, &k, &d, 0, &kv, 0, 0, &sc, 0, d.proj_stride(), MixOut::F32(0), ntok).map(|_| ()).unwrap_err().to_string();
    check(err.contains("shared memory") && err.contains(&ntok.to_string()), format!("error names the batch and shared memory: {err}"));
    finish();
}

#[test]
fn attention_prep_norms_rotates_and_stores() {
    let Some(gpu) = gpu("attention_prep_norms_rotates_and_stores") else { return };
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let c = Cache::random(&gpu, &d, &[300, 300], 1100);
        let mut rng = Rng::new(1101);
        let ps = d.proj_stride();
        let positions = [0usize, 1, 77, 299];
        let n = positions.len();
        let proj = rng.vec(n * ps, -2.0, 2.0);
        let qn = rng.vec(d.a_head_dim, 0.5, 1.5);
        let kn = rng.vec(d.a_head_dim, 0.5, 1.5);
        let inv = d.inv_freq();
        let (pb, qnb, knb, ib) = (upload(&gpu, &proj), upload(&gpu, &qn), upload(&gpu, &kn), upload(&gpu, &inv));
        let posb = upload(&gpu, &positions.iter().map(|p| *p as i32).collect::<Vec<_>>());
        let slotb = upload(&gpu, &vec![1i32; n]);
        let qout = upload(&gpu, &vec![NAN; n * d.attn_out_dim()]);
        let q = QMat::default();
        let w = AttentionDev { q, k: q, v: q, o: q, q_norm: qnb.ptr(), k_norm: knb.ptr() };
        attention::prep(&gpu, &k, &d, &w, ib.ptr(), pb.ptr(), ps, posb.ptr(), slotb.ptr(), &c.view(), QOut::F32(qout.ptr()), n).expect("launch");
        let got_q: Vec<f32> = download(&gpu, qout.ptr(), n * d.attn_out_dim());
        let kc: Vec<f32> = download::<u16>(&gpu, c.kb.ptr(), c.k.len()).into_iter().map(f16_val).collect();
        let vc: Vec<f32> = download::<u16>(&gpu, c.vb.ptr(), c.v.len()).into_iter().map(f16_val).collect();
        let rope = |x: Vec<f32>, pos: usize| -> Vec<f64> {
            let half = d.rot_dim / 2;
            let mut out: Vec<f64> = x.iter().map(|v| *v as f64).collect();
            for j in 0..half {
                let ang = (pos as f32 * inv[j]) as f64;
                let (s, co) = ang.sin_cos();
                let (a, b) = (x[j] as f64, x[j + half] as f64);
                out[j] = a * co - b * s;
                out[j + half] = b * co + a * s;
            }
            out
        };
        let (mut wq, mut gq, mut wk, mut gk, mut wv, mut gv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (t, &p) in positions.iter().enumerate() {
            let row = &proj[t * ps..(t + 1) * ps];
            for h in 0..d.a_heads {
                wq.extend(rope(rmsnorm(&row[h * 2 * d.a_head_dim..][..d.a_head_dim], &qn, d.rms_eps), p));
                gq.extend_from_slice(&got_q[(t * d.a_heads + h) * d.a_head_dim..][..d.a_head_dim]);
            }
            let qd = 2 * d.a_heads * d.a_head_dim;
            for g in 0..d.a_kv_heads {
                wk.extend(rope(rmsnorm(&row[qd + g * d.a_head_dim..][..d.a_head_dim], &kn, d.rms_eps), p));
                gk.extend_from_slice(c.at(&d, &kc, 1, p, g));
                wv.extend(row[qd + d.kv_dim() + g * d.a_head_dim..][..d.a_head_dim].iter().map(|v| *v as f64));
                gv.extend_from_slice(c.at(&d, &vc, 1, p, g));
            }
        }
        assert_close(&format!("prep q {label}"), &gq, &wq, 1e-5);
        assert_close(&format!("prep k in cache {label} (fp16)"), &gk, &wk, 1e-3);
        assert_close(&format!("prep v in cache {label} (fp16)"), &gv, &wv, 1e-3);
    }
    finish();
}

/// Random inputs of a prefill attention over `rows` query rows: fp16-exact
/// queries (host copy and device fp16), in-projection rows (for the gates)
/// and a NaN-filled f32 output.
struct PrefillInputs {
    q: Vec<f32>,
    qb: DeviceBuffer,
    proj: Vec<f32>,
    pb: DeviceBuffer,
    mix: DeviceBuffer,
}

impl PrefillInputs {
    fn random(gpu: &Arc<Gpu>, d: &Dims, rows: usize, seed: u64) -> PrefillInputs {
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = rng.vec(rows * d.attn_out_dim(), -1.0, 1.0).into_iter().map(f16_round).collect();
        let qb = upload(gpu, &q.iter().map(|x| f16_bits(*x)).collect::<Vec<_>>());
        let proj = rng.vec(rows * d.proj_stride(), -2.0, 2.0);
        let pb = upload(gpu, &proj);
        let mix = upload(gpu, &vec![NAN; rows * d.attn_out_dim()]);
        PrefillInputs { q, qb, proj, pb, mix }
    }
}

/// Many sequences' pieces of one prefill pass in one `prefill_pieces` call
/// (the server's batched prefill): 19 pieces (more than one launch's
/// `ATTN_PF_MAX_PIECES`), each its own sequence with its own cached prefix,
/// laid out back to back in the pass's rows in a scrambled order; every
/// row against the f64 causal reference of its own sequence.
#[test]
fn prefill_of_many_pieces_in_one_pass_matches_each_sequence() {
    let Some(gpu) = gpu("prefill_of_many_pieces_in_one_pass_matches_each_sequence") else { return };
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        // (p0, t) per sequence: short prompts, continuations across block
        // boundaries, one longer piece.
        let shapes: Vec<(usize, usize)> = (0..19).map(|i| ((i * 37) % 150, 1 + (i * 29) % 70)).chain([(0, 140)]).collect();
        let lens: Vec<usize> = shapes.iter().map(|(p0, t)| p0 + t).collect();
        let c = Cache::random(&gpu, &d, &lens, 4242);
        // Rows of the pass: the sequences in a scrambled order.
        let order: Vec<usize> = (0..shapes.len()).map(|i| (i * 7) % shapes.len()).collect();
        let mut runs = Vec::new();
        let mut row0 = 0;
        for &sq in &order {
            let (p0, t) = shapes[sq];
            runs.push((sq, attention::PrefillPiece { block_table: c.row_ptr(sq), row0, t, p0 }));
            row0 += t;
        }
        let rows = row0;
        let ps = d.proj_stride();
        let PrefillInputs { q, qb, proj, pb, mix } = PrefillInputs::random(&gpu, &d, rows, 4343);
        let pieces: Vec<attention::PrefillPiece> = runs.iter().map(|r| r.1).collect();
        attention::prefill_pieces(&gpu, &k, &d, qb.ptr(), c.kb.ptr(), c.vb.ptr(), pb.ptr(), ps, &pieces, MixOut::F32(mix.ptr())).expect("launch");
        let got: Vec<f32> = download(&gpu, mix.ptr(), rows * d.attn_out_dim());
        let want: Vec<f64> = runs
            .iter()
            .flat_map(|(sq, pc)| (0..pc.t).map(move |i| (*sq, pc.row0 + i, pc.p0 + i)))
            .collect::<Vec<_>>()
            .into_par_iter()
            .flat_map_iter(|(sq, row, pos)| {
                let q = &q;
                let proj = &proj;
                let c = &c;
                let d = &d;
                (0..d.a_heads).flat_map(move |h| {
                    let qh = &q[(row * d.a_heads + h) * d.a_head_dim..][..d.a_head_dim];
                    let gate = &proj[row * ps + h * 2 * d.a_head_dim + d.a_head_dim..][..d.a_head_dim];
                    attend(d, c, sq, qh, h, pos, gate)
                })
            })
            .collect();
        assert_close(&format!("prefill attention {label}: 20 pieces in one pass"), &got, &want, 2e-3);
        let err = attention::prefill_pieces(
            &gpu,
            &k,
            &d,
            qb.ptr(),
            c.kb.ptr(),
            c.vb.ptr(),
            pb.ptr(),
            ps,
            &[attention::PrefillPiece { block_table: c.row_ptr(0), row0: 0, t: 0, p0: 0 }],
            MixOut::F32(mix.ptr()),
        );
        check(err.is_err(), format!("{label}: an empty piece is refused"));
    }
    finish();
}

#[test]
fn prefill_flash_attention_matches_causal_reference() {
    let Some(gpu) = gpu("prefill_flash_attention_matches_causal_reference") else { return };
    // (p0, t): chunks from position 0 and chunks continuing a cached prefix
    // (p0 > 0, on and off block boundaries), lengths around the query tile
    // (16) and the key tile (64) and not multiples of either.
    let cases: [(usize, usize); 15] = [
        (0, 1),
        (0, 7),
        (0, 16),
        (0, 17),
        (0, 64),
        (0, 130),
        (0, 333),
        (64, 100),
        (100, 1),
        (100, 77),
        (128, 64),
        (1000, 200),
        (3000, 45),
        (4033, 31),
        (8191, 300),
    ];
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        for &(p0, t) in &cases {
            // The sequence lives in slot 1; slot 0 is a decoy of other blocks.
            let c = Cache::random(&gpu, &d, &[p0 + t + 70, p0 + t], 1200 + p0 as u64 + t as u64);
            let ps = d.proj_stride();
            let PrefillInputs { q, qb, proj, pb, mix } = PrefillInputs::random(&gpu, &d, t, 1300 + t as u64);
            attention::prefill(&gpu, &k, &d, qb.ptr(), c.kb.ptr(), c.vb.ptr(), c.row_ptr(1), pb.ptr(), ps, t, p0, MixOut::F32(mix.ptr())).expect("launch");
            let got: Vec<f32> = download(&gpu, mix.ptr(), t * d.attn_out_dim());
            let want: Vec<f64> = (0..t * d.a_heads)
                .into_par_iter()
                .flat_map_iter(|ih| {
                    let (i, h) = (ih / d.a_heads, ih % d.a_heads);
                    let qh = &q[(i * d.a_heads + h) * d.a_head_dim..][..d.a_head_dim];
                    let gate = &proj[i * ps + h * 2 * d.a_head_dim + d.a_head_dim..][..d.a_head_dim];
                    attend(&d, &c, 1, qh, h, p0 + i, gate)
                })
                .collect();
            assert_close(&format!("prefill attention {label} p0 {p0} t {t}"), &got, &want, 2e-3);
        }
    }
    finish();
}
