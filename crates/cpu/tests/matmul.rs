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
        for (variant, all) in [("default", &par), ("baseline", &base)] {
            for t in 0..n {
                let want = linear(lin, expert, &x[t * lin.cols()..(t + 1) * lin.cols()]);
                let got = &all[t * lin.rows()..(t + 1) * lin.rows()];
                let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                for (r, (a, b)) in want.iter().zip(got).enumerate() {
                    assert!((a - b).abs() <= 1e-5 * scale * (lin.cols() as f32).sqrt(), "{name} {variant} n={n} t={t} row {r}: {a} vs {b}");
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

/// A standalone random 4-bit matrix wide enough (1280 columns = 20 groups)
/// to cross the kernels' column blocks, against the reference.
#[test]
fn wide_4bit_products_cross_column_blocks() {
    use lily_core::config::QuantSpec;
    use lily_core::tensors::{DType, TensorStore};
    use lily_core::weights::QuantLinear;

    let (rows, cols) = (40usize, 1280usize);
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.05f32..0.05)).collect();
    let (codes, scales, biases) = lily_core::quant::quantize(&w, rows, cols, 4, 64).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let half = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect() };
    let code_bytes: Vec<u8> = codes.iter().flat_map(|c| c.to_le_bytes()).collect();
    let (sb, bb) = (half(&scales), half(&biases));
    let views = vec![
        ("m.weight", safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![rows, cols / 8], &code_bytes).unwrap()),
        ("m.scales", safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![rows, cols / 64], &sb).unwrap()),
        ("m.biases", safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![rows, cols / 64], &bb).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let store = TensorStore::open_files(&[path]).unwrap();
    let lin = Linear::Quant(QuantLinear {
        spec: QuantSpec { bits: 4, group_size: 64 },
        experts: 1,
        rows,
        cols,
        codes: store.take("m.weight", &[DType::U32], &[rows, cols / 8]).unwrap(),
        scales: store.take("m.scales", &[DType::BF16], &[rows, cols / 64]).unwrap(),
        biases: store.take("m.biases", &[DType::BF16], &[rows, cols / 64]).unwrap(),
    });
    check("wide 4-bit", &lin, 0);
}

/// A batch of products of different kinds and token counts in one parallel
/// region gives exactly what each product gives alone.
#[test]
fn a_batch_of_products_equals_each_alone() {
    use lily_cpu::fast::matmul::{matmul_many, Product};
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 15);
    let l0 = &w.layers[0];
    let mats: Vec<(Mat, usize, usize)> = vec![
        (Mat::new(&w.lm_head).unwrap(), 0, 1),
        (Mat::new(&l0.moe.router).unwrap(), 0, 3),
        (Mat::new(&l0.moe.down).unwrap(), 6, 1),
        (Mat::new(&l0.moe.gate).unwrap(), 2, 12),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let xs: Vec<Vec<f32>> = mats.iter().map(|(m, _, n)| (0..n * m.cols).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect();
    let mut batched: Vec<Vec<f32>> = mats.iter().map(|(m, _, n)| vec![0f32; n * m.rows]).collect();
    let products = mats.iter().zip(&xs).zip(batched.iter_mut()).map(|(((mat, expert, n), x), y)| Product { mat, expert: *expert, x, n: *n, y }).collect();
    matmul_many(products);
    for (((mat, expert, n), x), got) in mats.iter().zip(&xs).zip(&batched) {
        let mut alone = vec![0f32; n * mat.rows];
        mat.matmul(*expert, x, *n, &mut alone);
        assert_eq!(&alone, got);
        assert!(got.iter().any(|v| *v != 0.0));
    }
}
