//! Speed probe of the decode matrix kernels (qmm.cu) alone: the lm_head
//! (248,320 x 2,048), a DeltaNet in-projection (12,352 x 2,048) and an
//! out-projection (2,048 x 4,096), real-shape random weights made on the GPU,
//! timed with CUDA events over repeated launches (each launch may overlap the
//! previous one's tail, as in a decode step), for several block shapes and
//! probe variants compiled side by side; up to 8 tokens each dense matrix
//! also on fp16 inputs (`qmm::XPrecision::F16`, tagged "f16"). Prints µs per launch and the
//! achieved bandwidth over the matrix bytes, next to a device-to-device copy
//! of the lm_head's bytes (the ceiling).
//!
//!   cargo run -p lily-cuda --release --example qmm_probe [SIZES [VARIANTS]]

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use lily_cuda::device::{copy_device, read_device, write_device, DeviceBuffer};
use lily_cuda::kernels::Kernels;
use lily_cuda::qmm::{self, DenseSeg, Epilogue, QmmShape};
use lily_cuda::weights::MixerDev;
use lily_cuda::{CudaBackend, Gpu, Options};

fn time_us(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    f()?;
    let e0 = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| e.to_string())?;
    let e1 = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| e.to_string())?;
    e0.record(&gpu.stream).map_err(|e| e.to_string())?;
    for _ in 0..reps {
        f()?;
    }
    e1.record(&gpu.stream).map_err(|e| e.to_string())?;
    gpu.synchronize().map_err(|e| e.to_string())?;
    Ok(e0.elapsed_ms(&e1).map_err(|e| e.to_string())? as f64 * 1000.0 / reps as f64)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("qmm_probe: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let gpu: Arc<Gpu> = Gpu::open(0).map_err(|e| e.to_string())?;
    let mut cfg = lily_core::config::production();
    cfg.num_layers = 4;
    let mut opts = Options::for_context(512);
    opts.max_sequences = 2;
    let be = CudaBackend::synthetic(&gpu, &cfg, opts, 3).map_err(|e| e.to_string())?;
    let m = be.model();
    let (d, dec) = (&m.dims, m.mem.decode);
    let MixerDev::DeltaNet(gd) = &m.weights.layers[0].mixer else { return Err("layer 0 is not DeltaNet".into()) };
    let lm = m.weights.lm_head;
    let scratch = DeviceBuffer::zeroed(&gpu, lm.bytes(), "copy probe").map_err(|e| e.to_string())?;
    let copy_us = time_us(&gpu, 10, || copy_device(&gpu, scratch.ptr(), lm.codes, lm.bytes()).map_err(|e| e.to_string()))?;
    println!("device copy of {:.1} MB: {copy_us:.1} us, {:.2} TB/s (read + write)", lm.bytes() as f64 / 1e6, 2.0 * lm.bytes() as f64 / copy_us / 1e6);
    let all: Vec<(&str, QmmShape, Vec<String>)> = vec![
        ("default", QmmShape::default(), vec![]),
        ("MoE items of 4 at every size", QmmShape { moe_pairs8_from: usize::MAX, ..QmmShape::default() }, vec![]),
        ("default, no math", QmmShape::default(), vec!["-DQMM_PROBE_NO_MATH".into()]),
        ("K slices of 512", QmmShape { slice_cols: 512, ..QmmShape::default() }, vec![]),
        ("K slices of 256", QmmShape { slice_cols: 256, ..QmmShape::default() }, vec![]),
        ("rings of 2", QmmShape { ring: 2, dense_ring: 2, dense2_ring: 2, head_ring: 2, one_token_ring: 2, ..QmmShape::default() }, vec![]),
        ("rings of 6", QmmShape { ring: 6, dense_ring: 6, dense2_ring: 6, head_ring: 6, one_token_ring: 6, ..QmmShape::default() }, vec![]),
        ("K slices of 512, no math", QmmShape { slice_cols: 512, ..QmmShape::default() }, vec!["-DQMM_PROBE_NO_MATH".into()]),
        // 8-warp blocks for every matrix kernel (session 38's probe before
        // the wide entries): the expert kernels spill at 8 warps (their
        // occupancy bounds), so only the dense rows of these two mean
        // anything.
        ("8-warp blocks", QmmShape { warps: 8, ..QmmShape::default() }, vec![]),
        ("8-warp blocks, K slices of 512", QmmShape { warps: 8, slice_cols: 512, ..QmmShape::default() }, vec![]),
        // Wide matrices in 8 slices of two stages (blocks of 8 warps), the
        // default's alternative.
        ("wide matrices in 8 slices", QmmShape { wide_kq: 8, wide_ring: 3, ..QmmShape::default() }, vec![]),
        // The stage math's parts left out one at a time (qmm.cu's
        // QMM_PROBE_NO_X / _NO_DEQ / _NO_FOLD; wrong values): which of them
        // holds the time the math costs over "no math".
        ("no x loads", QmmShape::default(), vec!["-DQMM_PROBE_NO_X".into()]),
        ("no dequantisation", QmmShape::default(), vec!["-DQMM_PROBE_NO_DEQ".into()]),
        ("no fold", QmmShape::default(), vec!["-DQMM_PROBE_NO_FOLD".into()]),
        ("no x loads, no fold", QmmShape::default(), vec!["-DQMM_PROBE_NO_X".into(), "-DQMM_PROBE_NO_FOLD".into()]),
        // One warp a task at K = 2,048 (the experts' gate/up, the
        // in-projections): no slices' partial exchange on a named barrier.
        ("K slices of 2048", QmmShape { slice_cols: 2048, ..QmmShape::default() }, vec![]),
    ];
    // `qmm_probe [SIZES [VARIANTS]]`: token counts (default 1,8,16,32,64,128)
    // and variant numbers into the list above (default the first three).
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = match args.first() {
        Some(a) => a.split(',').map(|v| v.parse().map_err(|e| format!("sizes: {e}"))).collect::<Result<_, _>>()?,
        None => vec![1, 8, 16, 32, 64, 128],
    };
    let picks: Vec<usize> = match args.get(1) {
        Some(a) => a.split(',').map(|v| v.parse().map_err(|e| format!("variants: {e}"))).collect::<Result<_, _>>()?,
        None => vec![0, 1, 2],
    };
    let variants: Vec<(&str, QmmShape, Vec<String>)> = picks.iter().filter_map(|&i| all.get(i).cloned()).collect();
    let in_segs = |out: lily_cuda::device::DevSlice<f32>| {
        let offs = [0, d.conv_dim, d.conv_dim + d.gdn_val_dim(), d.conv_dim + d.gdn_val_dim() + d.gv_heads];
        [&gd.in_qkv, &gd.in_z, &gd.in_a, &gd.in_b]
            .into_iter()
            .zip(offs)
            .map(|(w, off)| DenseSeg { w, out: out.from(off).unwrap_or(out), out_stride: d.proj_stride(), epilogue: Epilogue::Store })
            .collect::<Vec<_>>()
    };
    let in_bytes: usize = [&gd.in_qkv, &gd.in_z, &gd.in_a, &gd.in_b].iter().map(|w| w.bytes()).sum();
    for (label, shape, extra) in variants {
        let k = match Kernels::load_tuned(&gpu, d, shape, &extra) {
            Ok(k) => k,
            Err(e) => {
                println!("{label}: {e}");
                continue;
            }
        };
        for &n in &sizes {
            let lm_seg = DenseSeg { w: &lm, out: dec.logits, out_stride: d.vocab, epilogue: Epilogue::Logits };
            let cases: Vec<(&str, Vec<DenseSeg>, qmm::PackedRows, usize)> = vec![
                ("lm_head", vec![lm_seg], dec.moe.px_in, lm.bytes()),
                ("in_proj", in_segs(dec.proj), dec.moe.px_in, in_bytes),
                ("out_proj", vec![DenseSeg { w: &gd.out, out: dec.h, out_stride: d.hidden, epilogue: Epilogue::Add }], dec.px_mix, gd.out.bytes()),
            ];
            // Up to 8 tokens also on fp16 inputs (`DecodeMatrices::f16_from`).
            let precisions: &[(qmm::XPrecision, &str)] = if n <= lily_cuda::state::F16_MAX_TOK {
                &[(qmm::XPrecision::HiLo, ""), (qmm::XPrecision::F16, " f16")]
            } else {
                &[(qmm::XPrecision::HiLo, "")]
            };
            for (name, segs, x, bytes) in cases {
                let reps = if name == "lm_head" { 10 } else { 50 };
                for &(xp, tag) in precisions {
                    match time_us(&gpu, reps, || qmm::dense(&gpu, &k, &segs, x, n, xp, Some(dec.argmax)).map_err(|e| e.to_string())) {
                        Ok(us) => println!("{label:<28} n={n:<3} {:<13} {us:9.1} us  {:.2} TB/s", format!("{name}{tag}"), bytes as f64 / us / 1e6),
                        Err(e) => println!("{label:<28} n={n:<3} {name:<9}{tag} {e}"),
                    }
                }
            }
            // The MoE of layer 0 for n tokens of varied residuals: router
            // (+ top-k and plan), gate/up (+ shared expert), down.
            let l = &m.weights.layers[0];
            let mut seed = 0x9e37_79b9_u32.wrapping_mul(n as u32 + 1);
            let h: Vec<f32> = (0..n * d.hidden)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
                })
                .collect();
            write_device(&gpu, dec.h.ptr(), &h).map_err(|e| e.to_string())?;
            // The experts on exact hi/lo x, and (GEMM-path steps, `Options::moe_f16_from`) on fp16 x:
            // each after a router run planning for it (its plan items differ).
            for (xp, tag) in [(qmm::XPrecision::HiLo, ""), (qmm::XPrecision::F16, " f16")] {
                // Both routers alone (`Options::router_mma_from` picks one a
                // step), the default one last so that its plan feeds the experts.
                let math = m.mem.opts.router_math(n, d);
                let other = if math == qmm::RouterMath::TensorCores { qmm::RouterMath::CudaCores } else { qmm::RouterMath::TensorCores };
                let router = |rm| qmm::router(&gpu, &k, d, &l.moe, l.post_norm, dec.h, &dec.moe, n, xp, rm).map_err(|e| e.to_string());
                let other_us = if qmm::router_mma_fits(d) { time_us(&gpu, 50, || router(other))? } else { f64::NAN };
                let r_us = time_us(&gpu, 50, || router(math))?;
                let up_us = time_us(&gpu, 50, || qmm::experts(&gpu, &k, d, &l.moe, true, &dec.moe, n, xp).map_err(|e| e.to_string()))?;
                let dn_us = time_us(&gpu, 50, || qmm::experts(&gpu, &k, d, &l.moe, false, &dec.moe, n, xp).map_err(|e| e.to_string()))?;
                let idx: Vec<i32> = read_device(&gpu, dec.moe.topk_idx.ptr(), n * d.topk).map_err(|e| e.to_string())?;
                let mut experts: Vec<i32> = idx.clone();
                experts.sort_unstable();
                experts.dedup();
                // Bytes each expert launch streams: the active experts + the shared one.
                let e_bytes = |w: &lily_cuda::weights::QMat| w.bytes() / w.experts;
                let up_b = (experts.len() + 1) * (e_bytes(&l.moe.gate) + e_bytes(&l.moe.up));
                let dn_b = (experts.len() + 1) * e_bytes(&l.moe.down);
                println!(
                    "{label:<28} n={n:<3} moe{tag}: router {r_us:7.1} us ({math:?}; {other:?} {other_us:.1}), gate_up {up_us:7.1} us {:.2} TB/s, down {dn_us:7.1} us {:.2} TB/s ({} experts)",
                    up_b as f64 / up_us / 1e6,
                    dn_b as f64 / dn_us / 1e6,
                    experts.len()
                );
            }
        }
    }
    Ok(())
}
