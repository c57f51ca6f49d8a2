//! `quantize_checkpoint` against an independent implementation: the tiny
//! BF16 fixture (tests/fixtures/tiny/hf-bf16) converted here must give,
//! tensor for tensor and byte for byte, what the Python converter in
//! scripts/goldens/make_goldens.py (`quantize` mode, written from MLX's GPU
//! `affine_quantize` kernel and mlx-lm's layout rules) wrote to
//! tests/fixtures/tiny/mlx_q4_expected.safetensors. That covers the 4/8-bit
//! codes and bf16 scales/biases, the expert split, the conv transpose, the
//! +1 on the one-centred norms and every name. The committed MLX fixture
//! (tests/fixtures/tiny/mlx-q4, which the MLX goldens were computed from)
//! must hold the same tensors too.

use std::path::{Path, PathBuf};

use lily_core::tensors::TensorStore;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

/// Every tensor of `want` is in `got` with the same dtype, shape and bytes,
/// and `got` has nothing else.
fn assert_same_tensors(got: &TensorStore, want: &TensorStore, what: &str) {
    let got_names: Vec<&str> = got.names().collect();
    let want_names: Vec<&str> = want.names().collect();
    assert_eq!(got_names, want_names, "{what}: tensor names");
    for name in want_names {
        let (g, w) = (got.peek(name).expect("listed"), want.peek(name).expect("listed"));
        assert_eq!(g.dtype, w.dtype, "{what}: {name} dtype");
        assert_eq!(g.shape, w.shape, "{what}: {name} shape");
        if g.bytes() != w.bytes() {
            let first = g.bytes().iter().zip(w.bytes()).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{what}: {name} differs first at byte {first} of {}", w.bytes().len());
        }
    }
}

#[test]
fn quantize_checkpoint_equals_the_python_converter_byte_for_byte() {
    let root = fixtures();
    let out = tempfile::tempdir().expect("temp dir");
    lily_synth::quantize_checkpoint(&root.join("hf-bf16"), out.path(), None).expect("quantize the tiny fixture");
    let got = TensorStore::open_dir(out.path()).expect("read the output");
    let want = TensorStore::open_files(&[root.join("mlx_q4_expected.safetensors")]).expect("expected file");
    assert_same_tensors(&got, &want, "lily quantize output");

    let committed = TensorStore::open_dir(&root.join("mlx-q4")).expect("committed mlx-q4 fixture");
    assert_same_tensors(&committed, &want, "tests/fixtures/tiny/mlx-q4");
}
