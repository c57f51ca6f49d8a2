//! The committed tiny fixtures (tests/fixtures/tiny, written by
//! scripts/goldens/make_goldens.py) load through Lily's own loader in both
//! layouts, and the two layouts describe the same model: every tensor of the
//! MLX 4-bit checkpoint, once dequantised and with its norm convention
//! resolved, matches the BF16 checkpoint within the quantisation step.
//! The golden logits themselves are compared by the CPU backend's tests.

use std::path::PathBuf;

use lily_core::config::{Format, ShapeClass};
use lily_core::weights::{Linear, Mixer, NormConvention, Weights};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

/// Largest |a - b| over a pair of equally shaped linears, relative to the
/// largest step (|scale|) a 4/8-bit group of `b` may have: `a` is exact.
fn max_err(a: &Linear, b: &Linear) -> f32 {
    assert_eq!((a.experts(), a.rows(), a.cols()), (b.experts(), b.rows(), b.cols()));
    let mut worst = 0f32;
    for e in 0..a.experts() {
        let (x, y) = (a.to_f32(e), b.to_f32(e));
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

/// The step of a 4-bit group spans at most (max - min) / 15 of its values,
/// plus what pinning an edge adds; 1/8 of the matrix's range is a safe bound.
fn bound(a: &Linear) -> f32 {
    let mut lo = f32::MAX;
    let mut hi = f32::MIN;
    for e in 0..a.experts() {
        for v in a.to_f32(e) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    (hi - lo) / 8.0
}

#[test]
fn both_tiny_checkpoints_load_and_agree() {
    let hf = Weights::load(&fixture("hf-bf16")).expect("hf-bf16 fixture loads");
    let mlx = Weights::load(&fixture("mlx-q4")).expect("mlx-q4 fixture loads");
    assert_eq!(hf.config.shape_class, ShapeClass::Test);
    assert_eq!(hf.config.format(), Format::HfBf16);
    assert_eq!(mlx.config.format(), Format::MlxQ4);
    assert_eq!(hf.norm_convention, NormConvention::OnePlus);
    assert_eq!(mlx.norm_convention, NormConvention::Gain);
    let strip = |mut c: lily_core::ModelConfig| {
        c.quantization = None;
        c
    };
    assert_eq!(strip(hf.config.clone()), strip(mlx.config.clone()));

    let close = |a: &Linear, b: &Linear, what: &str| {
        let (err, lim) = (max_err(a, b), bound(a));
        assert!(err <= lim, "{what}: max error {err} above {lim}");
    };
    // Norm gains: MLX stores bf16(1 + w), Lily computes 1 + w from HF in f32.
    let gains = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 4e-3, "{what}: {x} vs {y}");
        }
    };
    close(&hf.embed, &mlx.embed, "embed");
    close(&hf.lm_head, &mlx.lm_head, "lm_head");
    gains(&hf.final_norm, &mlx.final_norm, "final norm");
    for (i, (a, b)) in hf.layers.iter().zip(&mlx.layers).enumerate() {
        gains(&a.input_norm, &b.input_norm, &format!("layer {i} input norm"));
        gains(&a.post_norm, &b.post_norm, &format!("layer {i} post norm"));
        match (&a.mixer, &b.mixer) {
            (Mixer::DeltaNet(x), Mixer::DeltaNet(y)) => {
                close(&x.in_qkv, &y.in_qkv, "in_proj_qkv");
                close(&x.in_z, &y.in_z, "in_proj_z");
                close(&x.in_a, &y.in_a, "in_proj_a");
                close(&x.in_b, &y.in_b, "in_proj_b");
                close(&x.out, &y.out, "out_proj");
                assert_eq!(x.conv, y.conv, "layer {i} conv taps");
                assert_eq!(x.a_log, y.a_log, "layer {i} A_log");
                assert_eq!(x.dt_bias, y.dt_bias, "layer {i} dt_bias");
                assert_eq!(x.norm, y.norm, "layer {i} gated norm");
            }
            (Mixer::Attention(x), Mixer::Attention(y)) => {
                close(&x.q, &y.q, "q_proj");
                close(&x.k, &y.k, "k_proj");
                close(&x.v, &y.v, "v_proj");
                close(&x.o, &y.o, "o_proj");
                gains(&x.q_norm, &y.q_norm, "q_norm");
                gains(&x.k_norm, &y.k_norm, "k_norm");
            }
            _ => panic!("layer {i}: mixers differ between the fixtures"),
        }
        let (x, y) = (&a.moe, &b.moe);
        close(&x.router, &y.router, "router");
        close(&x.gate, &y.gate, "experts gate");
        close(&x.up, &y.up, "experts up");
        close(&x.down, &y.down, "experts down");
        close(&x.shared_gate, &y.shared_gate, "shared gate_proj");
        close(&x.shared_up, &y.shared_up, "shared up_proj");
        close(&x.shared_down, &y.shared_down, "shared down_proj");
        close(&x.shared_expert_gate, &y.shared_expert_gate, "shared_expert_gate");
    }
}
