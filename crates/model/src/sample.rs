//! Sampling for `Backend::decode_sample`: the per-sequence parameters and
//! penalty state, and the host implementation of the math (the default
//! `decode_sample` and the reference the CUDA kernel is tested against).
//!
//! The semantics are the engine's host sampler (crates/engine/src/sampling.rs):
//! repetition penalty on tokens seen in the prompt or output, then presence /
//! frequency penalties on generated tokens; the logprob is the log-softmax of
//! the penalised logits before temperature; temperature 0 is the argmax
//! (lowest id on ties); otherwise weights exp((l - max) / T), then min-p,
//! top-k and top-p (ties ordered by id), and one inverse-CDF draw in id
//! order. `vocab_limit` cuts the row first (ids at or beyond it are never
//! drawn nor reported); `top_logprobs` reports the most likely ids of the
//! penalised distribution (ordered by the penalised logit, descending, then
//! by id; a NaN logit ranks as -inf).
//! What differs from the engine is the random stream: the uniform of
//! step `s` is Philox4x32-10 keyed by the seed with counter `s`, so a device
//! can draw it without state and a step replays exactly.

use std::collections::HashMap;

use crate::SeqId;

/// Marks a token seen in the prompt in a count-table entry; the low 31 bits
/// count the times it was generated.
pub const SEEN_IN_PROMPT: u32 = 0x8000_0000;

/// One sequence's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off; relative to the most likely token.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub seed: u64,
    /// How many of the most likely ids to report with their logprobs
    /// (`Sampled::top`); 0 = none.
    pub top_logprobs: u32,
    /// Ids at or beyond this are never drawn nor reported (the tokenizer's
    /// vocabulary inside a padded lm_head); 0 = the whole row.
    pub vocab_limit: u32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            top_logprobs: 0,
            vocab_limit: 0,
        }
    }
}

impl SampleParams {
    pub fn greedy() -> Self {
        SampleParams { temperature: 0.0, ..Default::default() }
    }
    /// Whether any penalty changes the logits (a count table is needed).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// The chosen token and its logprob (penalised, before temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely (id, logprob) of the same
    /// distribution, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// One sequence's sampling state, owned by the caller: parameters, the step
/// counter of the random stream, and the token counts the penalties read.
/// A backend may mirror the counts on its device; `device_copy` names the
/// sequence whose device table matches them (cleared by any change the
/// backend did not make itself, so it uploads again).
#[derive(Clone, Debug)]
pub struct SampleState {
    pub params: SampleParams,
    /// Index of the next draw in the seed's stream.
    pub step: u64,
    counts: HashMap<u32, u32>,
    device_copy: Option<SeqId>,
}

impl SampleState {
    pub fn new(params: SampleParams, prompt: &[u32]) -> Self {
        let mut counts = HashMap::new();
        if params.repetition_penalty != 1.0 {
            for &t in prompt {
                *counts.entry(t).or_insert(0) |= SEEN_IN_PROMPT;
            }
        }
        SampleState { params, step: 0, counts, device_copy: None }
    }

    /// Records a generated token that did not come from `decode_sample`
    /// (e.g. one the caller forced).
    pub fn accept(&mut self, token: u32) {
        self.count(token);
        self.device_copy = None;
    }

    /// Records the outcome of one `decode_sample` draw: the token is counted
    /// and the step advances. Backends call this; the device table, if any,
    /// made the same change.
    pub fn record_draw(&mut self, token: u32) {
        self.count(token);
        self.step += 1;
    }

    fn count(&mut self, token: u32) {
        let c = self.counts.entry(token).or_insert(0);
        *c = (*c & SEEN_IN_PROMPT) | ((*c & !SEEN_IN_PROMPT) + 1).min(!SEEN_IN_PROMPT);
    }

    /// The count-table entry of `token` (see `SEEN_IN_PROMPT`).
    pub fn count_of(&self, token: u32) -> u32 {
        self.counts.get(&token).copied().unwrap_or(0)
    }

    /// The counts as a dense table of `vocab` entries (device upload).
    pub fn dense_counts(&self, vocab: usize) -> Vec<u32> {
        let mut row = vec![0u32; vocab];
        for (&t, &c) in &self.counts {
            if let Some(e) = row.get_mut(t as usize) {
                *e = c;
            }
        }
        row
    }

    pub fn device_copy(&self) -> Option<SeqId> {
        self.device_copy
    }
    pub fn set_device_copy(&mut self, seq: Option<SeqId>) {
        self.device_copy = seq;
    }
}

/// The logit after the penalties, with the kernel's expression order.
pub fn penalised(logit: f32, entry: u32, p: &SampleParams) -> f32 {
    let mut l = logit;
    let gen = entry & !SEEN_IN_PROMPT;
    if p.repetition_penalty != 1.0 && entry != 0 {
        l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
    }
    if gen != 0 && (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
        l -= p.presence_penalty + p.frequency_penalty * gen as f32;
    }
    l
}

/// Everything one draw depends on: the penalised logits (of the row up to
/// `vocab_limit`), their log-sum-exp, the argmax, the reported top
/// logprobs, and (when sampling) the candidates left after min-p, top-k and
/// top-p as (id, weight) in id order.
pub struct Distribution {
    pub penalised: Vec<f32>,
    pub lse: f64,
    pub argmax: u32,
    pub top: Vec<(u32, f32)>,
    /// None for greedy (temperature 0 or no finite logit).
    pub candidates: Option<Vec<(u32, f32)>>,
}

impl Distribution {
    pub fn new(logits: &[f32], state: &SampleState) -> Self {
        let p = &state.params;
        let limit = if p.vocab_limit == 0 { logits.len() } else { logits.len().min(p.vocab_limit as usize) };
        let logits = &logits[..limit];
        let penalised: Vec<f32> = logits.iter().enumerate().map(|(i, &l)| penalised(l, state.count_of(i as u32), p)).collect();
        let argmax = first_max(&penalised);
        let m = penalised.get(argmax as usize).copied().unwrap_or(f32::NEG_INFINITY);
        let lse = m as f64 + penalised.iter().map(|&l| (l - m).exp() as f64).sum::<f64>().ln();
        let top = top_logprobs(&penalised, lse, p.top_logprobs as usize);
        if p.temperature <= 0.0 || !m.is_finite() {
            return Distribution { penalised, lse, argmax, top, candidates: None };
        }
        let inv_t = 1.0 / p.temperature;
        let mut cand: Vec<(u32, f32)> = penalised
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let e = ((l - m) * inv_t).exp();
                (i as u32, if e.is_nan() { 0.0 } else { e })
            })
            .filter(|&(_, w)| w > 0.0 && w >= p.min_p)
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && (p.top_k as usize) < cand.len() {
            cand.truncate(p.top_k as usize);
        }
        if p.top_p < 1.0 {
            let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
            let target = p.top_p as f64 * total;
            let mut acc = 0.0f64;
            if let Some(n) = cand.iter().position(|c| {
                acc += c.1 as f64;
                acc >= target
            }) {
                cand.truncate(n + 1);
            }
        }
        cand.sort_by_key(|c| c.0);
        Distribution { penalised, lse, argmax, top, candidates: Some(cand) }
    }

    /// The token for a uniform `u` in [0, 1), and its logprob.
    pub fn draw(&self, u: f64) -> Sampled {
        let token = match &self.candidates {
            None => self.argmax,
            Some(c) if c.is_empty() => self.argmax,
            Some(c) => {
                let total: f64 = c.iter().map(|x| x.1 as f64).sum();
                let target = u * total;
                let mut acc = 0.0f64;
                let mut pick = c[c.len() - 1].0;
                for &(id, w) in c {
                    acc += w as f64;
                    if acc > target {
                        pick = id;
                        break;
                    }
                }
                pick
            }
        };
        let logprob = self.penalised.get(token as usize).map_or(f32::NEG_INFINITY, |&l| (l as f64 - self.lse) as f32);
        Sampled { token, logprob, top: self.top.clone() }
    }
}

/// The `n` most likely ids of `penalised` as (id, logprob), ordered by the
/// penalised logit descending (exact, where rounded logprobs could tie),
/// then by id; a NaN logit ranks as -inf.
fn top_logprobs(penalised: &[f32], lse: f64, n: usize) -> Vec<(u32, f32)> {
    let n = n.min(penalised.len());
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = penalised.iter().enumerate().map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })).collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx.into_iter().map(|(i, l)| (i, (l as f64 - lse) as f32)).collect()
}

/// One draw on the host for `state` (the default `decode_sample`); advances
/// the state as a device draw does.
pub fn sample_host(logits: &[f32], state: &mut SampleState) -> Sampled {
    let s = Distribution::new(logits, state).draw(philox_uniform(state.params.seed, state.step));
    state.record_draw(s.token);
    s
}

/// Index of the largest value, NaN never winning (ties: lowest id).
fn first_max(values: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|b| v > values[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Uniform in [0, 1) with 53 bits: Philox4x32-10, key = seed, counter =
/// (step, 0); identical to `philox_uniform` in kernels/sampling.cu.
pub fn philox_uniform(seed: u64, step: u64) -> f64 {
    let (mut c0, mut c1, mut c2, mut c3) = (step as u32, (step >> 32) as u32, 0u32, 0u32);
    let (mut k0, mut k1) = (seed as u32, (seed >> 32) as u32);
    for _ in 0..10 {
        let p0 = 0xD251_1F53u64 * c0 as u64;
        let p1 = 0xCD9E_8D57u64 * c2 as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
        k0 = k0.wrapping_add(0x9E37_79B9);
        k1 = k1.wrapping_add(0xBB67_AE85);
    }
    let bits = (((c0 as u64) << 32) | c1 as u64) >> 11;
    bits as f64 * (1.0 / 9_007_199_254_740_992.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(f: impl FnOnce(&mut SampleParams)) -> SampleState {
        let mut p = SampleParams { seed: 7, ..Default::default() };
        f(&mut p);
        SampleState::new(p, &[])
    }

    #[test]
    fn philox_matches_the_published_known_answer() {
        // Random123's kat_vectors: philox4x32-10 with counter and key all
        // zero gives 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
        let u = philox_uniform(0, 0);
        let want = ((0x6627_e8d5u64 << 32 | 0xe169_c58d) >> 11) as f64 / 9_007_199_254_740_992.0;
        assert_eq!(u, want);
        assert_ne!(philox_uniform(1, 0), philox_uniform(1, 1));
    }

    #[test]
    fn greedy_is_first_argmax_and_logprob_is_log_softmax() {
        let mut s = SampleState::new(SampleParams::greedy(), &[]);
        let out = sample_host(&[1.0, 3.0, 3.0, 0.0], &mut s);
        assert_eq!(out.token, 1);
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + 1.0).ln();
        assert!((out.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(s.step, 1);
    }

    #[test]
    fn truncations_keep_the_engine_sets() {
        // Probabilities 0.5, 0.3, 0.15, 0.05.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let ids = |s: &SampleState| -> Vec<u32> {
            Distribution::new(&logits, s).candidates.unwrap_or_default().iter().map(|c| c.0).collect()
        };
        assert_eq!(ids(&state(|p| p.top_p = 0.75)), vec![0, 1]);
        assert_eq!(ids(&state(|p| p.top_p = 0.85)), vec![0, 1, 2]);
        assert_eq!(ids(&state(|p| p.top_k = 3)), vec![0, 1, 2]);
        assert_eq!(ids(&state(|p| p.min_p = 0.5)), vec![0, 1]);
        // Ties at the top-k boundary go to the lower id.
        let flat = [1.0f32; 6];
        let s = state(|p| p.top_k = 2);
        let c: Vec<u32> = Distribution::new(&flat, &s).candidates.unwrap_or_default().iter().map(|c| c.0).collect();
        assert_eq!(c, vec![0, 1]);
    }

    #[test]
    fn penalties_follow_the_engine_order() {
        let p = SampleParams { repetition_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut s = SampleState::new(p, &[0, 1]);
        s.accept(3);
        s.accept(3);
        let d = Distribution::new(&[4.0, -1.0, 3.0, 2.5], &s);
        assert_eq!(d.penalised, vec![2.0, -2.0, 3.0, 1.25 - 0.5 - 0.5]);
        assert_eq!(s.count_of(0), SEEN_IN_PROMPT);
        assert_eq!(s.count_of(3), 2);
        assert_eq!(s.dense_counts(5), vec![SEEN_IN_PROMPT, SEEN_IN_PROMPT, 0, 2, 0]);
    }

    #[test]
    fn top_logprobs_are_ordered_by_logit_then_id() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NEG_INFINITY, -1.0];
        let d = Distribution::new(&logits, &state(|p| p.top_logprobs = 4));
        assert_eq!(d.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2, 0]);
        for &(id, lp) in &d.top {
            assert_eq!(lp, (logits[id as usize] as f64 - d.lse) as f32);
        }
        // More asked than the row holds: every id, -inf last.
        let d = Distribution::new(&logits, &state(|p| p.top_logprobs = 20));
        assert_eq!(d.top.len(), 6);
        assert_eq!(d.top[5], (4, f32::NEG_INFINITY));
        let out = sample_host(&logits, &mut state(|p| p.top_logprobs = 2));
        assert_eq!(out.top, d.top[..2].to_vec());
        assert!(sample_host(&logits, &mut state(|_| {})).top.is_empty());
        // A NaN ranks as -inf (after it by id), never first.
        let d = Distribution::new(&[f32::NEG_INFINITY, f32::NAN, 0.5], &state(|p| p.top_logprobs = 3));
        assert_eq!(d.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 0, 1]);
    }

    #[test]
    fn vocab_limit_hides_the_ids_beyond_it() {
        // The largest logit sits beyond the limit.
        let logits = [0.5f32, 1.0, 0.25, 9.0, 8.0];
        let mut g = SampleState::new(SampleParams { vocab_limit: 3, top_logprobs: 5, ..SampleParams::greedy() }, &[]);
        let out = sample_host(&logits, &mut g);
        assert_eq!(out.token, 1);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0, 2]);
        let lse = (0.5f64.exp() + 1f64.exp() + 0.25f64.exp()).ln();
        assert!((out.logprob as f64 - (1.0 - lse)).abs() < 1e-6);
        let mut s = state(|p| p.vocab_limit = 3);
        for _ in 0..200 {
            assert!(sample_host(&logits, &mut s).token < 3);
        }
        // A limit beyond the row is the whole row.
        assert_eq!(Distribution::new(&logits, &state(|p| p.vocab_limit = 100)).argmax, 3);
    }

    #[test]
    fn draws_follow_the_probabilities() {
        let logits = [1f32.ln(), 2f32.ln(), 7f32.ln()];
        let mut s = state(|_| {});
        let mut h = [0usize; 3];
        for _ in 0..20_000 {
            h[sample_host(&logits, &mut s).token as usize] += 1;
        }
        let f: Vec<f64> = h.iter().map(|&c| c as f64 / 20_000.0).collect();
        assert!((f[0] - 0.1).abs() < 0.015 && (f[1] - 0.2).abs() < 0.015 && (f[2] - 0.7).abs() < 0.015, "{f:?}");
    }
}
