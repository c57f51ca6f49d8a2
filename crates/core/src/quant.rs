//! MLX affine quantisation (group 64; 4 and 8 bit).
//!
//! Layout: for a row of `cols` weights, codes are packed little-end first
//! into u32 words (`32 / bits` codes per word, code `j` at bit `(j % per) *
//! bits`), and every group of `group` consecutive weights has one scale and
//! one bias: `w = scale * q + bias`.
//!
//! Choice of scale and bias follows MLX's GPU `affine_quantize` kernel (the
//! one mlx-lm's conversion runs on a Mac), not MLX's CPU fallback in
//! `ops.cpp`, which differs in two ways (it starts the maximum at the first
//! value and computes in the weight's half type). The GPU kernel, in f32:
//! - the group maximum starts at 0 and the minimum at the type's largest
//!   value, so a group of only negative numbers is treated as if it also held
//!   a 0 (its scale spans `[min, 0]`);
//! - `scale = max((max - min) / n_bins, 1e-7)`; the edge with the larger
//!   magnitude (the minimum on a tie goes to the maximum) is pinned to an
//!   exact code by `scale = edge / round(edge / scale)` and `bias = edge`,
//!   unless that code is 0 (then `bias = 0`);
//! - codes are `min(round((w - bias) / scale), n_bins)` computed from the f32
//!   scale and bias, with `round` rounding halves away from zero (Metal's
//!   `round`, like Rust's `f32::round`);
//! - only then are scale and bias rounded to the checkpoint's half type for
//!   storage. Callers do that rounding (see `quantize`).
//!
//! This file does not know tensor names or which modules are 8-bit; that is
//! the config's quantisation block and the converter's business.

use crate::error::{Error, Result};

/// Scale and bias of one group, in f32, before storage rounding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupParams {
    pub scale: f32,
    pub bias: f32,
}

/// MLX's choice of scale and bias for one group.
pub fn group_params(group: &[f32], bits: u32) -> GroupParams {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    // Start values as in the GPU kernel: the maximum is never below 0.
    let mut w_min = f32::MAX;
    let mut w_max = 0.0f32;
    for &w in group {
        w_min = w_min.min(w);
        w_max = w_max.max(w);
    }
    let side = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(eps);
    if !side {
        scale = -scale;
    }
    let edge = if side { w_min } else { w_max };
    let q0 = (edge / scale).round();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    GroupParams { scale, bias }
}

/// Quantised code of one weight given its group's (f32) parameters.
#[inline]
pub fn quantize_value(w: f32, p: GroupParams, bits: u32) -> u32 {
    let n_bins = ((1u32 << bits) - 1) as f32;
    // The lower clamp only turns a rounded -0 into 0: with the parameters
    // above, `(w - bias) / scale` is never below -0.5.
    ((w - p.bias) / p.scale).round().clamp(0.0, n_bins) as u32
}

/// Quantises a row-major matrix `[rows, cols]`; returns packed codes
/// `[rows, cols * bits / 32]` and f32 scales and biases `[rows, cols / group]`.
/// The caller rounds scales and biases to the storage type (MLX computes the
/// codes from the unrounded f32 values, so rounding first would change them).
pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32, group: usize) -> Result<(Vec<u32>, Vec<f32>, Vec<f32>)> {
    if bits != 4 && bits != 8 {
        return Err(Error::Other(format!("quantize: bits must be 4 or 8, got {bits}")));
    }
    if w.len() != rows * cols {
        return Err(Error::Other(format!("quantize: {} values given for a {rows} x {cols} matrix", w.len())));
    }
    if group == 0 || !cols.is_multiple_of(group) {
        return Err(Error::Other(format!("quantize: {cols} columns is not a multiple of the group size {group}")));
    }
    let per_word = (32 / bits) as usize;
    if !cols.is_multiple_of(per_word) {
        return Err(Error::Other(format!("quantize: {cols} columns do not fill whole u32 words at {bits} bits")));
    }
    let words_per_row = cols / per_word;
    let groups_per_row = cols / group;
    let mut packed = vec![0u32; rows * words_per_row];
    let mut scales = vec![0f32; rows * groups_per_row];
    let mut biases = vec![0f32; rows * groups_per_row];
    for r in 0..rows {
        for g in 0..groups_per_row {
            let base = r * cols + g * group;
            let p = group_params(&w[base..base + group], bits);
            scales[r * groups_per_row + g] = p.scale;
            biases[r * groups_per_row + g] = p.bias;
            for j in 0..group {
                let col = g * group + j;
                let q = quantize_value(w[base + j], p, bits);
                packed[r * words_per_row + col / per_word] |= q << ((col % per_word) as u32 * bits);
            }
        }
    }
    Ok((packed, scales, biases))
}

/// Extracts code `col` of a packed row.
#[inline]
pub fn code_at(packed_row: &[u32], col: usize, bits: u32) -> u32 {
    let per_word = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    (packed_row[col / per_word] >> ((col % per_word) as u32 * bits)) & mask
}

/// Dequantises one row: `out[c] = scale[c / group] * q[c] + bias[c / group]`.
pub fn dequantize_row(packed_row: &[u32], scales: &[f32], biases: &[f32], bits: u32, group: usize, out: &mut [f32]) {
    for (c, o) in out.iter_mut().enumerate() {
        let g = c / group;
        *o = scales[g] * code_at(packed_row, c, bits) as f32 + biases[g];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes_of(w: &[f32], bits: u32) -> Vec<u32> {
        let p = group_params(w, bits);
        w.iter().map(|&x| quantize_value(x, p, bits)).collect()
    }

    /// Error bound of MLX's scheme: a value inside the representable range
    /// `[bias, bias + n_bins * scale]` comes back within half a step; one
    /// outside it (pinning the larger edge can shrink the step so that the
    /// other edge falls just outside) is clamped to the nearest end, within
    /// one step. Slack covers f32 rounding.
    fn check_bound(x: f32, back: f32, scale: f32, bias: f32, bits: u32, what: &str) {
        let n_bins = ((1u32 << bits) - 1) as f32;
        let (a, b) = (bias, bias + n_bins * scale);
        let (lo, hi) = (a.min(b), a.max(b));
        let step = scale.abs();
        let slack = 1e-6 * (1.0 + x.abs() + bias.abs());
        let bound = if x >= lo - slack && x <= hi + slack { step / 2.0 } else { step };
        let err = (back - x).abs();
        assert!(err <= bound + slack, "{what}: {x} -> {back} (err {err}, step {step}, range [{lo}, {hi}])");
    }

    fn assert_round_trip(w: &[f32], bits: u32) {
        let (packed, scales, biases) = quantize(w, 1, w.len(), bits, 64).expect("valid shape");
        let mut back = vec![0f32; w.len()];
        dequantize_row(&packed, &scales, &biases, bits, 64, &mut back);
        for (g, chunk) in w.chunks(64).enumerate() {
            for (j, &x) in chunk.iter().enumerate() {
                check_bound(x, back[g * 64 + j], scales[g], biases[g], bits, &format!("bits {bits} group {g} elem {j}"));
            }
        }
    }

    #[test]
    fn ramp_0_to_63_at_4_bits_pins_the_maximum() {
        let w: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let p = group_params(&w, 4);
        // |max| wins, so the scale is negative and the bias is the maximum.
        assert_eq!(p.bias, 63.0);
        assert_eq!(p.scale, 63.0 / -15.0);
        let c = codes_of(&w, 4);
        assert_eq!(c[0], 15);
        assert_eq!(c[63], 0);
        // (63 - j) / 4.2 rounded: 15 15 15 14 14 14 14 13 for j = 0..8.
        assert_eq!(&c[..8], &[15, 15, 15, 14, 14, 14, 14, 13]);
        assert_eq!(c[21], 10);
        assert_round_trip(&w, 4);
    }

    #[test]
    fn ramp_0_to_63_at_8_bits() {
        let w: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let p = group_params(&w, 8);
        assert_eq!(p.bias, 63.0);
        assert_eq!(p.scale, 63.0 / -255.0);
        let c = codes_of(&w, 8);
        assert_eq!(c[0], 255);
        assert_eq!(c[63], 0);
        // (63 - 21) * 255 / 63 = 170 exactly.
        assert_eq!(c[21], 170);
        assert_round_trip(&w, 8);
    }

    #[test]
    fn all_equal_positive_group_is_exact() {
        let w = vec![0.5f32; 64];
        let p = group_params(&w, 4);
        // Range 0: the 1e-7 floor applies; the value is pinned as the bias.
        assert_eq!(p.bias, 0.5);
        assert!(p.scale < 0.0 && p.scale.abs() < 2e-7, "{p:?}");
        assert!(codes_of(&w, 4).iter().all(|&q| q == 0));
        assert_round_trip(&w, 4);
        let (packed, s, b) = quantize(&w, 1, 64, 4, 64).expect("valid");
        let mut back = vec![0f32; 64];
        dequantize_row(&packed, &s, &b, 4, 64, &mut back);
        assert!(back.iter().all(|&x| x == 0.5));
    }

    #[test]
    fn all_equal_negative_group_spans_down_from_zero() {
        // The GPU kernel starts its maximum at 0, so an all-negative group
        // gets the scale of [min, 0], not the 1e-7 floor.
        let w = vec![-0.5f32; 64];
        let p = group_params(&w, 4);
        assert_eq!(p.bias, -0.5);
        assert_eq!(p.scale, -0.5 / -15.0);
        assert!(codes_of(&w, 4).iter().all(|&q| q == 0));
        let p8 = group_params(&w, 8);
        assert_eq!(p8.scale, -0.5 / -255.0);
        assert_round_trip(&w, 4);
        assert_round_trip(&w, 8);
    }

    #[test]
    fn all_negative_ramp_uses_zero_as_its_maximum() {
        // Values -64..-1: the scale covers [-64, 0] (range 64), not [-64, -1].
        let w: Vec<f32> = (0..64).map(|i| -64.0 + i as f32).collect();
        let p = group_params(&w, 4);
        let first = 64.0f32 / 15.0;
        let q0 = (-64.0 / first).round();
        assert_eq!(q0, -15.0);
        assert_eq!(p.bias, -64.0);
        assert_eq!(p.scale, -64.0 / q0);
        // -1 sits at 63 / 4.2667 = 14.77 steps above the minimum.
        assert_eq!(codes_of(&w, 4)[63], 15);
        assert_round_trip(&w, 4);
    }

    #[test]
    fn all_zero_group_has_zero_bias_and_codes() {
        let w = vec![0.0f32; 64];
        let p = group_params(&w, 4);
        assert_eq!(p.bias, 0.0);
        assert_eq!(p.scale, -1e-7);
        assert!(codes_of(&w, 4).iter().all(|&q| q == 0));
        assert_round_trip(&w, 4);
    }

    #[test]
    fn negative_dominant_group_pins_the_minimum() {
        // 64 values evenly from -3 to 1.
        let w: Vec<f32> = (0..64).map(|i| -3.0 + 4.0 * i as f32 / 63.0).collect();
        let p = group_params(&w, 4);
        // scale0 = 4/15; round(-3 / scale0) = round(-11.25) = -11.
        assert_eq!(p.bias, -3.0);
        assert_eq!(p.scale, -3.0f32 / -11.0);
        let c = codes_of(&w, 4);
        assert_eq!(c[0], 0, "the minimum is exact");
        // 1 is at 4 / (3/11) = 14.67 steps: rounds to 15.
        assert_eq!(c[63], 15);
        assert_round_trip(&w, 4);
        assert_round_trip(&w, 8);
    }

    #[test]
    fn one_outlier_dominates_the_scale() {
        let mut w: Vec<f32> = (0..64).map(|i| 0.01 * i as f32 - 0.3).collect();
        w[17] = 10.0;
        let p = group_params(&w, 4);
        assert_eq!(p.bias, 10.0);
        // range 10.3 / 15, negative; round(10 / -0.68667) = round(-14.56) = -15.
        assert_eq!(p.scale, 10.0f32 / -15.0);
        let c = codes_of(&w, 4);
        assert_eq!(c[17], 0, "the outlier is exact");
        // The small values all land on codes 15 (value 0) or clamp at 15.
        assert!(c.iter().enumerate().all(|(j, &q)| j == 17 || q == 15), "{c:?}");
        // Everything but the outlier dequantises to (almost exactly) 0,
        // which is within half a step (1/3) of every value in [-0.3, 0.33].
        assert_round_trip(&w, 4);
        let (packed, s, b) = quantize(&w, 1, 64, 4, 64).expect("valid");
        let mut back = vec![0f32; 64];
        dequantize_row(&packed, &s, &b, 4, 64, &mut back);
        assert!((back[17] - 10.0).abs() < 1e-6);
        assert!(back.iter().enumerate().all(|(j, &x)| j == 17 || x.abs() < 1e-5), "{back:?}");
    }

    #[test]
    fn halves_round_away_from_zero() {
        // min 0, max 15 at 4 bits: scale -1, bias 15, so w = 6.5 gives
        // (6.5 - 15) / -1 = 8.5 exactly. Away from zero: 9 (half-even: 8).
        let mut w = vec![0.0f32; 64];
        w[1] = 15.0;
        w[2] = 6.5;
        let p = group_params(&w, 4);
        assert_eq!(p, GroupParams { scale: -1.0, bias: 15.0 });
        assert_eq!(quantize_value(6.5, p, 4), 9);
        assert_eq!(quantize_value(7.5, p, 4), 8);
    }

    #[test]
    fn pack_order_is_low_bits_first() {
        let w: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let (packed, _, _) = quantize(&w, 1, 64, 4, 64).expect("valid");
        assert_eq!(packed.len(), 8);
        // Codes 15 15 15 14 14 14 14 13: code j at bit (j % 8) * 4.
        assert_eq!(packed[0], 0xDEEE_EFFF);
        // The last word holds codes of 56..63: round((63 - j) / 4.2).
        let last: Vec<u32> = (56..64).map(|j| ((63.0f32 - j as f32) / (63.0f32 / 15.0)).round() as u32).collect();
        let want = last.iter().enumerate().fold(0u32, |acc, (i, &q)| acc | q << (4 * i));
        assert_eq!(packed[7], want);

        let (packed8, _, _) = quantize(&w, 1, 64, 8, 64).expect("valid");
        assert_eq!(packed8.len(), 16);
        // 8-bit: code j at bit (j % 4) * 8; codes 255, 251, 247, 243.
        let c = codes_of(&w, 8);
        assert_eq!(&c[..4], &[255, 251, 247, 243]);
        assert_eq!(packed8[0], 255 | 251 << 8 | 247 << 16 | 243 << 24);
        for j in 0..64 {
            assert_eq!(code_at(&packed8, j, 8), c[j]);
            assert_eq!((packed8[j / 4] >> ((j % 4) * 8)) & 0xff, c[j]);
        }
    }

    #[test]
    fn random_matrices_round_trip_within_the_bound() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for bits in [4u32, 8] {
            let rows = 5;
            let cols = 192;
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0) * 0.3).collect();
            let (packed, scales, biases) = quantize(&w, rows, cols, bits, 64).expect("valid");
            let words = cols * bits as usize / 32;
            let mut back = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(&packed[r * words..(r + 1) * words], &scales[r * 3..r * 3 + 3], &biases[r * 3..r * 3 + 3], bits, 64, &mut back);
                for c in 0..cols {
                    let g = r * 3 + c / 64;
                    check_bound(w[r * cols + c], back[c], scales[g], biases[g], bits, &format!("bits {bits} r {r} c {c}"));
                }
            }
        }
    }

    /// The tiny HF fixture quantised here must equal, bit for bit, what the
    /// independent Python quantiser (scripts/goldens/make_goldens.py
    /// `quantize`) wrote to tests/fixtures/tiny/mlx_q4_expected.safetensors:
    /// codes, and scales and biases after rounding to bf16. Covers every
    /// linear of the model: 4-bit (embed, lm_head, projections, stacked
    /// experts) and 8-bit (router, shared-expert gate).
    #[test]
    fn matches_the_python_quantiser_on_the_tiny_fixture() {
        use crate::config::ModelConfig;
        use crate::tensors::TensorStore;
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
        let cfg = ModelConfig::from_dir(&root.join("hf-bf16")).expect("fixture config");
        let hf = TensorStore::open_dir(&root.join("hf-bf16")).expect("hf fixture");
        let want = TensorStore::open_files(&[root.join("mlx_q4_expected.safetensors")]).expect("expected file");
        let im = cfg.moe_intermediate_size;
        let mlx_name = |hf_name: &str| -> String {
            match hf_name.strip_prefix("model.language_model.") {
                Some(rest) => format!("language_model.model.{rest}"),
                None => format!("language_model.{hf_name}"),
            }
        };
        // Compares one quantised matrix with `rows` rows starting at row
        // `row0` of the expected (possibly stacked) tensors of `module`.
        let check = |module: &str, w: &[f32], rows: usize, cols: usize, row0: usize, bits: u32| {
            let (codes, scales, biases) = quantize(w, rows, cols, bits, 64).expect("valid shape");
            let words = cols * bits as usize / 32;
            let groups = cols / 64;
            let wc = want.peek(&format!("{module}.weight")).expect("codes").as_u32().into_owned();
            let ws = want.peek(&format!("{module}.scales")).expect("scales").as_u16().into_owned();
            let wb = want.peek(&format!("{module}.biases")).expect("biases").as_u16().into_owned();
            assert_eq!(&codes[..], &wc[row0 * words..(row0 + rows) * words], "{module}: codes");
            let bf = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect() };
            assert_eq!(bf(&scales), &ws[row0 * groups..(row0 + rows) * groups], "{module}: scales");
            assert_eq!(bf(&biases), &wb[row0 * groups..(row0 + rows) * groups], "{module}: biases");
        };
        let mut modules = std::collections::BTreeSet::new();
        for name in hf.names() {
            let t = hf.peek(name).expect("listed");
            let w = t.to_f32();
            if let Some(layer) = name.strip_suffix(".mlp.experts.gate_up_proj") {
                let (e, rows2, cols) = (t.shape[0], t.shape[1], t.shape[2]);
                assert_eq!(rows2, 2 * im);
                for (part, off) in [("gate_proj", 0), ("up_proj", im)] {
                    let module = mlx_name(&format!("{layer}.mlp.switch_mlp.{part}"));
                    for x in 0..e {
                        let start = (x * rows2 + off) * cols;
                        check(&module, &w[start..start + im * cols], im, cols, x * im, 4);
                    }
                    modules.insert(module);
                }
            } else if let Some(layer) = name.strip_suffix(".mlp.experts.down_proj") {
                let (e, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
                let module = mlx_name(&format!("{layer}.mlp.switch_mlp.down_proj"));
                for x in 0..e {
                    check(&module, &w[x * rows * cols..(x + 1) * rows * cols], rows, cols, x * rows, 4);
                }
                modules.insert(module);
            } else if t.shape.len() == 2 {
                let module = mlx_name(name.strip_suffix(".weight").expect("linear weights end in .weight"));
                let bits = if module.ends_with(".mlp.gate") || module.ends_with(".mlp.shared_expert_gate") { 8 } else { 4 };
                check(&module, &w, t.shape[0], t.shape[1], 0, bits);
                modules.insert(module);
            }
        }
        let expected: std::collections::BTreeSet<String> = want.names().filter_map(|n| n.strip_suffix(".scales")).map(str::to_string).collect();
        assert_eq!(modules, expected, "every quantised module of the expected file is checked");
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(quantize(&[0.0; 64], 1, 64, 3, 64).is_err());
        assert!(quantize(&[0.0; 63], 1, 64, 4, 64).is_err());
        assert!(quantize(&[0.0; 96], 1, 96, 4, 64).is_err());
    }
}
