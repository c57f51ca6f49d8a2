//! The fast products on packed codes against the reference's row-by-row
//! dequantise-and-dot, for every storage kind the checkpoints use: 4-bit
//! (embedding, lm_head, projections), 8-bit (router, shared-expert gate),
//! stacked experts, and bf16 (including the HF fused gate_up views).

mod common;

use lily_core::weights::{Linear, Mixer};
use lily_core::Format;
use lily_cpu::fast::matmul::{Isa, Mat};
use lily_cpu::reference::ops::linear;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn check(name: &str, lin: &Linear, expert: usize) {
    let mat = Mat::new(lin).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    // 1..=8 and 17 cover every token-tile width of the kernels and both
    // sides of the small-batch / dequantise-the-row boundary.
    for n in [1usize, 2, 3, 4, 5, 8, 9, 17] {
        let x: Vec<f32> = (0..n * lin.cols()).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let mut par = vec![0f32; n * lin.rows()];
        let mut ser = vec![0f32; n * lin.rows()];
        mat.matmul(expert, &x, n, &mut par);
        mat.matmul_serial(expert, &x, n, &mut ser);
        assert_eq!(par, ser, "{name}: parallel and serial products differ");
        let mut base = vec![0f32; n * lin.rows()];
        mat.matmul_isa(Isa::Baseline, expert, &x, n, &mut base);
        for (variant, got) in [("default", &par), ("baseline", &base)] {
        for t in 0..n {
            let want = linear(lin, expert, &x[t * lin.cols()..(t + 1) * lin.cols()]);
            let got = &par[t * lin.rows()..(t + 1) * lin.rows()];
            let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (r, (a, b)) in want.iter().zip(got).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale * (lin.cols() as f32).sqrt(),
                    "{name} {variant} n={n} t={t} row {r}: {a} vs {b}"
                );
            }
        }
        }
    }
}

#[test]
fn products_match_the_reference_for_every_storage_kind() {
    for format in [Format::MlxQ4, Format::HfBf16] {
        let (_dir, w) = common::tiny(format, 4, 13);
        let l0 = &w.layers[0];
        let l3 = &w.layers[3];
        check("embed", &w.embed, 0);
        check("lm_head", &w.lm_head, 0);
        check("router", &l0.moe.router, 0);
        check("shared_expert_gate", &l0.moe.shared_expert_gate, 0);
        for e in [0, 5, 7] {
            check("experts.gate", &l0.moe.gate, e);
            check("experts.up", &l0.moe.up, e);
            check("experts.down", &l0.moe.down, e);
        }
        if let Mixer::DeltaNet(d) = &l0.mixer {
            check("in_proj_qkv", &d.in_qkv, 0);
            check("out_proj", &d.out, 0);
            check("in_proj_a", &d.in_a, 0);
        }
        if let Mixer::Attention(a) = &l3.mixer {
            check("q_proj", &a.q, 0);
            check("o_proj", &a.o, 0);
        }
    }
}

#[test]
fn embedding_rows_match_the_core_dequantiser() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 14);
    let mat = Mat::new(&w.embed).unwrap();
    let mut a = vec![0f32; w.config.hidden_size];
    let mut b = vec![0f32; w.config.hidden_size];
    for row in [0, 1, 100, w.config.vocab_size - 1] {
        w.embed.row_f32(0, row, &mut a);
        mat.row_f32(0, row, &mut b);
        assert_eq!(a, b, "row {row}");
    }
}
