//! Choosing the next token from a row of logits, per request.
//!
//! Owns the penalties, temperature, the truncations (top-k, top-p, min-p),
//! the request's seeded RNG and the logprobs report. It does not own stop
//! handling or detokenisation (`text.rs`).
//!
//! Order of operations, fixed and documented because it changes results:
//! 1. repetition penalty (HF): for every token seen in prompt or output, a
//!    positive logit is divided by the penalty, a negative one multiplied;
//! 2. presence / frequency penalties (OpenAI), on generated tokens only:
//!    `l -= presence * [count > 0] + frequency * count`;
//! 3. logprobs are the log-softmax of these penalised logits, before
//!    temperature and truncation, so they describe the model's (penalised)
//!    distribution and stay finite for every alternative;
//! 4. temperature 0 takes the argmax of the penalised logits (ties: lowest id);
//! 5. otherwise logits / temperature -> softmax, then top-k, then top-p, then
//!    min-p (relative to the most likely token), each on what the previous
//!    step kept, and one draw from the renormalised remainder with the
//!    request's ChaCha20 RNG.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::api::SamplingParams;

/// How many candidates the top-p path sorts before falling back to a full
/// sort: enough for any peaked distribution, small next to a 248k vocab.
const TOP_P_PARTIAL: usize = 1024;

/// The outcome of one sampling step.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// The chosen token's logprob and the `n` best alternatives (id, logprob),
    /// when asked for.
    pub logprobs: Option<(f32, Vec<(u32, f32)>)>,
}

/// One request's sampling state: its parameters, its RNG, and the token
/// history the penalties need.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// Tokens of the prompt and output (repetition penalty).
    seen: Vec<u32>,
    seen_set: std::collections::HashSet<u32>,
    /// Counts of generated tokens (presence / frequency penalties).
    generated: HashMap<u32, u32>,
    /// Reused across steps so sampling allocates nothing per token.
    scratch: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        let mut s = Sampler {
            params,
            rng: ChaCha20Rng::seed_from_u64(seed),
            seen: Vec::new(),
            seen_set: Default::default(),
            generated: HashMap::new(),
            scratch: Vec::new(),
        };
        if s.params.repetition_penalty != 1.0 {
            for &t in prompt {
                if s.seen_set.insert(t) {
                    s.seen.push(t);
                }
            }
        }
        s
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (call once per token that was emitted).
    pub fn accept(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 && self.seen_set.insert(token) {
            self.seen.push(token);
        }
    }

    /// Chooses the next token. `logits` is modified in place (penalties,
    /// temperature). `top_logprobs`: `Some(n)` also reports logprobs.
    pub fn sample(&mut self, logits: &mut [f32], top_logprobs: Option<usize>) -> Sampled {
        self.apply_penalties(logits);
        // The draw overwrites `logits` with weights, so the chosen token's
        // penalised logit is kept aside first (only when logprobs are asked).
        let report = top_logprobs.map(|n| (logprobs_of(logits, n), logits.to_vec()));
        let token = if self.params.temperature == 0.0 {
            lily_model::argmax(logits)
        } else {
            self.draw(logits)
        };
        let logprobs = report.map(|((lse, top), penalised)| {
            let chosen = penalised
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |l| l - lse);
            (chosen, top)
        });
        Sampled { token, logprobs }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.generated {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
    }

    /// Temperature, truncation and one draw.
    fn draw(&mut self, logits: &mut [f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            // Every logit is -inf or NaN: nothing to sample from; argmax
            // keeps the engine going with a defined answer.
            return lily_model::argmax(logits);
        }
        // Unnormalised probabilities exp((l - max) / T); the top token has 1.
        for l in logits.iter_mut() {
            let e = ((*l - max) * inv_t).exp();
            *l = if e.is_nan() { 0.0 } else { e };
        }
        let truncating = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
        if !truncating {
            return draw_from(
                logits
                    .iter()
                    .copied()
                    .enumerate()
                    .map(|(i, w)| (i as u32, w)),
                &mut self.rng,
            );
        }

        let cand = &mut self.scratch;
        cand.clear();
        let k = if p.top_k > 0 {
            p.top_k.min(logits.len())
        } else {
            logits.len()
        };
        let min_weight = p.min_p; // the top token's weight is 1
        cand.extend(
            logits
                .iter()
                .copied()
                .enumerate()
                .filter(|&(_, w)| w > 0.0 && w >= min_weight)
                .map(|(i, w)| (i as u32, w)),
        );
        // min-p is relative to the top token, which truncation never removes,
        // so filtering it first gives the same set as applying it last.
        if cand.is_empty() {
            return lily_model::argmax(logits);
        }
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_weight);
            cand.truncate(k);
        }
        if p.top_p < 1.0 {
            let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
            let target = p.top_p as f64 * total;
            // Sort only the head when it already reaches the target mass.
            let head = TOP_P_PARTIAL.min(cand.len());
            if head < cand.len() {
                cand.select_nth_unstable_by(head - 1, by_weight);
            }
            cand[..head].sort_unstable_by(by_weight);
            let mut acc = 0.0f64;
            let mut keep = None;
            for (i, c) in cand[..head].iter().enumerate() {
                acc += c.1 as f64;
                if acc >= target {
                    keep = Some(i + 1);
                    break;
                }
            }
            let keep = match keep {
                Some(n) => n,
                None => {
                    cand.sort_unstable_by(by_weight);
                    let mut acc = 0.0f64;
                    let mut n = cand.len();
                    for (i, c) in cand.iter().enumerate() {
                        acc += c.1 as f64;
                        if acc >= target {
                            n = i + 1;
                            break;
                        }
                    }
                    n
                }
            };
            cand.truncate(keep);
        }
        // A fixed order for the draw, so the result depends only on the
        // logits and the RNG, not on how selection happened to permute.
        cand.sort_unstable_by_key(|c| c.0);
        draw_from(cand.iter().copied(), &mut self.rng)
    }
}

/// One draw proportional to the weights (inverse CDF); falls back to the
/// last positive-weight token if rounding leaves the target unreached.
fn draw_from(items: impl Iterator<Item = (u32, f32)> + Clone, rng: &mut ChaCha20Rng) -> u32 {
    let total: f64 = items.clone().map(|(_, w)| w as f64).sum();
    let target = rng.random::<f64>() * total;
    let mut acc = 0.0f64;
    let mut last = 0u32;
    for (id, w) in items {
        if w <= 0.0 {
            continue;
        }
        acc += w as f64;
        last = id;
        if acc > target {
            return id;
        }
    }
    last
}

/// log-sum-exp of the row and its `n` most likely tokens as (id, logprob),
/// most likely first (ties: lowest id first).
fn logprobs_of(logits: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
        max + sum.ln() as f32
    } else {
        max
    };
    let n = n.min(logits.len());
    if n == 0 {
        return (lse, Vec::new());
    }
    let mut idx: Vec<(u32, f32)> = logits
        .iter()
        .copied()
        .enumerate()
        .map(|(i, l)| (i as u32, l))
        .collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by_logit);
    (lse, idx.into_iter().map(|(i, l)| (i, l - lse)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    /// Empirical distribution of `n` draws from the same logits.
    fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(p, &[]);
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            let mut l = logits.to_vec();
            h[s.sample(&mut l, None).token as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_takes_argmax_and_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], None).token, 1);
        assert_eq!(s.sample(&mut [1.0, 5.0, 5.0], None).token, 1);
    }

    #[test]
    fn temperature_one_follows_softmax() {
        // softmax([ln 1, ln 2, ln 7]) = [0.1, 0.2, 0.7]
        let logits = [1f32.ln(), 2f32.ln(), 7f32.ln()];
        let h = histogram(params(|_| {}), &logits, 20_000);
        let f: Vec<f64> = h.iter().map(|&c| c as f64 / 20_000.0).collect();
        assert!(
            (f[0] - 0.1).abs() < 0.015 && (f[1] - 0.2).abs() < 0.015 && (f[2] - 0.7).abs() < 0.015,
            "{f:?}"
        );
    }

    #[test]
    fn low_temperature_sharpens_high_flattens() {
        let logits = [0.0f32, 1.0];
        let cold = histogram(params(|p| p.temperature = 0.1), &logits, 5_000);
        let hot = histogram(params(|p| p.temperature = 100.0), &logits, 5_000);
        // exp(10) : 1 -> token 0 almost never at T=0.1; near 50/50 at T=100.
        assert!(cold[0] < 10, "{cold:?}");
        assert!((hot[0] as f64 / 5_000.0 - 0.5).abs() < 0.04, "{hot:?}");
    }

    #[test]
    fn top_k_keeps_only_k_best() {
        let logits = [3.0f32, 2.9, 2.8, -1.0, 2.7];
        let h = histogram(params(|p| p.top_k = 2), &logits, 3_000);
        assert!(h[0] > 0 && h[1] > 0);
        assert_eq!(h[2] + h[3] + h[4], 0, "{h:?}");
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_mass() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}; 0.85 keeps {0, 1, 2}.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let h = histogram(params(|p| p.top_p = 0.75), &logits, 4_000);
        assert!(h[0] > 0 && h[1] > 0 && h[2] == 0 && h[3] == 0, "{h:?}");
        let h = histogram(params(|p| p.top_p = 0.85), &logits, 4_000);
        assert!(h[2] > 0 && h[3] == 0, "{h:?}");
        // Kept tokens are renormalised: 0.5/0.8 of the mass for token 0.
        let h = histogram(params(|p| p.top_p = 0.75), &logits, 20_000);
        assert!((h[0] as f64 / 20_000.0 - 0.625).abs() < 0.015, "{h:?}");
    }

    #[test]
    fn top_p_beyond_partial_head_falls_back_to_full_sort() {
        // A flat distribution over 3000 tokens: top_p 0.9 needs 2700 of
        // them, more than the partial head; equal weights tie-break by id,
        // so the last 300 ids are the ones cut.
        let logits = vec![0.0f32; 3000];
        let h = histogram(params(|p| p.top_p = 0.9), &logits, 20_000);
        assert!(h[..2700].iter().filter(|&&c| c > 0).count() > 2000);
        assert_eq!(h[2700..].iter().sum::<usize>(), 0);
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_top() {
        // Probabilities 0.6, 0.3, 0.1: min_p 0.4 keeps tokens with p >= 0.24.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let h = histogram(params(|p| p.min_p = 0.4), &logits, 4_000);
        assert!(h[0] > 0 && h[1] > 0 && h[2] == 0, "{h:?}");
    }

    #[test]
    fn presence_and_frequency_penalise_generated_tokens_only() {
        let p = params(|p| {
            p.temperature = 0.0;
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        });
        // Token 2 is in the prompt: OpenAI penalties ignore the prompt.
        let mut s = Sampler::new(p, &[2]);
        let mut l = [1.0f32, 2.0, 3.0];
        s.sample(&mut l, None);
        assert_eq!(l, [1.0, 2.0, 3.0]);
        s.accept(2);
        s.accept(2);
        s.accept(1);
        let mut l = [1.0f32, 2.0, 3.0];
        let out = s.sample(&mut l, None);
        assert_eq!(l, [1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.5]);
        assert_eq!(out.token, 2);
    }

    #[test]
    fn repetition_penalty_divides_positive_multiplies_negative() {
        let p = params(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 2.0;
        });
        let mut s = Sampler::new(p, &[0, 1]);
        s.accept(3);
        let mut l = [4.0f32, -1.0, 3.0, 2.5];
        let out = s.sample(&mut l, None);
        assert_eq!(l, [2.0, -2.0, 3.0, 1.25]);
        assert_eq!(out.token, 2);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(
                SamplingParams {
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                &[],
            );
            (0..64)
                .map(|_| s.sample(&mut logits.clone(), None).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn logprobs_are_log_softmax_of_penalised_logits_before_temperature() {
        let p = params(|p| p.temperature = 0.5);
        let mut s = Sampler::new(p, &[]);
        let logits = [0.25f32.ln(), 0.25f32.ln(), 0.5f32.ln()];
        let out = s.sample(&mut logits.clone(), Some(2));
        let (chosen, top) = out.logprobs.expect("asked for logprobs");
        let expect = [0.25f32.ln(), 0.25f32.ln(), 0.5f32.ln()][out.token as usize];
        assert!((chosen - expect).abs() < 1e-5);
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].0, 2);
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-5);
        // Tie between 0 and 1: lowest id first.
        assert_eq!(top[1].0, 0);
    }

    #[test]
    fn truncation_never_picks_a_removed_token_with_extreme_logits() {
        let logits = [f32::NEG_INFINITY, 10.0, f32::NEG_INFINITY, 9.0];
        let h = histogram(params(|p| p.top_k = 3), &logits, 1_000);
        assert_eq!(h[0] + h[2], 0);
        let h = histogram(params(|_| {}), &logits, 1_000);
        assert_eq!(h[0] + h[2], 0);
    }
}
