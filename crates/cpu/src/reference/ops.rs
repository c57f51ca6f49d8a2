//! Elementwise and small vector operations of the reference, in plain f32.
//!
//! Each function is the formula from docs/design.md §2 written as directly as
//! possible, on slices, so GPU kernel tests can call them one op at a time.
//! Nothing here is tuned for speed.

use lily_core::weights::Linear;

/// `out = x * rsqrt(mean(x^2) + eps) * gain` (the gain already resolved from
/// the checkpoint's convention). The mean is accumulated in f64 so the
/// reference is not itself a source of rounding noise.
pub fn rms_norm(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), gain.len(), "rms_norm: gain length");
    debug_assert_eq!(x.len(), out.len(), "rms_norm: output length");
    let mean_sq = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (mean_sq + eps as f64).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(gain) {
        *o = (v as f64 * inv) as f32 * w;
    }
}

/// RMSNorm returning a new vector.
pub fn rms_norm_vec(x: &[f32], gain: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    rms_norm(x, gain, eps, &mut out);
    out
}

/// `x * rsqrt(sum(x^2) + eps)` in place (the DeltaNet q/k normalisation).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum_sq = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
    let inv = 1.0 / (sum_sq + eps as f64).sqrt();
    for v in x.iter_mut() {
        *v = (*v as f64 * inv) as f32;
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + exp(x))`, linear above 20 like torch's default threshold.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    for v in x.iter_mut() {
        *v = (*v as f64 / sum) as f32;
    }
}

/// `y = W x` for one expert of `lin`, one dequantised row at a time (the
/// core crate's plain row accessor), each dot product summed in f64.
pub fn linear(lin: &Linear, expert: usize, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(x.len(), lin.cols(), "linear: input length");
    let mut row = vec![0f32; lin.cols()];
    (0..lin.rows())
        .map(|r| {
            lin.row_f32(expert, r, &mut row);
            row.iter().zip(x).map(|(&w, &v)| w as f64 * v as f64).sum::<f64>() as f32
        })
        .collect()
}

/// Rotary inverse frequencies for the rotated part of a head:
/// `theta^(-2j / rotary_dim)` for `j < rotary_dim / 2`, rounded to f32 like
/// transformers' f32 buffer.
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f32> {
    (0..rotary_dim / 2).map(|j| (1.0 / theta.powf(2.0 * j as f64 / rotary_dim as f64)) as f32).collect()
}

/// NeoX RoPE on the first `2 * inv_freq.len()` dims of one head: pairs
/// `(j, j + half)` rotate by `pos * inv_freq[j]`; the other dims pass
/// through. The angle is formed in f32 as transformers does (its cos/sin
/// come from an f32 product of position and inverse frequency).
pub fn rope(head: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    debug_assert!(2 * half <= head.len(), "rope: rotary dims exceed the head");
    for j in 0..half {
        let angle = (pos as f32 * inv_freq[j]) as f64;
        let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
        let a = head[j];
        let b = head[j + half];
        head[j] = a * cos - b * sin;
        head[j + half] = b * cos + a * sin;
    }
}
