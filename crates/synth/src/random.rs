//! Deterministic random values for a synthetic checkpoint.
//!
//! Each logical parameter has its own ChaCha8 stream, keyed by the seed and
//! the parameter's layout-free key; element `i` of a parameter (row-major
//! over `[experts * rows, cols]`) always takes the two 32-bit words at
//! stream position `2 i`. Any block of rows can therefore be generated on
//! its own, in any order, on any thread, with identical results, and the
//! HF and MLX layouts of one seed hold the same values.
//!
//! Distributions (z is approximately standard normal: the sum of four
//! 16-bit uniforms, centred and scaled to unit variance, so |z| <= 3.46;
//! L is the number of layers):
//!
//! | parameter | value |
//! |---|---|
//! | `embed_tokens` | z |
//! | linear maps into the residual stream (`out_proj`, `o_proj`, expert and shared `down_proj`) | z / sqrt(fan_in) / sqrt(2 L) |
//! | every other linear (projections, experts, router, shared-expert gate, `lm_head`) | z / sqrt(fan_in) |
//! | one-centred RMSNorm gains (input, post-attention, final, q/k norm) | 1 + bf16(0.02 z) (HF stores the bf16 part) |
//! | DeltaNet gated-norm gain | 1 + 0.02 z |
//! | `conv1d` taps | z / sqrt(kernel) |
//! | `A_log` (f32) | ln(U(1, 16)) |
//! | `dt_bias` | 0.1 z |
//!
//! Linear weights are rounded to bf16 before the MLX quantiser sees them,
//! exactly as a conversion from the BF16 release would.
//!
//! Why these keep activations finite through every layer: each mixer and
//! MoE reads an RMS-normalised input with gains near 1, so its projections
//! produce values of order 1; q and k are normalised again (L2 in DeltaNet,
//! q/k norm in attention) so attention scores and the delta rule stay
//! bounded; `-exp(A_log) * softplus(.)` lies in [-16 softplus, 0], so the
//! state decays; and the residual branches are scaled by 1/sqrt(2 L), so
//! after 2 L additions the residual stream has grown to about sqrt(1 + 1/4)
//! of the unit-variance embedding rather than by a factor of L.

use lily_core::weights::Role;
use lily_core::{Error, Result};
use rand::RngCore;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::layout::{LinearParam, Source, VectorParam};

/// The synthetic source of one seed and model depth.
pub struct RandomSource {
    pub seed: u64,
    pub num_layers: usize,
    pub conv_kernel: usize,
}

/// FNV-1a over `bytes` from the given offset basis.
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    let mut h = basis;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The ChaCha key of parameter `key` under `seed`. Written out by hand
/// (not `std::hash`) so that it can never change between Rust versions.
fn stream_key(seed: u64, key: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[0..8].copy_from_slice(&seed.to_le_bytes());
    out[8..16].copy_from_slice(&fnv1a(key.as_bytes(), 0xcbf2_9ce4_8422_2325).to_le_bytes());
    out[16..24].copy_from_slice(&fnv1a(key.as_bytes(), 0x6c62_272e_07bb_0142).to_le_bytes());
    out[24..32].copy_from_slice(&(key.len() as u64).to_le_bytes());
    out
}

/// The stream of `key`, positioned at element `first`.
fn stream(seed: u64, key: &str, first: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::from_seed(stream_key(seed, key));
    rng.set_word_pos(2 * first as u128);
    rng
}

const SQRT3: f32 = 1.732_050_8;

/// Approximately standard normal from 64 random bits (Irwin-Hall, n = 4).
#[inline]
fn normal(u: u64) -> f32 {
    let s = (u & 0xffff) + ((u >> 16) & 0xffff) + ((u >> 32) & 0xffff) + (u >> 48);
    // Each 16-bit part has mean 32767.5 and variance (65536^2 - 1) / 12.
    (s as f32 - 131_070.0) * (SQRT3 / 65_536.0)
}

/// Uniform in (0, 1) from the top 24 bits.
#[inline]
fn uniform(u: u64) -> f32 {
    ((u >> 40) as f32 + 0.5) / 16_777_216.0
}

#[inline]
fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

impl RandomSource {
    /// Standard deviation of a linear's weights (see the module table).
    fn linear_std(&self, p: &LinearParam) -> f32 {
        if p.key == "embed_tokens" {
            return 1.0;
        }
        let base = 1.0 / (p.cols as f32).sqrt();
        let into_residual = p.key.ends_with("linear_attn.out_proj") || p.key.ends_with("self_attn.o_proj") || p.key.ends_with("down_proj");
        if into_residual {
            base / (2.0 * self.num_layers as f32).sqrt()
        } else {
            base
        }
    }
}

impl Source for RandomSource {
    fn linear_rows(&self, p: &LinearParam, row0: usize, out: &mut [f32]) -> Result<()> {
        if !out.len().is_multiple_of(p.cols) || row0 + out.len() / p.cols > p.experts * p.rows {
            return Err(Error::Other(format!("rows {row0}.. of `{}` are out of range", p.key)));
        }
        let std = self.linear_std(p);
        let mut rng = stream(self.seed, &p.key, row0 * p.cols);
        for x in out.iter_mut() {
            *x = round_bf16(std * normal(rng.next_u64()));
        }
        Ok(())
    }

    fn vector(&self, p: &VectorParam) -> Result<Vec<f32>> {
        let mut rng = stream(self.seed, &p.key, 0);
        let mut next = || rng.next_u64();
        let v: Vec<f32> = match p.role {
            Role::NormOneCentered => (0..p.len).map(|_| 1.0 + round_bf16(0.02 * normal(next()))).collect(),
            Role::NormPlain => (0..p.len).map(|_| 1.0 + 0.02 * normal(next())).collect(),
            Role::ConvWeight => {
                let s = 1.0 / (self.conv_kernel as f32).sqrt();
                (0..p.len).map(|_| s * normal(next())).collect()
            }
            Role::ALog => (0..p.len).map(|_| (1.0 + 15.0 * uniform(next())).ln()).collect(),
            Role::DtBias => (0..p.len).map(|_| 0.1 * normal(next())).collect(),
            Role::Linear { .. } => {
                return Err(Error::Other(format!("`{}` is a linear, not a vector", p.key)));
            }
        };
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lin(key: &str, rows: usize, cols: usize) -> LinearParam {
        LinearParam { key: key.into(), experts: 1, rows, cols }
    }

    #[test]
    fn approximate_normal_has_unit_moments() {
        let mut rng = ChaCha8Rng::from_seed([7; 32]);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| normal(rng.next_u64()) as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
        assert!(xs.iter().all(|x| x.abs() <= 3.47));
    }

    #[test]
    fn any_block_of_rows_matches_the_whole() {
        let src = RandomSource { seed: 3, num_layers: 8, conv_kernel: 4 };
        let p = lin("layers.0.mlp.gate", 10, 64);
        let mut whole = vec![0f32; 10 * 64];
        src.linear_rows(&p, 0, &mut whole).expect("whole");
        let mut part = vec![0f32; 3 * 64];
        src.linear_rows(&p, 5, &mut part).expect("part");
        assert_eq!(&whole[5 * 64..8 * 64], &part[..]);
        let other = RandomSource { seed: 4, ..src };
        let mut diff = vec![0f32; 10 * 64];
        other.linear_rows(&p, 0, &mut diff).expect("other seed");
        assert_ne!(whole, diff);
        let mut other_key = vec![0f32; 10 * 64];
        src.linear_rows(&lin("layers.1.mlp.gate", 10, 64), 0, &mut other_key).expect("other key");
        assert_ne!(whole, other_key);
    }

    #[test]
    fn scales_follow_the_table() {
        let src = RandomSource { seed: 1, num_layers: 40, conv_kernel: 4 };
        let rms = |p: &LinearParam| {
            let mut v = vec![0f32; p.rows * p.cols];
            src.linear_rows(p, 0, &mut v).expect("rows");
            (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
        };
        let q = rms(&lin("layers.3.self_attn.q_proj", 256, 2048));
        assert!((q * 2048f64.sqrt() - 1.0).abs() < 0.02, "q_proj rms {q}");
        let o = rms(&lin("layers.3.self_attn.o_proj", 256, 4096));
        assert!((o * 4096f64.sqrt() * 80f64.sqrt() - 1.0).abs() < 0.02, "o_proj rms {o}");
        let a = src.vector(&VectorParam { key: "layers.0.linear_attn.A_log".into(), role: Role::ALog, len: 1000 }).expect("A_log");
        assert!(a.iter().all(|x| *x > 0.0 && *x < 16f32.ln()));
    }
}
