//! Every kernel family against a naive f64 reference (tests/common), at the
//! real Qwen3.6-35B-A3B shape and at the tiny fixture's shape, on random
//! inputs (fresh per case; outputs poisoned before each launch). The
//! attention, DeltaNet and decode-matrix (qmm) families have their own files
//! (`gpu_attention.rs`, `gpu_gdn.rs`, `gpu_qmm.rs`).
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1` there); without a GPU each test
//! prints "skipped: no CUDA device" and returns.
//!
//! Tolerances (relative L2 error): fp32 paths 1e-5..1e-4, i.e. fp32
//! rounding over sums of a few
//! thousand terms; the tensor-core paths are compared with a reference on the
//! same fp16-rounded operands (1e-5) and against the unrounded math (3e-3,
//! fp16 has 11 significant bits).

mod common;

use std::sync::Arc;

use common::*;
use lily_cuda::device::{DeviceBuffer, Gpu};
use lily_cuda::dims::Dims;
use lily_cuda::gemm::{self, GemmOut, GemmPlan, Grouping, Seg, SplitScratch, TILE_ROWS};
use lily_cuda::hgemm::{self, F16Rows, F16Scratch};
use lily_cuda::kernels::Kernels;
use lily_cuda::weights::{MoeDev, QMat};
use lily_cuda::{embed, moe, sampling};
use rayon::prelude::*;

const NAN: f32 = f32::NAN;

// ---- embed ----------------------------------------------------------------------

#[test]
fn embed_gathers_dequantised_rows() {
    let Some(gpu) = gpu("embed_gathers_dequantised_rows") else { return };
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let table = HostQ::random(11, 1, d.vocab, d.hidden, 4, 0.5);
        let (_tb, m) = table.upload(&gpu);
        let mut rng = Rng::new(12);
        let toks: Vec<u32> = vec![0, (d.vocab - 1) as u32, rng.below(d.vocab) as u32, rng.below(d.vocab) as u32, 7];
        let n = toks.len();
        let tk = upload(&gpu, &toks);
        let h = upload(&gpu, &vec![NAN; n * d.hidden]);
        let keys = upload(&gpu, &vec![99u64; n]);
        embed::embed(&gpu, &k, &d, &m, tk.ptr(), h.ptr(), keys.ptr(), n).expect("launch");
        let got: Vec<f32> = download(&gpu, h.ptr(), n * d.hidden);
        let want: Vec<f64> = toks.iter().flat_map(|t| table.row(0, *t as usize)).map(|v| v as f64).collect();
        assert_close(&format!("embed {label}"), &got, &want, 1e-7);
        let kk: Vec<u64> = download(&gpu, keys.ptr(), n);
        check(kk.iter().all(|v| *v == 0), "argmax keys cleared");
    }
    finish();
}

// ---- GEMM -----------------------------------------------------------------------

fn f16_matrix(rng: &mut Rng, rows: usize, cols: usize, amp: f32) -> (Vec<f32>, Vec<u16>) {
    let v: Vec<f32> = rng.vec(rows * cols, -amp, amp).into_iter().map(f16_round).collect();
    let bits = v.iter().map(|x| f16_bits(*x)).collect();
    (v, bits)
}

#[test]
fn gemm_matches_reference_in_every_mode() {
    let Some(gpu) = gpu("gemm_matches_reference_in_every_mode") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(600);
    for &(m, n, kk, bits) in
        &[(1usize, 8192usize, 2048usize, 4u32), (5, 512, 2048, 4), (130, 2048, 4096, 4), (300, 256, 2048, 8), (77, 1, 2048, 8), (64, 1024, 64, 4)]
    {
        let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
        let w = HostQ::random(rng.seed(), 1, n, kk, bits, 0.1);
        let (_wb, wm) = w.upload(&gpu);
        let abuf = upload(&gpu, &ab);
        for add in [false, true] {
            let prev = if add { rng.vec(m * n, -1.0, 1.0) } else { vec![NAN; m * n] };
            let out = upload(&gpu, &prev);
            let mode = if add { GemmOut::Add(out.ptr()) } else { GemmOut::Store(out.ptr()) };
            gemm::gemm(&gpu, &k, abuf.ptr(), kk, m, &wm, None, mode, n, None).expect("launch");
            let got: Vec<f32> = download(&gpu, out.ptr(), m * n);
            let mut want_f16 = Vec::with_capacity(m * n);
            let mut want_exact = Vec::with_capacity(m * n);
            for r in 0..m {
                let ar = &a[r * kk..(r + 1) * kk];
                let y16 = w.matvec_f16w(0, ar);
                let y = w.matvec(0, ar);
                for c in 0..n {
                    let base = if add { prev[r * n + c] as f64 } else { 0.0 };
                    want_f16.push(y16[c] + base);
                    want_exact.push(y[c] + base);
                }
            }
            let what = format!("gemm {m}x{n}x{kk} {bits}-bit add {add}");
            assert_close(&format!("{what} (fp16 operands)"), &got, &want_f16, 1e-5);
            assert_close(&format!("{what} (exact weights)"), &got, &want_exact, 3e-3);
        }
    }
    // SwiGLU: out = silu(gate a) * (up a), fp16.
    for &(m, inter, kk) in &[(3usize, 512usize, 2048usize), (200, 512, 2048), (9, 64, 64)] {
        let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
        let g = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
        let u = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
        let ((_g1, gm), (_u1, um)) = (g.upload(&gpu), u.upload(&gpu));
        let abuf = upload(&gpu, &ab);
        let out = upload(&gpu, &vec![0xffffu16; m * inter]);
        gemm::gemm(&gpu, &k, abuf.ptr(), kk, m, &gm, Some(&um), GemmOut::SwiGlu(out.ptr()), inter, None).expect("launch");
        let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), m * inter).into_iter().map(f16_val).collect();
        let mut want = Vec::new();
        for r in 0..m {
            let ar = &a[r * kk..(r + 1) * kk];
            let (gy, uy) = (g.matvec_f16w(0, ar), u.matvec_f16w(0, ar));
            want.extend(gy.iter().zip(&uy).map(|(x, y)| silu(*x) * y));
        }
        assert_close(&format!("gemm swiglu {m}x{inter}x{kk}"), &got, &want, 1e-3);
    }
    finish();
}

/// fp16-operand and exact references of A W^T for rows `a` (row-major, K wide).
fn gemm_refs(w: &HostQ, e: usize, a: &[f32], kk: usize) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let rows = a.len() / kk;
    (0..rows).map(|r| (w.matvec_f16w(e, &a[r * kk..(r + 1) * kk]), w.matvec(e, &a[r * kk..(r + 1) * kk]))).unzip()
}

#[test]
fn gemm_every_tile_height_matches_reference() {
    let Some(gpu) = gpu("gemm_every_tile_height_matches_reference") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(660);
    // N = 200: a partial W tile; K = 256: four k-tiles.
    let (n, kk) = (200usize, 256usize);
    for &bm in &TILE_ROWS {
        for bits in [4u32, 8].into_iter().filter(|b| gemm::compiled(*b, bm)) {
            let w = HostQ::random(rng.seed(), 1, n, kk, bits, 0.1);
            let (_wb, wm) = w.upload(&gpu);
            // One row, a full tile, a tile and a few rows (M not a multiple of the tile), two tiles and a few.
            for m in [1usize, bm, bm + 5, 2 * bm + 3] {
                let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
                let abuf = upload(&gpu, &ab);
                let (r16, rex) = gemm_refs(&w, 0, &a, kk);
                for add in [false, true] {
                    let prev = if add { rng.vec(m * n, -1.0, 1.0) } else { vec![NAN; m * n] };
                    let out = upload(&gpu, &prev);
                    let o = if add { GemmOut::Add(out.ptr()) } else { GemmOut::Store(out.ptr()) };
                    let seg = Seg { w: &wm, up: None, out: o, ldc: n };
                    gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm, splits: 1 }, None).expect("launch");
                    let got: Vec<f32> = download(&gpu, out.ptr(), m * n);
                    let base = |i: usize| if add { prev[i] as f64 } else { 0.0 };
                    let want16: Vec<f64> = (0..m * n).map(|i| r16[i / n][i % n] + base(i)).collect();
                    let want: Vec<f64> = (0..m * n).map(|i| rex[i / n][i % n] + base(i)).collect();
                    let what = format!("gemm bm {bm} {m}x{n}x{kk} {bits}-bit add {add}");
                    assert_close(&format!("{what} (fp16 operands)"), &got, &want16, 1e-5);
                    assert_close(&format!("{what} (exact weights)"), &got, &want, 3e-3);
                }
            }
        }
        // SwiGLU, 200 intermediate rows: a partial 64-row tile.
        let inter = 200usize;
        let g = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
        let u = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
        let ((_g1, gm), (_u1, um)) = (g.upload(&gpu), u.upload(&gpu));
        for m in [1usize, bm + 5] {
            let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
            let abuf = upload(&gpu, &ab);
            let out = upload(&gpu, &vec![0xffffu16; m * inter]);
            let seg = Seg { w: &gm, up: Some(&um), out: GemmOut::SwiGlu(out.ptr()), ldc: inter };
            gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm, splits: 1 }, None).expect("launch");
            let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), m * inter).into_iter().map(f16_val).collect();
            let (gy, _) = gemm_refs(&g, 0, &a, kk);
            let (uy, _) = gemm_refs(&u, 0, &a, kk);
            let want: Vec<f64> = (0..m).flat_map(|r| (0..inter).map(|i| silu(gy[r][i]) * uy[r][i]).collect::<Vec<_>>()).collect();
            assert_close(&format!("gemm swiglu bm {bm} {m}x{inter}x{kk}"), &got, &want, 1e-3);
        }
    }
    finish();
}

#[test]
fn gemm_split_k_and_segments_match_reference_and_repeat_bit_for_bit() {
    let Some(gpu) = gpu("gemm_split_k_and_segments_match_reference_and_repeat_bit_for_bit") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(670);
    let scratch_buf = zeros(&gpu, gemm::SPLITK_FLOATS * 4);
    let scratch = SplitScratch { ptr: scratch_buf.ptr(), floats: gemm::SPLITK_FLOATS };
    // K = 1024: 16 k-tiles, so 3 and 5 splits are uneven (6+6+4, 4+4+4+4) and 16 is one k-tile each.
    let kk = 1024usize;
    // Segments as the model uses them: big + 32-row + 1-row (+ a full tile), 4-bit; a
    // 256-row + 1-row pair, 8-bit (router + shared-expert gate). Output strides wider than the rows.
    // 300 + 32 + 128 columns: whole 16-byte partial rows, so the reduction
    // reads a split's 4 columns at once (the others: a column at a time,
    // and 4 columns that straddle two segments).
    for (bits, rows) in [(4u32, vec![300usize, 32, 1, 128]), (4, vec![300, 32, 128]), (8, vec![256, 1])] {
        let ws: Vec<HostQ> = rows.iter().map(|r| HostQ::random(rng.seed(), 1, *r, kk, bits, 0.1)).collect();
        let up: Vec<_> = ws.iter().map(|w| w.upload(&gpu)).collect();
        for m in [7usize, 130] {
            let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
            let abuf = upload(&gpu, &ab);
            let refs: Vec<_> = ws.iter().map(|w| gemm_refs(w, 0, &a, kk).0).collect();
            let bm = gemm::plan_dense(bits, m, 1, kk, 0).bm;
            for add in [false, true] {
                let mut first: Option<Vec<Vec<f32>>> = None;
                for splits in [1usize, 2, 3, 5, 16, 16] {
                    let prevs: Vec<Vec<f32>> =
                        rows.iter().map(|r| if add { Rng::new(671 + *r as u64).vec(m * (r + 3), -1.0, 1.0) } else { vec![NAN; m * (r + 3)] }).collect();
                    let outs: Vec<_> = prevs.iter().map(|p| upload(&gpu, p)).collect();
                    let segs: Vec<Seg> = up
                        .iter()
                        .zip(&outs)
                        .zip(&rows)
                        .map(|(((_, wm), o), r)| Seg { w: wm, up: None, out: if add { GemmOut::Add(o.ptr()) } else { GemmOut::Store(o.ptr()) }, ldc: r + 3 })
                        .collect();
                    gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &segs, None, GemmPlan { bm, splits }, Some(scratch)).expect("launch");
                    let mut gots = Vec::new();
                    for (si, r) in rows.iter().enumerate() {
                        let ldc = r + 3;
                        let got: Vec<f32> = download(&gpu, outs[si].ptr(), m * ldc);
                        let mut body = Vec::with_capacity(m * r);
                        let mut want = Vec::with_capacity(m * r);
                        for (row, want_row) in refs[si].iter().enumerate() {
                            for (c, g) in got[row * ldc..(row + 1) * ldc].iter().enumerate() {
                                let prev = prevs[si][row * ldc + c];
                                match want_row.get(c) {
                                    Some(w) => {
                                        body.push(*g);
                                        want.push(w + if add { prev as f64 } else { 0.0 });
                                    }
                                    None => check(
                                        g.to_bits() == prev.to_bits(),
                                        format!("{bits}-bit seg {si} m {m} splits {splits}: column {c} past the rows written"),
                                    ),
                                }
                            }
                        }
                        assert_close(&format!("gemm {bits}-bit seg {si} ({r} rows) m {m} splits {splits} add {add}"), &body, &want, 1e-5);
                        gots.push(got);
                    }
                    // The splits the launch ran: none empty (5 of 16 k-tiles run as 4 of 4).
                    let ran = gemm::split_count(kk / gemm::GEMM_BK, splits);
                    if ran > 1 {
                        check_split_sums(&gpu, scratch_buf.ptr(), ran, m, &rows, &prevs, &gots, add);
                    }
                    if splits == 16 {
                        // The same split twice: the same bits.
                        match &first {
                            None => first = Some(gots),
                            Some(f) => check(
                                f.iter().zip(&gots).all(|(x, y)| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())),
                                format!("{bits}-bit m {m} add {add}: split-K repeats bit for bit"),
                            ),
                        }
                    }
                }
            }
        }
    }
    // SwiGLU over split K (the shared expert's gate/up), and the planner's own choice.
    let (inter, kk) = (512usize, 2048usize);
    let g = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
    let u = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
    let ((_g1, gm), (_u1, um)) = (g.upload(&gpu), u.upload(&gpu));
    for (m, splits) in [(37usize, Some(4usize)), (37, Some(16)), (256, None)] {
        let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
        let abuf = upload(&gpu, &ab);
        let out = upload(&gpu, &vec![0xffffu16; m * inter]);
        let seg = Seg { w: &gm, up: Some(&um), out: GemmOut::SwiGlu(out.ptr()), ldc: inter };
        match splits {
            Some(s) => {
                gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm: gemm::plan_dense(4, m, 1, kk, 0).bm, splits: s }, Some(scratch))
            }
            None => {
                let plan = gemm::plan_dense(4, m, inter / 64, kk, 2 * inter);
                check(plan.splits > 1, format!("the planner splits the shared expert at {m} rows: {plan:?}"));
                gemm::gemm_segs(&gpu, &k, abuf.ptr(), kk, m, &[seg], scratch)
            }
        }
        .expect("launch");
        let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), m * inter).into_iter().map(f16_val).collect();
        let (gy, _) = gemm_refs(&g, 0, &a, kk);
        let (uy, _) = gemm_refs(&u, 0, &a, kk);
        let want: Vec<f64> = (0..m).flat_map(|r| (0..inter).map(|i| silu(gy[r][i]) * uy[r][i]).collect::<Vec<_>>()).collect();
        assert_close(&format!("gemm swiglu {m}x{inter}x{kk} splits {splits:?}"), &got, &want, 1e-3);
        if let Some(s) = splits {
            // Rows 2 halves wider: every other row starts off an 8-byte
            // boundary, where the reduction stores its 4 outputs one by one.
            let ldc = inter + 2;
            let out2 = upload(&gpu, &vec![0xffffu16; m * ldc]);
            let seg = Seg { w: &gm, up: Some(&um), out: GemmOut::SwiGlu(out2.ptr()), ldc };
            gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm: gemm::plan_dense(4, m, 1, kk, 0).bm, splits: s }, Some(scratch))
                .expect("launch");
            let got2: Vec<u16> = download(&gpu, out2.ptr(), m * ldc);
            let got1: Vec<u16> = download(&gpu, out.ptr(), m * inter);
            let same = (0..m).all(|r| got1[r * inter..(r + 1) * inter] == got2[r * ldc..r * ldc + inter]);
            check(same, format!("gemm swiglu {m} rows, {s} splits: the same bits at ldc {inter} and {ldc}"));
        }
    }
    finish();
}

/// The split-K reduction's outputs against the partials it read, bit for
/// bit: each output (of segment `si`, row `m`, column `c`) is
/// ((0 + p_0) + p_1) + ... in split order, added to the previous output in
/// the residual-add mode. `scratch` holds `splits` planes of [m][ncols];
/// segment `si`'s outputs are rows of `rows[si] + 3` (the test's strides).
#[allow(clippy::too_many_arguments)]
fn check_split_sums(gpu: &Arc<Gpu>, scratch: u64, splits: usize, m: usize, rows: &[usize], prevs: &[Vec<f32>], gots: &[Vec<f32>], add: bool) {
    let ncols: usize = rows.iter().sum();
    let part: Vec<f32> = download(gpu, scratch, splits * m * ncols);
    let mut col0 = 0;
    let mut bad = 0usize;
    for (si, r) in rows.iter().enumerate() {
        let ldc = r + 3;
        for row in 0..m {
            for c in 0..*r {
                let mut v = 0f32;
                for z in 0..splits {
                    v += part[(z * m + row) * ncols + col0 + c];
                }
                let want = if add { prevs[si][row * ldc + c] + v } else { v };
                if gots[si][row * ldc + c].to_bits() != want.to_bits() {
                    bad += 1;
                }
            }
        }
        col0 += r;
    }
    check(bad == 0, format!("{splits} splits of {m} rows x {ncols} columns, add {add}: {bad} outputs differ from their partials summed in split order"));
}

/// `w` on the device with its scales and biases 2 bytes past a 16-byte
/// boundary: the GEMM then fills its scale slots with plain loads (its
/// fallback) instead of 16-byte copies of 8 k-tiles a row.
fn upload_shifted_scales(gpu: &Arc<Gpu>, w: &HostQ) -> (DeviceBuffer, QMat) {
    let align = |n: usize| n.div_ceil(256) * 256;
    let (cb, sb) = (w.codes.len() * 4, w.scales.len() * 2);
    let (s_off, b_off) = (align(cb) + 2, align(cb) + align(sb + 2) + 2);
    let buf = DeviceBuffer::zeroed(gpu, b_off + sb, "test matrix").expect("alloc");
    buf.upload_sync_at(0, &w.codes).expect("codes");
    buf.upload_sync_at(s_off, &w.scales).expect("scales");
    buf.upload_sync_at(b_off, &w.biases).expect("biases");
    let p = buf.ptr();
    let m = QMat { codes: p, scales: p + s_off as u64, biases: p + b_off as u64, rows: w.rows, cols: w.cols, experts: w.experts, bits: w.bits };
    (buf, m)
}

/// Keeps the first output of a group of launches and checks every later one
/// against it bit for bit.
fn same_bits(first: &mut Option<Vec<f32>>, got: Vec<f32>, what: &str) {
    match first {
        None => *first = Some(got),
        Some(f) => check(f.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()), format!("{what}: not the bits of the first launch of its group")),
    }
}

/// The weight ring of gemm.cu at every tile height (each with its own ring
/// depth) and both bit widths: K of one k-tile (scales by plain loads; a
/// ring of one k-tile) and of 24 (three chunks of 8 k-tiles of scales, so
/// both chunk buffers are reused; not a multiple of the 5-stage rings),
/// split over K into splits that start inside a chunk (5+5+5+5+4) and into
/// single k-tiles (shorter than any ring), with scales 16-byte aligned
/// (chunk copies) or not (plain loads), and SwiGLU with gate and up rows on
/// different scale paths in one tile. Every launch matches the reference,
/// and for one split count every height and scale path gives the same bits:
/// a row's sums do not depend on the tile it sits in or on how its scales
/// arrived.
#[test]
fn gemm_weight_ring_matches_reference_and_itself_at_every_height_split_and_scale_path() {
    let Some(gpu) = gpu("gemm_weight_ring_matches_reference_and_itself_at_every_height_split_and_scale_path") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(700);
    let scratch_buf = zeros(&gpu, gemm::SPLITK_FLOATS * 4);
    let scratch = SplitScratch { ptr: scratch_buf.ptr(), floats: gemm::SPLITK_FLOATS };
    // N = 200: a partial W tile; M = 133: a partial last tile at every height.
    let (n, m) = (200usize, 133usize);
    for bits in [4u32, 8] {
        for kk in [64usize, 1536] {
            let w = HostQ::random(rng.seed(), 1, n, kk, bits, 0.1);
            let (_wa, aligned) = w.upload(&gpu);
            let (_ws, shifted) = upload_shifted_scales(&gpu, &w);
            let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
            let abuf = upload(&gpu, &ab);
            let want: Vec<f64> = gemm_refs(&w, 0, &a, kk).0.concat();
            let nk = kk / 64;
            let mut split_counts = vec![1usize, 5, nk];
            split_counts.retain(|s| *s <= nk);
            split_counts.dedup();
            for splits in split_counts {
                let mut first = None;
                for bm in gemm::heights(bits) {
                    for (path, wm) in [("aligned scales", &aligned), ("shifted scales", &shifted)] {
                        let out = upload(&gpu, &vec![NAN; m * n]);
                        let seg = Seg { w: wm, up: None, out: GemmOut::Store(out.ptr()), ldc: n };
                        gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm, splits }, Some(scratch)).expect("launch");
                        let got: Vec<f32> = download(&gpu, out.ptr(), m * n);
                        let what = format!("gemm ring {bits}-bit K {kk} splits {splits} bm {bm} {path}");
                        assert_close(&what, &got, &want, 1e-5);
                        same_bits(&mut first, got, &what);
                    }
                }
            }
        }
    }
    // SwiGLU: 200 intermediate rows (a partial 64-row tile), 24 k-tiles.
    let (inter, kk, m) = (200usize, 1536usize, 37usize);
    let g = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
    let u = HostQ::random(rng.seed(), 1, inter, kk, 4, 0.1);
    let ((_g1, ga), (_u1, ua)) = (g.upload(&gpu), u.upload(&gpu));
    let ((_g2, gs), (_u2, us)) = (upload_shifted_scales(&gpu, &g), upload_shifted_scales(&gpu, &u));
    let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
    let abuf = upload(&gpu, &ab);
    let (gy, _) = gemm_refs(&g, 0, &a, kk);
    let (uy, _) = gemm_refs(&u, 0, &a, kk);
    let want: Vec<f64> = (0..m).flat_map(|r| (0..inter).map(|i| silu(gy[r][i]) * uy[r][i]).collect::<Vec<_>>()).collect();
    for splits in [1usize, 5] {
        let mut first = None;
        for &bm in &TILE_ROWS {
            for (path, gm, um) in [("aligned", &ga, &ua), ("shifted", &gs, &us), ("gate aligned, up shifted", &ga, &us)] {
                let out = upload(&gpu, &vec![0xffffu16; m * inter]);
                let seg = Seg { w: gm, up: Some(um), out: GemmOut::SwiGlu(out.ptr()), ldc: inter };
                gemm::gemm_with(&gpu, &k, abuf.ptr(), kk, m, &[seg], None, GemmPlan { bm, splits }, Some(scratch)).expect("launch");
                let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), m * inter).into_iter().map(f16_val).collect();
                let what = format!("gemm ring swiglu splits {splits} bm {bm} scales {path}");
                assert_close(&what, &got, &want, 1e-3);
                same_bits(&mut first, got, &what);
            }
        }
    }
    finish();
}

#[test]
fn grouped_gemm_ragged_groups_match_reference() {
    let Some(gpu) = gpu("grouped_gemm_ragged_groups_match_reference") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(690);
    // Tokens per expert: empty, one, around a 16-row tile, several tiles.
    let counts = [0usize, 1, 15, 17, 100, 33];
    let experts = counts.len();
    let rows: usize = counts.iter().sum();
    let ntok = 50usize;
    // Gate/up K = 512: scales in 16-byte chunks (per expert); down K = 128:
    // scales by plain loads.
    let (inter, kk) = (128usize, 512usize);
    let (n_down, k_down) = (200usize, inter);
    let gate = HostQ::random(rng.seed(), experts, inter, kk, 4, 0.1);
    let upq = HostQ::random(rng.seed(), experts, inter, kk, 4, 0.1);
    let down = HostQ::random(rng.seed(), experts, n_down, k_down, 4, 0.1);
    let ((_g, gm), (_u, um), (_dn, dm)) = (gate.upload(&gpu), upq.upload(&gpu), down.upload(&gpu));
    let (x, xb) = f16_matrix(&mut rng, ntok, kk, 2.0);
    let xbuf = upload(&gpu, &xb);
    // Sorted row -> token, and sorted row -> expert.
    let a_rows: Vec<i32> = (0..rows).map(|_| rng.below(ntok) as i32).collect();
    let expert_of: Vec<usize> = counts.iter().enumerate().flat_map(|(e, c)| std::iter::repeat_n(e, *c)).collect();
    let arb = upload(&gpu, &a_rows);
    // The down GEMM's input: sorted rows of fp16.
    let (act, actb) = f16_matrix(&mut rng, rows, k_down, 1.0);
    let actbuf = upload(&gpu, &actb);
    for &bm in &TILE_ROWS {
        let mut tiles: Vec<i32> = Vec::new();
        let mut off = 0usize;
        for (e, c) in counts.iter().enumerate() {
            let mut j = 0;
            while j < *c {
                tiles.extend([e as i32, (off + j) as i32, (off + (j + bm).min(*c)) as i32]);
                j += bm;
            }
            off += c;
        }
        let nt = tiles.len() / 3;
        // Two spare grid rows: blocks past the device count exit.
        let max_tiles = nt + 2;
        tiles.extend([0; 6]);
        let (tb, ntb) = (upload(&gpu, &tiles), upload(&gpu, &[nt as i32]));
        let gather = Grouping { tiles: tb.ptr(), ntiles: ntb.ptr(), max_tiles, a_rows: arb.ptr(), bm };
        let sorted = Grouping { a_rows: 0, ..gather };
        let plan = GemmPlan { bm, splits: 1 };

        let out = upload(&gpu, &vec![0xffffu16; rows * inter]);
        let seg = Seg { w: &gm, up: Some(&um), out: GemmOut::SwiGlu(out.ptr()), ldc: inter };
        gemm::gemm_with(&gpu, &k, xbuf.ptr(), kk, rows, &[seg], Some(&gather), plan, None).expect("gate_up");
        let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), rows * inter).into_iter().map(f16_val).collect();
        let want: Vec<f64> = (0..rows)
            .into_par_iter()
            .flat_map_iter(|r| {
                let t = a_rows[r] as usize;
                let xt = &x[t * kk..(t + 1) * kk];
                let (gy, uy) = (gate.matvec_f16w(expert_of[r], xt), upq.matvec_f16w(expert_of[r], xt));
                gy.into_iter().zip(uy).map(|(a, b)| silu(a) * b).collect::<Vec<_>>()
            })
            .collect();
        assert_close(&format!("grouped swiglu bm {bm} groups {counts:?}"), &got, &want, 1e-3);

        let y = upload(&gpu, &vec![NAN; rows * n_down]);
        let seg = Seg { w: &dm, up: None, out: GemmOut::Store(y.ptr()), ldc: n_down };
        gemm::gemm_with(&gpu, &k, actbuf.ptr(), k_down, rows, &[seg], Some(&sorted), plan, None).expect("down");
        let got: Vec<f32> = download(&gpu, y.ptr(), rows * n_down);
        let want: Vec<f64> = (0..rows).into_par_iter().flat_map_iter(|r| down.matvec_f16w(expert_of[r], &act[r * k_down..(r + 1) * k_down])).collect();
        assert_close(&format!("grouped down bm {bm} groups {counts:?}"), &got, &want, 1e-5);
    }
    finish();
}

#[test]
fn gemm_refuses_what_it_cannot_run() {
    let Some(gpu) = gpu("gemm_refuses_what_it_cannot_run") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let w = HostQ::random(1, 1, 64, 128, 4, 0.1);
    let w8 = HostQ::random(2, 1, 64, 128, 8, 0.1);
    let ((_a, wm), (_b, w8m)) = (w.upload(&gpu), w8.upload(&gpu));
    let a = zeros(&gpu, 40 * 128 * 2);
    let out = zeros(&gpu, 40 * 64 * 4);
    let seg = Seg { w: &wm, up: None, out: GemmOut::Store(out.ptr()), ldc: 64 };
    let err = |r: lily_cuda::error::CudaResult<()>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg], None, GemmPlan { bm: 48, splits: 1 }, None));
    check(e.contains("tile height 48"), format!("an uncompiled tile height: {e}"));
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg], None, GemmPlan { bm: 64, splits: 2 }, None));
    check(e.contains("partial scratch"), format!("split-K without scratch: {e}"));
    let tiny = SplitScratch { ptr: out.ptr(), floats: 100 };
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg], None, GemmPlan { bm: 64, splits: 2 }, Some(tiny)));
    check(e.contains("the scratch holds 100"), format!("split-K past the scratch: {e}"));
    let seg8 = Seg { w: &w8m, up: None, out: GemmOut::Store(out.ptr()), ldc: 64 };
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg, seg8], None, GemmPlan { bm: 64, splits: 1 }, None));
    check(e.contains("differs from matrix 0"), format!("mixed bit widths in one launch: {e}"));
    let narrow = Seg { ldc: 10, ..seg };
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[narrow], None, GemmPlan { bm: 64, splits: 1 }, None));
    check(e.contains("ldc 10"), format!("ldc narrower than the rows: {e}"));
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg; 5], None, GemmPlan { bm: 64, splits: 1 }, None));
    check(e.contains("5 matrices"), format!("too many segments: {e}"));
    let g = Grouping { tiles: out.ptr(), ntiles: out.ptr(), max_tiles: 1, a_rows: 0, bm: 16 };
    let e = err(gemm::gemm_with(&gpu, &k, a.ptr(), 128, 40, &[seg], Some(&g), GemmPlan { bm: 32, splits: 1 }, None));
    check(e.contains("cut at 16 rows"), format!("a tile list cut at another height: {e}"));
    finish();
}

#[test]
fn rmsnorm_f16_matches_reference() {
    let Some(gpu) = gpu("rmsnorm_f16_matches_reference") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(650);
    let (rows, cols) = (37, d.hidden);
    let x = rng.vec(rows * cols, -30.0, 30.0);
    let g = rng.vec(cols, 0.5, 1.5);
    let (xb, gb) = (upload(&gpu, &x), upload(&gpu, &g));
    let out = zeros(&gpu, rows * cols * 2);
    gemm::rmsnorm_f16(&gpu, &k, xb.ptr(), gb.ptr(), out.ptr(), rows, 1e-6).expect("launch");
    let got: Vec<f32> = download::<u16>(&gpu, out.ptr(), rows * cols).into_iter().map(f16_val).collect();
    let want: Vec<f64> = (0..rows).flat_map(|r| rmsnorm(&x[r * cols..(r + 1) * cols], &g, 1e-6)).map(|v| v as f64).collect();
    assert_close("rmsnorm_f16", &got, &want, 1e-3);
    finish();
}

// ---- hgemm (the dense projections of long prefill passes) -------------------------

#[test]
fn hgemm_dequantises_exactly_and_multiplies_like_the_reference() {
    let Some(gpu) = gpu("hgemm_dequantises_exactly_and_multiplies_like_the_reference") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(700);
    // dq_f16: bit for bit the fp16 rounding of fmaf(scale, q, bias).
    for bits in [4u32, 8] {
        let (rows, kk) = (96usize, 2048usize);
        let w = HostQ::random(rng.seed(), 1, rows, kk, bits, 0.1);
        let (_wb, wm) = w.upload(&gpu);
        let out = upload(&gpu, &vec![0xffffu16; rows * kk]);
        hgemm::dequant(&gpu, &k, &wm, F16Rows { ptr: out.ptr(), rows, cols: kk }).expect("dq_f16");
        let got: Vec<u16> = download(&gpu, out.ptr(), rows * kk);
        let want: Vec<u16> = (0..rows).flat_map(|r| w.row(0, r)).map(|v| f16_bits(f16_round(v))).collect();
        let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        check(bad == 0, format!("dq_f16 {bits}-bit: {bad} of {} values differ from fp16(fmaf(s, q, b))", want.len()));
    }
    // Several matrices of both widths in one launch (a mixer's in-projections:
    // a big one, then small ones; a one-row 8-bit matrix), each into its own rows.
    {
        let kk = 2048usize;
        let shapes = [(96usize, 4u32), (32, 8), (1, 8), (40, 4)];
        let ws: Vec<HostQ> = shapes.iter().map(|(r, b)| HostQ::random(rng.seed(), 1, *r, kk, *b, 0.1)).collect();
        let dev: Vec<(DeviceBuffer, QMat)> = ws.iter().map(|w| w.upload(&gpu)).collect();
        let total: usize = shapes.iter().map(|(r, _)| r).sum();
        let out = upload(&gpu, &vec![0xffffu16; total * kk]);
        let mut row0 = 0;
        let mut jobs = Vec::new();
        for (_, q) in &dev {
            jobs.push((q, F16Rows { ptr: out.ptr() + (row0 * kk * 2) as u64, rows: q.rows, cols: kk }));
            row0 += q.rows;
        }
        hgemm::dequant_all(&gpu, &k, &jobs).expect("dq_f16 of four matrices");
        let got: Vec<u16> = download(&gpu, out.ptr(), total * kk);
        let want: Vec<u16> = ws.iter().flat_map(|w| (0..w.rows).flat_map(|r| w.row(0, r))).map(|v| f16_bits(f16_round(v))).collect();
        let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        check(bad == 0, format!("dq_f16 of {shapes:?} in one launch: {bad} of {} values differ from fp16(fmaf(s, q, b))", want.len()));
        let five: Vec<_> = jobs.iter().chain(jobs.first()).copied().collect();
        check(hgemm::dequant_all(&gpu, &k, &five).is_err(), "dq_f16 refuses more matrices than one launch holds");
    }
    // The GEMM over one matrix and over a mixer's four concatenated
    // in-projections (outputs side by side in a wider row, as `proj`):
    // tails of M and N, K of 16 to 64 k-tiles, both modes. Rows checked: the
    // tile edges and a random few (the reference is f64 on the CPU).
    for (m, rows, kk) in [(200usize, vec![1000usize], 2048usize), (4096, vec![8192, 4096, 32, 32], 2048), (130, vec![2048], 4096), (64, vec![256], 1024)] {
        let n: usize = rows.iter().sum();
        let ldc = n + 6;
        let (a, ab) = f16_matrix(&mut rng, m, kk, 2.0);
        let abuf = upload(&gpu, &ab);
        let mats: Vec<HostQ> = rows.iter().map(|r| HostQ::random(rng.seed(), 1, *r, kk, 4, 0.1)).collect();
        let dev: Vec<(DeviceBuffer, QMat)> = mats.iter().map(|w| w.upload(&gpu)).collect();
        let qm: Vec<&QMat> = dev.iter().map(|(_, q)| q).collect();
        let scratch = zeros(&gpu, n * kk * 2);
        let sc = F16Scratch { ptr: scratch.ptr(), elems: n * kk };
        let mut check_rows: Vec<usize> = vec![0, 1, m - 1, 63.min(m - 1), 64.min(m - 1), 127.min(m - 1), 128.min(m - 1)];
        check_rows.extend((0..6).map(|_| rng.below(m)));
        check_rows.sort_unstable();
        check_rows.dedup();
        for add in [false, true] {
            let prev = if add { rng.vec(m * ldc, -1.0, 1.0) } else { vec![NAN; m * ldc] };
            let out = upload(&gpu, &prev);
            let mode = if add { GemmOut::Add(out.ptr()) } else { GemmOut::Store(out.ptr()) };
            hgemm::dequant_and_multiply(&gpu, &k, abuf.ptr(), kk, m, &qm, sc, mode, ldc).expect("launch");
            let got: Vec<f32> = download(&gpu, out.ptr(), m * ldc);
            let what = format!("hgemm {m}x{rows:?}x{kk} add {add}");
            let (mut g16, mut w16, mut wex) = (Vec::new(), Vec::new(), Vec::new());
            for &r in &check_rows {
                let ar = &a[r * kk..(r + 1) * kk];
                let mut c0 = 0;
                for w in &mats {
                    let (y16, y) = (w.matvec_f16w(0, ar), w.matvec(0, ar));
                    for c in 0..w.rows {
                        let base = if add { prev[r * ldc + c0 + c] as f64 } else { 0.0 };
                        g16.push(got[r * ldc + c0 + c]);
                        w16.push(y16[c] + base);
                        wex.push(y[c] + base);
                    }
                    c0 += w.rows;
                }
                // The columns past the matrices are left alone.
                let tail_ok = (n..ldc).all(|c| got[r * ldc + c].to_bits() == prev[r * ldc + c].to_bits());
                check(tail_ok, format!("{what}: row {r} columns past {n} untouched"));
            }
            assert_close(&format!("{what} (fp16 operands)"), &g16, &w16, 1e-5);
            assert_close(&format!("{what} (exact weights)"), &g16, &wex, 3e-3);
            // Deterministic: the same launch gives the same bits.
            let again = upload(&gpu, &prev);
            let mode2 = if add { GemmOut::Add(again.ptr()) } else { GemmOut::Store(again.ptr()) };
            hgemm::dequant_and_multiply(&gpu, &k, abuf.ptr(), kk, m, &qm, sc, mode2, ldc).expect("launch");
            let got2: Vec<f32> = download(&gpu, again.ptr(), m * ldc);
            check(got.iter().zip(&got2).all(|(x, y)| x.to_bits() == y.to_bits()), format!("{what}: repeats bit for bit"));
        }
    }
    // Shapes it cannot run are refused with the kernel's name.
    let w = HostQ::random(1, 1, 64, 96, 4, 0.1);
    let (_wb, wm) = w.upload(&gpu);
    let a = zeros(&gpu, 64 * 96 * 2);
    let out = zeros(&gpu, 64 * 64 * 4);
    let scratch = zeros(&gpu, 64 * 96 * 2);
    let e = hgemm::dequant_and_multiply(&gpu, &k, a.ptr(), 96, 64, &[&wm], F16Scratch { ptr: scratch.ptr(), elems: 64 * 96 }, GemmOut::Store(out.ptr()), 64);
    check(matches!(&e, Err(err) if err.to_string().contains("dq_f16") || err.to_string().contains("hgemm")), format!("K = 96 refused: {e:?}"));
    let e = hgemm::dequant_and_multiply(&gpu, &k, a.ptr(), 96, 64, &[&wm], F16Scratch { ptr: scratch.ptr(), elems: 10 }, GemmOut::Store(out.ptr()), 64);
    check(matches!(&e, Err(err) if err.to_string().contains("scratch")), format!("a scratch too small refused: {e:?}"));
    finish();
}

// ---- MoE ------------------------------------------------------------------------------

struct HostMoe {
    gate: HostQ,
    up: HostQ,
    down: HostQ,
    sh_gate: HostQ,
    sh_up: HostQ,
    sh_down: HostQ,
}

impl HostMoe {
    fn random(d: &Dims, seed: u64) -> Self {
        let (h, i, e) = (d.hidden, d.moe_inter, d.n_experts);
        HostMoe {
            gate: HostQ::random(seed, e, i, h, 4, 0.1),
            up: HostQ::random(seed + 1, e, i, h, 4, 0.1),
            down: HostQ::random(seed + 2, e, h, i, 4, 0.1),
            sh_gate: HostQ::random(seed + 3, 1, i, h, 4, 0.1),
            sh_up: HostQ::random(seed + 4, 1, i, h, 4, 0.1),
            sh_down: HostQ::random(seed + 5, 1, h, i, 4, 0.1),
        }
    }

    /// MoE output for normalised input xn, with the router given.
    fn forward(&self, xn: &[f32], logits: &[f32], sg: f32, topk: usize, f16_ops: bool) -> Vec<f64> {
        let (idx, w) = topk_ref(logits, topk);
        let h = self.down.rows;
        let mut out = vec![0f64; h];
        let round = |v: &[f32]| -> Vec<f32> {
            if f16_ops {
                v.iter().map(|x| f16_round(*x)).collect()
            } else {
                v.to_vec()
            }
        };
        let x = round(xn);
        let mv = |m: &HostQ, e: usize, v: &[f32]| if f16_ops { m.matvec_f16w(e, v) } else { m.matvec(e, v) };
        for (slot, &e) in idx.iter().enumerate() {
            let act: Vec<f32> = mv(&self.gate, e, &x).iter().zip(mv(&self.up, e, &x)).map(|(g, u)| (silu(*g) * u) as f32).collect();
            let y = mv(&self.down, e, &round(&act));
            for r in 0..h {
                out[r] += w[slot] * y[r];
            }
        }
        let act: Vec<f32> = mv(&self.sh_gate, 0, &x).iter().zip(mv(&self.sh_up, 0, &x)).map(|(g, u)| (silu(*g) * u) as f32).collect();
        let y = mv(&self.sh_down, 0, &round(&act));
        let s = sigmoid(sg as f64);
        for r in 0..h {
            out[r] += s * y[r];
        }
        out
    }
}

fn topk_ref(logits: &[f32], k: usize) -> (Vec<usize>, Vec<f64>) {
    common::topk(logits, k)
}

fn moe_dev(gpu: &Arc<Gpu>, m: &HostMoe) -> (Vec<lily_cuda::device::DeviceBuffer>, MoeDev) {
    let parts = [&m.gate, &m.up, &m.down, &m.sh_gate, &m.sh_up, &m.sh_down].map(|q| q.upload(gpu));
    let q: Vec<QMat> = parts.iter().map(|p| p.1).collect();
    let dev = MoeDev { router: QMat::default(), gate: q[0], up: q[1], down: q[2], sh_gate: q[3], sh_up: q[4], sh_down: q[5], sh_expert_gate: QMat::default() };
    (parts.into_iter().map(|p| p.0).collect(), dev)
}

#[test]
fn grouped_moe_gemm_path_matches_reference() {
    let Some(gpu) = gpu("grouped_moe_gemm_path_matches_reference") else { return };
    for (label, d) in both() {
        let k = Kernels::load(&gpu, &d).expect("kernels");
        let host = HostMoe::random(&d, 800);
        let (_bufs, dev) = moe_dev(&gpu, &host);
        // Tiny: 300 tokens over 8 experts put several GEMM tiles on one expert.
        let sizes: &[usize] = if d.n_experts > 64 { &[5, 64] } else { &[5, 300] };
        // Every tile height the route can pick, and the one it picks.
        let cases: Vec<(usize, usize)> = sizes.iter().flat_map(|&n| TILE_ROWS.iter().map(move |&bm| (n, bm))).collect();
        for (n, bm) in cases {
            let mut rng = Rng::new(810 + n as u64);
            let h0 = rng.vec(n * d.hidden, -3.0, 3.0);
            let gain = rng.vec(d.hidden, 0.5, 1.5);
            let logits = rng.vec(n * d.n_experts, -2.0, 2.0);
            let sg = rng.vec(n, -2.0, 2.0);
            let (hb, gb, lb, sb) = (upload(&gpu, &h0), upload(&gpu, &gain), upload(&gpu, &logits), upload(&gpu, &sg));
            let xn = zeros(&gpu, n * d.hidden * 2);
            let mt = moe::max_tiles(&d, n, bm);
            let z = |bytes: usize| zeros(&gpu, bytes);
            let (_route_mem, rb) = route_bufs(&gpu, &d, n, bm);
            let (offs, tiles, ntiles, perm, counts, ticket) = (rb.offsets, rb.tiles, rb.ntiles, rb.perm, rb.counts, rb.ticket);
            let logits_in = gemm::KPartials { ptr: lb.ptr(), splits: 1, plane: n * d.n_experts };
            let act_sorted = z(n * d.topk * d.moe_inter * 2);
            let y_sorted = upload(&gpu, &vec![NAN; n * d.topk * d.hidden]);
            let act_sh = z(n * d.moe_inter * 2);
            let ys = upload(&gpu, &vec![NAN; n * d.hidden]);
            gemm::rmsnorm_f16(&gpu, &k, hb.ptr(), gb.ptr(), xn.ptr(), n, d.rms_eps).expect("norm");
            // Twice on the same buffers: the first run must leave the counts
            // and the ticket at 0 for the second, which plans the same tiles.
            moe::route(&gpu, &k, &d, &rb, logits_in, n, bm).expect("route");
            let first_plan: (Vec<i32>, Vec<i32>) = (download(&gpu, offs, d.n_experts + 1), download(&gpu, tiles, mt * 3));
            moe::route(&gpu, &k, &d, &rb, logits_in, n, bm).expect("route again");
            let gather = Grouping { tiles, ntiles, max_tiles: mt, a_rows: perm, bm };
            let sorted = Grouping { a_rows: 0, ..gather };
            gemm::gemm(&gpu, &k, xn.ptr(), d.hidden, n * d.topk, &dev.gate, Some(&dev.up), GemmOut::SwiGlu(act_sorted.ptr()), d.moe_inter, Some(&gather))
                .expect("gate_up");
            gemm::gemm(&gpu, &k, act_sorted.ptr(), d.moe_inter, n * d.topk, &dev.down, None, GemmOut::Store(y_sorted.ptr()), d.hidden, Some(&sorted))
                .expect("down");
            gemm::gemm(&gpu, &k, xn.ptr(), d.hidden, n, &dev.sh_gate, Some(&dev.sh_up), GemmOut::SwiGlu(act_sh.ptr()), d.moe_inter, None)
                .expect("shared gate_up");
            gemm::gemm(&gpu, &k, act_sh.ptr(), d.moe_inter, n, &dev.sh_down, None, GemmOut::Store(ys.ptr()), d.hidden, None).expect("shared down");
            // The combine also normalises the new rows for a next layer:
            // bit for bit what rmsnorm_f16 makes of them.
            let next_gain = upload(&gpu, &rng.vec(d.hidden, 0.5, 1.5));
            let xn_fused = zeros(&gpu, n * d.hidden * 2);
            let norm = moe::NextNorm { gain: next_gain.ptr(), xn: xn_fused.ptr(), eps: d.rms_eps };
            moe::combine(&gpu, &k, hb.ptr(), y_sorted.ptr(), ys.ptr(), sb.ptr(), &rb, n, Some(norm)).expect("combine");
            let got: Vec<f32> = download(&gpu, hb.ptr(), n * d.hidden);
            let xn_ref = zeros(&gpu, n * d.hidden * 2);
            gemm::rmsnorm_f16(&gpu, &k, hb.ptr(), next_gain.ptr(), xn_ref.ptr(), n, d.rms_eps).expect("next norm");
            let (fused, alone): (Vec<u16>, Vec<u16>) = (download(&gpu, xn_fused.ptr(), n * d.hidden), download(&gpu, xn_ref.ptr(), n * d.hidden));
            let differ = fused.iter().zip(&alone).filter(|(a, b)| a != b).count();
            check(differ == 0, format!("{label} {n} tokens: the combine's fused norm differs from rmsnorm_f16 in {differ} of {} values", fused.len()));

            // The plan: every pair placed once, offsets and tiles consistent,
            // the counts and the ticket left at 0.
            check(download::<i32>(&gpu, counts, d.n_experts).iter().all(|c| *c == 0), format!("{label}: counts left at 0"));
            check(download::<i32>(&gpu, ticket, 1) == vec![0], format!("{label}: ticket left at 0"));
            let o: Vec<i32> = download(&gpu, offs, d.n_experts + 1);
            check(o[d.n_experts] as usize == n * d.topk && o.windows(2).all(|w| w[0] <= w[1]), format!("{label}: offsets ascend to every pair"));
            let nt = download::<i32>(&gpu, ntiles, 1)[0] as usize;
            let tl: Vec<i32> = download(&gpu, tiles, mt * 3);
            let mut next = 0;
            for t in tl[..3 * nt].chunks_exact(3) {
                let (e, a, b) = (t[0] as usize, t[1], t[2]);
                check(a == next && b > a && b - a <= bm as i32 && a >= o[e] && b <= o[e + 1], format!("{label}: tile {t:?} in order inside expert {e}"));
                next = b;
            }
            check(next as usize == n * d.topk, format!("{label}: the tiles cover every pair"));
            check(first_plan == (o, tl), format!("{label}: a second route plans the same offsets and tiles"));
            let p: Vec<i32> = download(&gpu, perm, n * d.topk);
            let mut seen = vec![0usize; n];
            for t in &p {
                seen[*t as usize] += 1;
            }
            check(seen.iter().all(|s| *s == d.topk), format!("{label}: every token appears topk times in the permutation"));

            let want: Vec<f64> = (0..n)
                .into_par_iter()
                .flat_map_iter(|t| {
                    let ht = &h0[t * d.hidden..(t + 1) * d.hidden];
                    let y = host.forward(&rmsnorm(ht, &gain, d.rms_eps), &logits[t * d.n_experts..(t + 1) * d.n_experts], sg[t], d.topk, true);
                    ht.iter().zip(y).map(|(a, b)| *a as f64 + b).collect::<Vec<_>>()
                })
                .collect();
            assert_close(&format!("grouped moe {label} {n} tokens, {bm}-row tiles"), &got, &want, 2e-3);
        }
    }
    finish();
}

/// The prefill route's device buffers for `n` tokens cut at `bm` rows, zeroed
/// (counts and ticket must start at 0), and the memory that holds them.
fn route_bufs(gpu: &Arc<Gpu>, d: &Dims, n: usize, bm: usize) -> (Vec<DeviceBuffer>, moe::RouteBufs) {
    let pairs = n * d.topk * 4;
    let sizes = [pairs, pairs, d.n_experts * 4, pairs, (d.n_experts + 1) * 4, moe::max_tiles(d, n, bm) * 12, 16, pairs, pairs, 16];
    let mem: Vec<DeviceBuffer> = sizes.iter().map(|b| zeros(gpu, *b)).collect();
    let p: Vec<u64> = mem.iter().map(|b| b.ptr()).collect();
    let rb = moe::RouteBufs {
        topk_idx: p[0],
        topk_w: p[1],
        counts: p[2],
        rank: p[3],
        offsets: p[4],
        tiles: p[5],
        ntiles: p[6],
        perm: p[7],
        inv: p[8],
        ticket: p[9],
    };
    (mem, rb)
}

/// The router's split-K partials, summed by the route's top-k, choose what
/// the reduced logits choose, with the same weights bit for bit, and what
/// lily-cpu's reference route of those logits chooses.
#[test]
fn route_of_unreduced_router_partials_equals_route_of_the_logits() {
    let Some(gpu) = gpu("route_of_unreduced_router_partials_equals_route_of_the_logits") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(690);
    let scratch_buf = zeros(&gpu, gemm::SPLITK_FLOATS * 4);
    let scratch = SplitScratch { ptr: scratch_buf.ptr(), floats: gemm::SPLITK_FLOATS };
    let w = HostQ::random(rng.seed(), 1, d.n_experts, d.hidden, 8, 0.1);
    let (_wb, wm) = w.upload(&gpu);
    let mut split_seen = false;
    for n in [5usize, 300, 4096] {
        let (_, ab) = f16_matrix(&mut rng, n, d.hidden, 2.0);
        let abuf = upload(&gpu, &ab);
        let bm = moe::tile_rows(&d, n);
        let logits = upload(&gpu, &vec![NAN; n * d.n_experts]);
        let seg = Seg { w: &wm, up: None, out: GemmOut::Store(logits.ptr()), ldc: d.n_experts };
        // The reduced logits, routed.
        gemm::gemm_segs(&gpu, &k, abuf.ptr(), d.hidden, n, &[seg], scratch).expect("router");
        let (_m1, reduced) = route_bufs(&gpu, &d, n, bm);
        moe::route(&gpu, &k, &d, &reduced, gemm::KPartials { ptr: logits.ptr(), splits: 1, plane: n * d.n_experts }, n, bm).expect("route");
        // The partials, routed.
        let parts = gemm::gemm_unreduced(&gpu, &k, abuf.ptr(), d.hidden, n, seg, scratch).expect("router partials");
        split_seen |= parts.splits > 1;
        let (_m2, unreduced) = route_bufs(&gpu, &d, n, bm);
        moe::route(&gpu, &k, &d, &unreduced, parts, n, bm).expect("route of partials");
        let pairs = n * d.topk;
        let (i1, i2): (Vec<i32>, Vec<i32>) = (download(&gpu, reduced.topk_idx, pairs), download(&gpu, unreduced.topk_idx, pairs));
        let (w1, w2): (Vec<f32>, Vec<f32>) = (download(&gpu, reduced.topk_w, pairs), download(&gpu, unreduced.topk_w, pairs));
        check(i1 == i2, format!("{n} tokens, {} splits: the partials choose the experts the logits choose", parts.splits));
        check(w1.iter().zip(&w2).all(|(a, b)| a.to_bits() == b.to_bits()), format!("{n} tokens, {} splits: the same weights bit for bit", parts.splits));
        let (o1, o2): (Vec<i32>, Vec<i32>) = (download(&gpu, reduced.offsets, d.n_experts + 1), download(&gpu, unreduced.offsets, d.n_experts + 1));
        check(o1 == o2, format!("{n} tokens: the same expert offsets"));
        let host: Vec<f32> = download(&gpu, logits.ptr(), n * d.n_experts);
        let mut agree = 0;
        for t in 0..n {
            let want: Vec<usize> = lily_cpu::reference::moe::route(&host[t * d.n_experts..(t + 1) * d.n_experts], d.topk).into_iter().map(|(e, _)| e).collect();
            let got: Vec<usize> = i2[t * d.topk..(t + 1) * d.topk].iter().map(|e| *e as usize).collect();
            agree += usize::from(got == want);
        }
        check(agree == n, format!("{n} tokens: lily-cpu's route of the logits agrees on {agree} of {n} tokens"));
    }
    check(split_seen, "the planner split the router at some size".to_string());
    finish();
}

// ---- sampling --------------------------------------------------------------------------------

#[test]
fn argmax_rows_and_finish_advance_the_step() {
    let Some(gpu) = gpu("argmax_rows_and_finish_advance_the_step") else { return };
    let d = prod_dims();
    let k = Kernels::load(&gpu, &d).expect("kernels");
    let mut rng = Rng::new(1400);
    let (rows, cols) = (5, d.vocab);
    let chunk = sampling::ARGMAX_CHUNK;
    let mut logits = rng.vec(rows * cols, -5.0, 5.0);
    // Row 1 has a tie at its maximum: the first index wins.
    logits[cols + 17] = 9.0;
    logits[cols + 18] = 9.0;
    // Row 2: a tie across two blocks' columns (the first block's wins).
    logits[2 * cols + chunk - 1] = 9.0;
    logits[2 * cols + chunk] = 9.0;
    // Row 3: the maximum in the last, partial block; row 4: in a middle one.
    logits[4 * cols - 2] = 9.5;
    logits[4 * cols + 3 * chunk + 5] = 8.0;
    let lb = upload(&gpu, &logits);
    // Stale keys larger than any logit's: the launcher clears them.
    let keys = upload(&gpu, &vec![u64::MAX; rows]);
    sampling::argmax_rows(&gpu, &k, lb.ptr(), keys.ptr(), rows, cols).expect("argmax_rows");
    let tokens = zeros(&gpu, rows * 4);
    let out_ids = zeros(&gpu, 3 * rows * 4);
    let pos = upload(&gpu, &[5i32, 6, 7, 8, 9]);
    let step = upload(&gpu, &[1i32]);
    sampling::argmax_finish(&gpu, &k, keys.ptr(), tokens.ptr(), out_ids.ptr(), pos.ptr(), step.ptr(), rows).expect("finish");
    let toks: Vec<u32> = download(&gpu, tokens.ptr(), rows);
    for r in 0..rows {
        check(toks[r] as usize == argmax(&logits[r * cols..(r + 1) * cols]), format!("argmax row {r}"));
    }
    check(toks[1] == 17, format!("tie goes to the first index: {}", toks[1]));
    check(toks[2] as usize == chunk - 1, format!("a tie across blocks goes to the first index: {}", toks[2]));
    check(toks[3] as usize == cols - 2 && toks[4] as usize == 3 * chunk + 5, format!("maxima in the last and a middle block: {toks:?}"));
    // A row length that is no multiple of 4 (each row unaligned: the scalar
    // path), against the reference argmax.
    let (rows2, cols2) = (3, 2 * chunk + 1001);
    let odd = rng.vec(rows2 * cols2, -3.0, 3.0);
    let ob = upload(&gpu, &odd);
    let keys2 = zeros(&gpu, rows2 * 8);
    sampling::argmax_rows(&gpu, &k, ob.ptr(), keys2.ptr(), rows2, cols2).expect("argmax_rows (odd width)");
    let got: Vec<u64> = download(&gpu, keys2.ptr(), rows2);
    for r in 0..rows2 {
        let want = argmax(&odd[r * cols2..(r + 1) * cols2]);
        check(sampling::key_index(got[r]) as usize == want, format!("odd width row {r}: {} want {want}", sampling::key_index(got[r])));
    }
    let ids: Vec<u32> = download(&gpu, out_ids.ptr(), 3 * rows);
    check(ids[rows..2 * rows] == toks[..], "ids land in the step's row");
    check(download::<i32>(&gpu, pos.ptr(), rows) == vec![6, 7, 8, 9, 10], "positions advance");
    check(download::<i32>(&gpu, step.ptr(), 1) == vec![2], "step advances");
    finish();
}
