//! The fast CPU forward: the default for serving on a machine without a GPU.
//!
//! Same math as the reference (docs/design.md §2) with a different shape of work:
//! all tokens of a call (a prefill chunk, or one token of each sequence in a
//! decode batch) go through every linear map together, so each weight row is
//! read once per call; the products run on the packed codes (`matmul`), split
//! over rayon threads; only the chosen top-k experts are computed, each
//! expert once for all the tokens routed to it; the DeltaNet recurrence runs
//! one value head per task with its state kept hot in cache. Accumulation is
//! f32 throughout, so results match the reference to rounding, not bits.
//! Tests hold this path to the reference on a synthetic model.

pub mod matmul;

use std::sync::Arc;

use lily_core::weights::{is_ignored_tensor, AttentionWeights, DeltaNetWeights, Mixer, Weights};
use lily_model::{LogitsWanted, ModelError, ModelResult};
use rayon::prelude::*;

use crate::state::{LayerState, SeqState};
use matmul::{matmul_many, Mat, Product};

/// One sequence's share of a forward call: its state and the tokens it appends.
pub struct Span<'a> {
    pub state: &'a mut SeqState,
    pub tokens: &'a [u32],
    pub wanted: LogitsWanted,
}

struct DeltaFast {
    qkv: Mat,
    z: Mat,
    a: Mat,
    b: Mat,
    out: Mat,
    /// Conv taps transposed to `[kernel][channels]` so each tap is a
    /// contiguous vector over channels.
    taps: Vec<f32>,
    /// `exp(A_log)` per value head.
    decay_rate: Vec<f32>,
}

struct AttnFast {
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
}

// Built once per layer and never moved afterwards: boxing would only add
// an indirection.
#[allow(clippy::large_enum_variant)]
enum MixerFast {
    DeltaNet(DeltaFast),
    Attention(AttnFast),
}

struct MoeFast {
    router: Mat,
    gate: Mat,
    up: Mat,
    down: Mat,
    shared_gate: Mat,
    shared_up: Mat,
    shared_down: Mat,
    shared_expert_gate: Mat,
}

struct LayerFast {
    mixer: MixerFast,
    moe: MoeFast,
}

/// The model prepared for the fast kernels. Holds the weight tree (mapped
/// file) and views of every linear map.
pub struct FastModel {
    weights: Arc<Weights>,
    embed: Mat,
    lm_head: Mat,
    layers: Vec<LayerFast>,
    inv_freq: Vec<f32>,
}

fn mat(lin: &lily_core::weights::Linear) -> ModelResult<Mat> {
    Mat::new(lin).map_err(ModelError::Invalid)
}

impl FastModel {
    pub fn new(weights: Arc<Weights>) -> ModelResult<Self> {
        let cfg = &weights.config;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for lw in &weights.layers {
            let mixer = match &lw.mixer {
                Mixer::DeltaNet(w) => {
                    let (channels, kernel) = (cfg.linear_conv_dim(), cfg.conv_kernel);
                    let mut taps = vec![0f32; channels * kernel];
                    for c in 0..channels {
                        for i in 0..kernel {
                            taps[i * channels + c] = w.conv[c * kernel + i];
                        }
                    }
                    MixerFast::DeltaNet(DeltaFast {
                        qkv: mat(&w.in_qkv)?,
                        z: mat(&w.in_z)?,
                        a: mat(&w.in_a)?,
                        b: mat(&w.in_b)?,
                        out: mat(&w.out)?,
                        taps,
                        decay_rate: w.a_log.iter().map(|a| a.exp()).collect(),
                    })
                }
                Mixer::Attention(w) => MixerFast::Attention(AttnFast { q: mat(&w.q)?, k: mat(&w.k)?, v: mat(&w.v)?, o: mat(&w.o)? }),
            };
            let m = &lw.moe;
            let moe = MoeFast {
                router: mat(&m.router)?,
                gate: mat(&m.gate)?,
                up: mat(&m.up)?,
                down: mat(&m.down)?,
                shared_gate: mat(&m.shared_gate)?,
                shared_up: mat(&m.shared_up)?,
                shared_down: mat(&m.shared_down)?,
                shared_expert_gate: mat(&m.shared_expert_gate)?,
            };
            layers.push(LayerFast { mixer, moe });
        }
        let rotary = cfg.rotary_dim();
        let inv_freq = (0..rotary / 2).map(|j| (1.0 / cfg.rope_theta.powf(2.0 * j as f64 / rotary as f64)) as f32).collect();
        Ok(FastModel { embed: mat(&weights.embed)?, lm_head: mat(&weights.lm_head)?, layers, inv_freq, weights })
    }

    pub fn weights(&self) -> &Arc<Weights> {
        &self.weights
    }

    /// Touches every page of the mapped checkpoint once, in parallel, so
    /// the first tokens do not pay a page fault per 64 KB of experts they
    /// happen to route to. Returns the bytes covered. Optional: a server
    /// that has run for a while has faulted everything in anyway.
    pub fn prefault(&self) -> usize {
        let store = &self.weights.store;
        // Only what the model reads: the vision tower and an MTP head stay
        // on disk.
        let names: Vec<&str> = store.names().filter(|n| !is_ignored_tensor(n)).collect();
        names
            .par_iter()
            .map(|name| match store.peek(name) {
                Some(t) => {
                    let bytes = t.bytes();
                    let mut acc = 0u8;
                    for page in bytes.chunks(4096) {
                        acc ^= page[0];
                    }
                    std::hint::black_box(acc);
                    bytes.len()
                }
                None => 0,
            })
            .sum()
    }

    /// Runs the tokens of every span through the model, appending them to
    /// the spans' states; returns, per span, the logits of its wanted
    /// positions. Token ids must be valid (the backend checks).
    pub fn forward(&self, spans: &mut [Span<'_>]) -> ModelResult<Vec<Vec<Vec<f32>>>> {
        let cfg = &self.weights.config;
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let tokens: Vec<u32> = spans.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let n = tokens.len();
        let mut x = vec![0f32; n * h];
        x.par_chunks_mut(h).zip(tokens.par_iter()).for_each(|(row, &t)| self.embed.row_f32(0, t as usize, row));

        for (li, (layer, lw)) in self.layers.iter().zip(&self.weights.layers).enumerate() {
            let xn = rms_norm_rows(&x, &lw.input_norm, eps);
            let mixed = match (&layer.mixer, &lw.mixer) {
                (MixerFast::DeltaNet(m), Mixer::DeltaNet(w)) => self.deltanet(li, m, w, &xn, n, spans)?,
                (MixerFast::Attention(m), Mixer::Attention(w)) => self.attention(li, m, w, &xn, n, spans)?,
                _ => return Err(ModelError::Invalid(format!("layer {li}: prepared mixer does not match the weights"))),
            };
            add(&mut x, &mixed);
            let xn = rms_norm_rows(&x, &lw.post_norm, eps);
            let y = self.moe(&layer.moe, &xn, n);
            add(&mut x, &y);
        }

        // Final norm and lm_head for the wanted rows only.
        let mut picked = Vec::new();
        let mut counts = Vec::with_capacity(spans.len());
        let mut row0 = 0;
        for span in spans.iter_mut() {
            let t = span.tokens.len();
            let rows = match span.wanted {
                LogitsWanted::All => row0..row0 + t,
                LogitsWanted::Last => (row0 + t).saturating_sub(1).max(row0)..row0 + t,
            };
            counts.push(rows.len());
            picked.extend_from_slice(&x[rows.start * h..rows.end * h]);
            span.state.len += t;
            row0 += t;
        }
        let m = picked.len() / h;
        let xn = rms_norm_rows(&picked, &self.weights.final_norm, eps);
        let vocab = self.lm_head.rows;
        let mut logits = vec![0f32; m * vocab];
        self.lm_head.matmul(0, &xn, m, &mut logits);
        let mut rows = logits.chunks_exact(vocab).map(|r| r.to_vec());
        Ok(counts.into_iter().map(|c| rows.by_ref().take(c).collect()).collect())
    }

    fn deltanet(&self, li: usize, m: &DeltaFast, w: &DeltaNetWeights, xn: &[f32], n: usize, spans: &mut [Span<'_>]) -> ModelResult<Vec<f32>> {
        let cfg = &self.weights.config;
        let (hk, hv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        let (c, kd, vd, kernel) = (cfg.linear_conv_dim(), hk * dk, hv * dv, cfg.conv_kernel);
        let mut qkv = vec![0f32; n * c];
        let mut z = vec![0f32; n * vd];
        let mut a = vec![0f32; n * hv];
        let mut b = vec![0f32; n * hv];
        matmul_many(vec![
            Product { mat: &m.qkv, expert: 0, x: xn, n, y: &mut qkv },
            Product { mat: &m.z, expert: 0, x: xn, n, y: &mut z },
            Product { mat: &m.a, expert: 0, x: xn, n, y: &mut a },
            Product { mat: &m.b, expert: 0, x: xn, n, y: &mut b },
        ]);

        let mut o = vec![0f32; n * vd];
        let mut row0 = 0;
        for span in spans.iter_mut() {
            let t_len = span.tokens.len();
            let Some(LayerState::DeltaNet { conv, recurrent }) = span.state.layers.get_mut(li) else {
                return Err(ModelError::Invalid(format!("layer {li}: sequence state is not a DeltaNet state")));
            };
            let rows = &mut qkv[row0 * c..(row0 + t_len) * c];
            conv_silu(conv, &m.taps, kernel, rows, c);

            // q, k: L2-normalised per head (q also scaled by 1/sqrt(dk)).
            let mut qn = vec![0f32; t_len * kd];
            let mut kn = vec![0f32; t_len * kd];
            let scale = 1.0 / (dk as f32).sqrt();
            for t in 0..t_len {
                let row = &rows[t * c..(t + 1) * c];
                l2_norm_heads(&row[..kd], dk, scale, &mut qn[t * kd..(t + 1) * kd]);
                l2_norm_heads(&row[kd..2 * kd], dk, 1.0, &mut kn[t * kd..(t + 1) * kd]);
            }
            let mut g = vec![0f32; t_len * hv];
            let mut beta = vec![0f32; t_len * hv];
            for t in 0..t_len {
                for hh in 0..hv {
                    let i = (row0 + t) * hv + hh;
                    beta[t * hv + hh] = sigmoid(b[i]);
                    g[t * hv + hh] = -m.decay_rate[hh] * softplus(a[i] + w.dt_bias[hh]);
                }
            }

            // The recurrence, one value head per task; output [heads][T][dv].
            let ratio = hv / hk;
            let rows: &[f32] = rows;
            let mut head_out = vec![0f32; hv * t_len * dv];
            recurrent.par_chunks_mut(dk * dv).zip(head_out.par_chunks_mut(t_len * dv)).enumerate().for_each(|(hh, (s, oh))| {
                let kh = hh / ratio;
                let mut kv = vec![0f32; dv];
                let mut u = vec![0f32; dv];
                for t in 0..t_len {
                    let k = &kn[t * kd + kh * dk..][..dk];
                    let q = &qn[t * kd + kh * dk..][..dk];
                    let v = &rows[t * c + 2 * kd + hh * dv..][..dv];
                    let decay = g[t * hv + hh].exp();
                    let bt = beta[t * hv + hh];
                    kv.fill(0.0);
                    for (srow, &ki) in s.chunks_exact_mut(dv).zip(k) {
                        for (sv, kvv) in srow.iter_mut().zip(kv.iter_mut()) {
                            *sv *= decay;
                            *kvv += *sv * ki;
                        }
                    }
                    for d in 0..dv {
                        u[d] = bt * (v[d] - kv[d]);
                    }
                    let out = &mut oh[t * dv..(t + 1) * dv];
                    out.fill(0.0);
                    for ((srow, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
                        for ((sv, &ud), od) in srow.iter_mut().zip(&u).zip(out.iter_mut()) {
                            *sv += ki * ud;
                            *od += *sv * qi;
                        }
                    }
                }
            });

            // Gated RMSNorm per (token, head) into o.
            for t in 0..t_len {
                for hh in 0..hv {
                    let src = &head_out[(hh * t_len + t) * dv..][..dv];
                    let zr = &z[(row0 + t) * vd + hh * dv..][..dv];
                    let dst = &mut o[(row0 + t) * vd + hh * dv..][..dv];
                    let ms = src.iter().map(|v| v * v).sum::<f32>() / dv as f32;
                    let inv = 1.0 / (ms + cfg.rms_norm_eps).sqrt();
                    for d in 0..dv {
                        dst[d] = w.norm[d] * (src[d] * inv) * silu(zr[d]);
                    }
                }
            }
            row0 += t_len;
        }
        let mut out = vec![0f32; n * cfg.hidden_size];
        m.out.matmul(0, &o, n, &mut out);
        Ok(out)
    }

    fn attention(&self, li: usize, m: &AttnFast, w: &AttentionWeights, xn: &[f32], n: usize, spans: &mut [Span<'_>]) -> ModelResult<Vec<f32>> {
        let cfg = &self.weights.config;
        let (heads, kv_heads, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
        let (qw, kvw) = (2 * heads * hd, kv_heads * hd);
        let group = heads / kv_heads;
        let eps = cfg.rms_norm_eps;
        let mut qg = vec![0f32; n * qw];
        let mut k = vec![0f32; n * kvw];
        let mut v = vec![0f32; n * kvw];
        matmul_many(vec![
            Product { mat: &m.q, expert: 0, x: xn, n, y: &mut qg },
            Product { mat: &m.k, expert: 0, x: xn, n, y: &mut k },
            Product { mat: &m.v, expert: 0, x: xn, n, y: &mut v },
        ]);

        let mut gated = vec![0f32; n * heads * hd];
        let mut row0 = 0;
        for span in spans.iter_mut() {
            let t_len = span.tokens.len();
            let start = span.state.len;
            let Some(LayerState::Attention { keys, values }) = span.state.layers.get_mut(li) else {
                return Err(ModelError::Invalid(format!("layer {li}: sequence state is not an attention state")));
            };
            for t in 0..t_len {
                let pos = start + t;
                let r = row0 + t;
                for kh in 0..kv_heads {
                    let mut head = k[r * kvw + kh * hd..][..hd].to_vec();
                    rms_norm_in_place(&mut head, &w.k_norm, eps);
                    rope(&mut head, pos, &self.inv_freq);
                    keys.extend_from_slice(&head);
                }
                values.extend_from_slice(&v[r * kvw..(r + 1) * kvw]);
                for hh in 0..heads {
                    let head = &mut qg[r * qw + hh * 2 * hd..][..hd];
                    rms_norm_in_place(head, &w.q_norm, eps);
                    rope(head, pos, &self.inv_freq);
                }
            }
            let keys: &[f32] = keys;
            let values: &[f32] = values;
            let qg: &[f32] = &qg;
            let scale = 1.0 / (hd as f32).sqrt();
            gated[row0 * heads * hd..(row0 + t_len) * heads * hd].par_chunks_mut(hd).enumerate().for_each(|(i, out)| {
                let (t, hh) = (i / heads, i % heads);
                let r = row0 + t;
                let q = &qg[r * qw + hh * 2 * hd..][..hd];
                let gate = &qg[r * qw + hh * 2 * hd + hd..][..hd];
                let kvh = hh / group;
                let positions = start + t + 1;
                let mut scores: Vec<f32> = (0..positions)
                    .map(|p| {
                        let kr = &keys[(p * kv_heads + kvh) * hd..][..hd];
                        q.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                out.fill(0.0);
                for (p, s) in scores.iter().enumerate() {
                    let wgt = s / sum;
                    let vr = &values[(p * kv_heads + kvh) * hd..][..hd];
                    for (o, &vv) in out.iter_mut().zip(vr) {
                        *o += wgt * vv;
                    }
                }
                for (o, &gv) in out.iter_mut().zip(gate) {
                    *o *= sigmoid(gv);
                }
            });
            row0 += t_len;
        }
        let mut out = vec![0f32; n * cfg.hidden_size];
        m.o.matmul(0, &gated, n, &mut out);
        Ok(out)
    }

    fn moe(&self, m: &MoeFast, xn: &[f32], n: usize) -> Vec<f32> {
        let cfg = &self.weights.config;
        let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
        let mut logits = vec![0f32; n * e];
        let mut shared_scale = vec![0f32; n];
        matmul_many(vec![
            Product { mat: &m.router, expert: 0, x: xn, n, y: &mut logits },
            Product { mat: &m.shared_expert_gate, expert: 0, x: xn, n, y: &mut shared_scale },
        ]);
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for (row, l) in logits.chunks_exact(e).enumerate() {
            for (ex, wgt) in route(l, k) {
                by_expert[ex].push((row, wgt));
            }
        }

        // Every chosen expert runs once for all the tokens routed to it; the
        // shared expert runs on every token. Gate and up products of all of
        // them form one parallel region, the down products another, so the
        // threads stay balanced whatever the routing.
        struct Group {
            expert: Option<usize>,
            rows: Vec<usize>,
            weights: Vec<f32>,
            xs: Vec<f32>,
        }
        let mut groups: Vec<Group> = by_expert
            .iter()
            .enumerate()
            .filter(|(_, routed)| !routed.is_empty())
            .map(|(ex, routed)| {
                let mut xs = Vec::with_capacity(routed.len() * h);
                for &(row, _) in routed {
                    xs.extend_from_slice(&xn[row * h..(row + 1) * h]);
                }
                Group { expert: Some(ex), rows: routed.iter().map(|r| r.0).collect(), weights: routed.iter().map(|r| r.1).collect(), xs }
            })
            .collect();
        groups.push(Group { expert: None, rows: (0..n).collect(), weights: shared_scale.iter().map(|&s| sigmoid(s)).collect(), xs: Vec::new() });
        let mats = |g: &Group| match g.expert {
            Some(ex) => (&m.gate, &m.up, &m.down, ex),
            None => (&m.shared_gate, &m.shared_up, &m.shared_down, 0),
        };

        let mut gates: Vec<Vec<f32>> = groups.iter().map(|g| vec![0f32; g.rows.len() * mats(g).0.rows]).collect();
        let mut ups: Vec<Vec<f32>> = groups.iter().map(|g| vec![0f32; g.rows.len() * mats(g).1.rows]).collect();
        let mut products = Vec::with_capacity(2 * groups.len());
        for ((g, gate), up) in groups.iter().zip(gates.iter_mut()).zip(ups.iter_mut()) {
            let (gm, um, _, ex) = mats(g);
            let x: &[f32] = if g.expert.is_some() { &g.xs } else { xn };
            products.push(Product { mat: gm, expert: ex, x, n: g.rows.len(), y: gate });
            products.push(Product { mat: um, expert: ex, x, n: g.rows.len(), y: up });
        }
        matmul_many(products);
        for (gate, up) in gates.iter_mut().zip(&ups) {
            for (gv, &uv) in gate.iter_mut().zip(up) {
                *gv = silu(*gv) * uv;
            }
        }
        let mut downs: Vec<Vec<f32>> = groups.iter().map(|g| vec![0f32; g.rows.len() * h]).collect();
        let products = groups
            .iter()
            .zip(&gates)
            .zip(downs.iter_mut())
            .map(|((g, hidden), y)| {
                let (_, _, dm, ex) = mats(g);
                Product { mat: dm, expert: ex, x: hidden, n: g.rows.len(), y }
            })
            .collect();
        matmul_many(products);

        // Weighted sum in a fixed order (expert index, then shared), so the
        // result does not depend on thread timing.
        let mut out = vec![0f32; n * h];
        for (g, y) in groups.iter().zip(&downs) {
            for ((&row, &wgt), yr) in g.rows.iter().zip(&g.weights).zip(y.chunks_exact(h)) {
                for (o, &v) in out[row * h..(row + 1) * h].iter_mut().zip(yr) {
                    *o += wgt * v;
                }
            }
        }
        out
    }
}

/// Softmax over the router logits, top-k (ties to the lower index),
/// renormalised.
fn route(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    let mut chosen: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (i, &p) in probs.iter().enumerate() {
        let p = p / total;
        if chosen.len() < k || p > chosen[chosen.len() - 1].1 {
            let at = chosen.iter().position(|&(_, q)| p > q).unwrap_or(chosen.len());
            chosen.insert(at, (i, p));
            chosen.truncate(k);
        }
    }
    let sum: f32 = chosen.iter().map(|c| c.1).sum();
    chosen.into_iter().map(|(i, p)| (i, p / sum)).collect()
}

/// Causal depthwise conv + SiLU over `rows` (`[T][channels]`, replaced in
/// place), carrying the window of raw inputs.
fn conv_silu(window: &mut [f32], taps: &[f32], kernel: usize, rows: &mut [f32], channels: usize) {
    let mut acc = vec![0f32; channels];
    for raw in rows.chunks_exact_mut(channels) {
        for ((a, &tap), &r) in acc.iter_mut().zip(&taps[(kernel - 1) * channels..]).zip(raw.iter()) {
            *a = tap * r;
        }
        for i in 0..kernel - 1 {
            for ((a, &tap), &wv) in acc.iter_mut().zip(&taps[i * channels..(i + 1) * channels]).zip(&window[i * channels..]) {
                *a += tap * wv;
            }
        }
        window.copy_within(channels.., 0);
        window[(kernel - 2) * channels..].copy_from_slice(raw);
        for (r, &a) in raw.iter_mut().zip(&acc) {
            *r = silu(a);
        }
    }
}

fn l2_norm_heads(src: &[f32], dim: usize, scale: f32, dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(dim).zip(dst.chunks_exact_mut(dim)) {
        let inv = scale / (s.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        for (o, &v) in d.iter_mut().zip(s) {
            *o = v * inv;
        }
    }
}

fn rms_norm_in_place(x: &mut [f32], gain: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(gain) {
        *v = *v * inv * g;
    }
}

fn rms_norm_rows(x: &[f32], gain: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    // A few rows are not worth waking the pool for.
    if out.len() / gain.len() < 8 {
        out.chunks_mut(gain.len()).for_each(|row| rms_norm_in_place(row, gain, eps));
    } else {
        out.par_chunks_mut(gain.len()).for_each(|row| rms_norm_in_place(row, gain, eps));
    }
    out
}

fn rope(head: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for j in 0..half {
        let angle = pos as f32 * inv_freq[j];
        let (sin, cos) = (angle as f64).sin_cos();
        let (sin, cos) = (sin as f32, cos as f32);
        let (a, b) = (head[j], head[j + half]);
        head[j] = a * cos - b * sin;
        head[j + half] = b * cos + a * sin;
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
