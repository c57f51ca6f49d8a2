//! Gated DeltaNet mixer of the reference (docs/design.md §2.3).
//!
//! The layer is split the way the GPU kernels will be: projections, the
//! causal conv step, the per-head preparation (L2 norm, q scale, beta, decay),
//! the delta rule itself, and the gated RMSNorm. The delta rule exists twice:
//! as the plain per-token recurrence and in the chunked form (chunks of 64,
//! a unit-lower-triangular solve inside a chunk, a scan across chunks). The
//! two must agree; tests hold them to it.

use lily_core::weights::DeltaNetWeights;
use lily_core::ModelConfig;

use super::ops::{l2_normalize, linear, sigmoid, silu, softplus};

/// Which form of the delta rule a prefill uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaRule {
    /// Chunks of `CHUNK` tokens: the form GPU prefill kernels use.
    Chunked,
    /// One token at a time: the definition.
    Recurrent,
}

/// Chunk length of the chunked delta rule.
pub const CHUNK: usize = 64;

/// Head counts and sizes of the delta rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl DeltaDims {
    pub fn of(cfg: &ModelConfig) -> Self {
        DeltaDims {
            key_heads: cfg.linear_num_key_heads,
            value_heads: cfg.linear_num_value_heads,
            key_dim: cfg.linear_key_head_dim,
            value_dim: cfg.linear_value_head_dim,
        }
    }
    /// The key head that value head `h` reads: consecutive value heads share
    /// one key head (transformers' `repeat_interleave` on q and k).
    pub fn key_head(&self, h: usize) -> usize {
        h / (self.value_heads / self.key_heads)
    }
    pub fn state_len(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim
    }
}

/// Inputs of the delta rule for `tokens` consecutive tokens of one sequence.
#[derive(Clone, Debug)]
pub struct DeltaInputs {
    pub tokens: usize,
    /// `[tokens][key heads][key dim]`, L2-normalised and scaled by 1/sqrt(dk).
    pub q: Vec<f32>,
    /// `[tokens][key heads][key dim]`, L2-normalised.
    pub k: Vec<f32>,
    /// `[tokens][value heads][value dim]`.
    pub v: Vec<f32>,
    /// Log decay `g <= 0`, `[tokens][value heads]`.
    pub g: Vec<f32>,
    /// Write strength `beta` in (0, 1), `[tokens][value heads]`.
    pub beta: Vec<f32>,
}

/// One step of the depthwise causal conv (kernel K) followed by SiLU.
/// `window` holds the previous K-1 raw inputs `[K-1][channels]`, oldest first;
/// `taps` is `[channels][K]`, oldest input first. The window shifts by one.
pub fn conv_step(window: &mut [f32], taps: &[f32], kernel: usize, raw: &[f32]) -> Vec<f32> {
    let channels = raw.len();
    debug_assert_eq!(window.len(), (kernel - 1) * channels);
    debug_assert_eq!(taps.len(), kernel * channels);
    let mut out = vec![0f32; channels];
    for c in 0..channels {
        let mut acc = 0f64;
        for i in 0..kernel - 1 {
            acc += taps[c * kernel + i] as f64 * window[i * channels + c] as f64;
        }
        acc += taps[c * kernel + kernel - 1] as f64 * raw[c] as f64;
        out[c] = silu(acc as f32);
    }
    window.copy_within(channels.., 0);
    window[(kernel - 2) * channels..].copy_from_slice(raw);
    out
}

/// Turns conv outputs and the a/b projections of one token into delta-rule
/// inputs (appended to `inputs`).
pub fn prepare_token(dims: &DeltaDims, w: &DeltaNetWeights, conv_out: &[f32], a: &[f32], b: &[f32], inputs: &mut DeltaInputs) {
    prepare_token_with(dims, &w.a_log, &w.dt_bias, conv_out, a, b, inputs);
}

/// [`prepare_token`] given only the two gate parameters it reads (`A_log`
/// and `dt_bias`, one per value head), for callers such as kernel tests that
/// hold no full weight set.
pub fn prepare_token_with(dims: &DeltaDims, a_log: &[f32], dt_bias: &[f32], conv_out: &[f32], a: &[f32], b: &[f32], inputs: &mut DeltaInputs) {
    let kd = dims.key_heads * dims.key_dim;
    let (q, rest) = conv_out.split_at(kd);
    let (k, v) = rest.split_at(kd);
    let scale = 1.0 / (dims.key_dim as f32).sqrt();
    for h in 0..dims.key_heads {
        let mut qh = q[h * dims.key_dim..(h + 1) * dims.key_dim].to_vec();
        let mut kh = k[h * dims.key_dim..(h + 1) * dims.key_dim].to_vec();
        l2_normalize(&mut qh, 1e-6);
        l2_normalize(&mut kh, 1e-6);
        inputs.q.extend(qh.iter().map(|x| x * scale));
        inputs.k.extend(kh);
    }
    inputs.v.extend_from_slice(v);
    for h in 0..dims.value_heads {
        inputs.beta.push(sigmoid(b[h]));
        inputs.g.push(-a_log[h].exp() * softplus(a[h] + dt_bias[h]));
    }
    inputs.tokens += 1;
}

/// The delta rule one token at a time. `state` is `[value heads][dk][dv]`
/// and is updated; returns `o` as `[tokens][value heads][dv]`.
pub fn delta_rule_recurrent(dims: &DeltaDims, state: &mut [f32], x: &DeltaInputs) -> Vec<f32> {
    let (dk, dv, hk, hv) = (dims.key_dim, dims.value_dim, dims.key_heads, dims.value_heads);
    let mut out = vec![0f32; x.tokens * hv * dv];
    for t in 0..x.tokens {
        for h in 0..hv {
            let kh = dims.key_head(h);
            let q = &x.q[(t * hk + kh) * dk..][..dk];
            let k = &x.k[(t * hk + kh) * dk..][..dk];
            let v = &x.v[(t * hv + h) * dv..][..dv];
            let decay = x.g[t * hv + h].exp();
            let beta = x.beta[t * hv + h];
            let s = &mut state[h * dk * dv..][..dk * dv];
            // S = exp(g) S
            for e in s.iter_mut() {
                *e *= decay;
            }
            // u = beta (v - S^T k)
            let mut u = vec![0f32; dv];
            for d in 0..dv {
                let kv: f64 = (0..dk).map(|i| s[i * dv + d] as f64 * k[i] as f64).sum();
                u[d] = beta * (v[d] - kv as f32);
            }
            // S += k u^T
            for i in 0..dk {
                for d in 0..dv {
                    s[i * dv + d] += k[i] * u[d];
                }
            }
            // o = S^T q
            let o = &mut out[(t * hv + h) * dv..][..dv];
            for d in 0..dv {
                o[d] = (0..dk).map(|i| s[i * dv + d] as f64 * q[i] as f64).sum::<f64>() as f32;
            }
        }
    }
    out
}

/// The delta rule in chunks of `chunk` tokens; same contract as
/// [`delta_rule_recurrent`].
///
/// Within a chunk starting from state S0, with cumulative log decay
/// `c_i = g_0 + ... + g_i`, unrolling the recurrence gives
///   `u_i = beta_i (v_i - e^{c_i} S0^T k_i) - sum_{j<i} A_ij u_j`,
///   `A_ij = beta_i e^{c_i - c_j} (k_i . k_j)`,
/// a unit-lower-triangular system solved by forward substitution; then
///   `o_i = e^{c_i} S0^T q_i + sum_{j<=i} e^{c_i - c_j} (q_i . k_j) u_j`,
///   `S  = e^{c_last} S0 + sum_j e^{c_last - c_j} k_j u_j^T`.
pub fn delta_rule_chunked(dims: &DeltaDims, state: &mut [f32], x: &DeltaInputs, chunk: usize) -> Vec<f32> {
    let (dk, dv, hk, hv) = (dims.key_dim, dims.value_dim, dims.key_heads, dims.value_heads);
    let mut out = vec![0f32; x.tokens * hv * dv];
    let chunk = chunk.max(1);
    for h in 0..hv {
        let kh = dims.key_head(h);
        let q_at = |t: usize| &x.q[(t * hk + kh) * dk..][..dk];
        let k_at = |t: usize| &x.k[(t * hk + kh) * dk..][..dk];
        let v_at = |t: usize| &x.v[(t * hv + h) * dv..][..dv];
        let s = &mut state[h * dk * dv..][..dk * dv];
        let mut start = 0;
        while start < x.tokens {
            let len = chunk.min(x.tokens - start);
            let cum: Vec<f64> = (0..len)
                .scan(0f64, |acc, i| {
                    *acc += x.g[(start + i) * hv + h] as f64;
                    Some(*acc)
                })
                .collect();
            let beta = |i: usize| x.beta[(start + i) * hv + h] as f64;
            // S0^T y for a key-space vector y.
            let read = |s: &[f32], y: &[f32]| -> Vec<f64> { (0..dv).map(|d| (0..dk).map(|i| s[i * dv + d] as f64 * y[i] as f64).sum()).collect() };
            let dot = |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum() };

            // Forward substitution for u (len x dv).
            let mut u = vec![vec![0f64; dv]; len];
            for i in 0..len {
                let sk = read(s, k_at(start + i));
                let decay_i = cum[i].exp();
                let mut ui: Vec<f64> = (0..dv).map(|d| beta(i) * (v_at(start + i)[d] as f64 - decay_i * sk[d])).collect();
                for j in 0..i {
                    let a_ij = beta(i) * (cum[i] - cum[j]).exp() * dot(k_at(start + i), k_at(start + j));
                    for d in 0..dv {
                        ui[d] -= a_ij * u[j][d];
                    }
                }
                u[i] = ui;
            }
            // Outputs: the decayed read of S0 plus the causal intra-chunk part.
            for i in 0..len {
                let sq = read(s, q_at(start + i));
                let decay_i = cum[i].exp();
                let o = &mut out[((start + i) * hv + h) * dv..][..dv];
                let mut oi: Vec<f64> = sq.iter().map(|v| decay_i * v).collect();
                for j in 0..=i {
                    let w = (cum[i] - cum[j]).exp() * dot(q_at(start + i), k_at(start + j));
                    for d in 0..dv {
                        oi[d] += w * u[j][d];
                    }
                }
                for d in 0..dv {
                    o[d] = oi[d] as f32;
                }
            }
            // State at the end of the chunk.
            let last = cum[len - 1];
            for ki in 0..dk {
                for d in 0..dv {
                    let mut val = last.exp() * s[ki * dv + d] as f64;
                    for j in 0..len {
                        val += (last - cum[j]).exp() * k_at(start + j)[ki] as f64 * u[j][d];
                    }
                    s[ki * dv + d] = val as f32;
                }
            }
            start += len;
        }
    }
    out
}

/// Gated RMSNorm of one value head: `w * norm(o) * silu(z)`.
pub fn gated_norm(o: &[f32], z: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mean_sq = o.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / o.len() as f64;
    let inv = 1.0 / (mean_sq + eps as f64).sqrt();
    o.iter().zip(z).zip(w).map(|((&ov, &zv), &wv)| wv * (ov as f64 * inv) as f32 * silu(zv)).collect()
}

/// The whole mixer for consecutive tokens of one sequence. `xs` are the
/// normed layer inputs; `conv` and `recurrent` are the layer's state.
pub fn deltanet_layer(cfg: &ModelConfig, w: &DeltaNetWeights, conv: &mut [f32], recurrent: &mut [f32], xs: &[Vec<f32>], rule: DeltaRule) -> Vec<Vec<f32>> {
    let dims = DeltaDims::of(cfg);
    let mut inputs = DeltaInputs { tokens: 0, q: vec![], k: vec![], v: vec![], g: vec![], beta: vec![] };
    let mut zs = Vec::with_capacity(xs.len());
    for x in xs {
        let raw = linear(&w.in_qkv, 0, x);
        let conv_out = conv_step(conv, &w.conv, cfg.conv_kernel, &raw);
        let a = linear(&w.in_a, 0, x);
        let b = linear(&w.in_b, 0, x);
        prepare_token(&dims, w, &conv_out, &a, &b, &mut inputs);
        zs.push(linear(&w.in_z, 0, x));
    }
    let o = match rule {
        DeltaRule::Recurrent => delta_rule_recurrent(&dims, recurrent, &inputs),
        DeltaRule::Chunked => delta_rule_chunked(&dims, recurrent, &inputs, CHUNK),
    };
    let dv = dims.value_dim;
    let width = dims.value_heads * dv;
    zs.iter()
        .enumerate()
        .map(|(t, z)| {
            let mut normed = Vec::with_capacity(width);
            for h in 0..dims.value_heads {
                let r = h * dv..(h + 1) * dv;
                normed.extend(gated_norm(&o[t * width..][r.clone()], &z[r], &w.norm, cfg.rms_norm_eps));
            }
            linear(&w.out, 0, &normed)
        })
        .collect()
}
