//! MLX affine quantisation (group 64; 4 and 8 bit).
//!
//! Layout: for a row of `cols` weights, codes are packed little-end first
//! into u32 words (`32 / bits` codes per word, code `j` at bit `(j % per) *
//! bits`), and every group of `group` consecutive weights has one scale and
//! one bias: `w = scale * q + bias`.
//!
//! Choice of scale and bias follows MLX's GPU `affine_quantize` kernel (the
//! one mlx-lm's conversion runs): in f32, `scale = max((max - min) / n_bins,
//! 1e-7)`; the edge with the larger magnitude is pinned to an exact code so
//! that it is represented without error; scale and bias are then stored in
//! the checkpoint's half type, while the codes are computed from the f32
//! values.

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
    let mut w_min = f32::INFINITY;
    let mut w_max = f32::NEG_INFINITY;
    for &w in group {
        w_min = w_min.min(w);
        w_max = w_max.max(w);
    }
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(eps);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    GroupParams { scale, bias }
}

/// Quantised code of one weight given its group's parameters.
#[inline]
pub fn quantize_value(w: f32, p: GroupParams, bits: u32) -> u32 {
    let n_bins = ((1u32 << bits) - 1) as f32;
    ((w - p.bias) / p.scale).round().clamp(0.0, n_bins) as u32
}

/// Quantises a row-major matrix `[rows, cols]`; returns packed codes
/// `[rows, cols * bits / 32]` and f32 scales and biases `[rows, cols / group]`.
/// The caller rounds scales and biases to the storage type.
pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32, group: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    assert!(bits == 4 || bits == 8, "bits must be 4 or 8");
    assert_eq!(w.len(), rows * cols, "matrix size");
    assert_eq!(cols % group, 0, "cols must be a multiple of the group size");
    let per_word = (32 / bits) as usize;
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
    (packed, scales, biases)
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
