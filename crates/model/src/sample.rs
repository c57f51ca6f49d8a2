//! Sampling: the one definition of how a token is chosen from a row of
//! logits. It owns the per-sequence parameters and penalty state and the
//! host implementation of the math, used by the engine (the first token of
//! every request, after its prefill), by the default `Backend::decode_sample`
//! (the CPU backend), and as the reference the CUDA kernel `sample_rows` is
//! tested against. It owns no request handling (the engine maps API
//! parameters onto `SampleParams` and builds logprob reports).
//!
//! Order of operations, fixed because it changes results:
//! 1. the row is `logits[..vocab_limit]` (0: the whole row): ids at or
//!    above the limit (the embedding is padded past the tokenizer) take no
//!    part at all, so they are never drawn, never reported, and are not in
//!    the log-softmax;
//! 2. penalties: the repetition penalty (HF) on every token seen in the
//!    prompt or generated divides a positive logit by it and multiplies a
//!    negative one; then presence / frequency (OpenAI), on generated tokens
//!    only: `l -= presence + frequency * count`;
//! 3. the chosen token's `logprob` and the `top_logprobs` best alternatives
//!    (`top`, by logprob descending, then id ascending) come from the
//!    log-softmax of these penalised logits, before temperature and
//!    truncation, so they describe the (penalised) model and stay finite;
//! 4. temperature 0 (or no finite logit) takes the argmax (lowest id on
//!    ties, NaN never wins);
//! 5. otherwise weights `w = exp((l - max) / T)` (the top token has 1), then
//!    min-p (`w >= min_p`, relative to the top token), then top-k (the `k`
//!    heaviest, ties to the lower id), then top-p (the shortest run, in
//!    order of weight descending then id ascending, whose mass reaches
//!    `top_p` of what is left), each on what the previous one kept;
//! 6. one inverse-CDF draw over the kept tokens in id order: the first
//!    token whose running mass exceeds `u * total` (rounding that leaves it
//!    unreached picks the last kept token).
//!
//! Seeds and draws: the uniform `u` of a sequence's draw number `step`
//! (0 for the first generated token, counting every draw) is
//! Philox4x32-10 with key = the 64-bit seed and counter = (step, 0), its
//! first two output words giving 53 bits (`philox_uniform`). A draw thus
//! depends only on (seed, step, logits, counts), so a device draws it
//! without state and a step replays exactly. The engine gives a request
//! without a seed a random seed, drawn once when the request is admitted.

use std::cmp::Ordering;
use std::collections::HashMap;

use crate::SeqId;

/// Marks a token seen in the prompt in a count-table entry; the low 31 bits
/// count the times it was generated.
pub const SEEN_IN_PROMPT: u32 = 0x8000_0000;

/// Most alternatives `SampleParams::top_logprobs` reports (OpenAI's limit);
/// larger values report this many.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// How many of the heaviest candidates top-p sorts before it falls back to
/// sorting them all: enough for any peaked distribution, small next to a
/// 248k vocabulary.
const TOP_P_HEAD: usize = 1024;

/// Largest top-k the one-pass selection (`heaviest_k`) takes: it keeps
/// the k best so far in a plain list (O(k) an insertion), which beats
/// weighing and selecting over the whole row only for small k (the
/// checkpoint's default is 20: 3.2 -> 1.0 ms a draw over 248,320 logits;
/// with the blocked threshold test and maximum, 0.51 -> 0.22 ms on the
/// development machine, `examples/sample_speed.rs`).
const ONE_PASS_TOP_K: usize = 64;

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
    /// How many of the most likely ids to report in `Sampled::top` (0 =
    /// none; at most `MAX_TOP_LOGPROBS`).
    pub top_logprobs: u32,
    /// Ids at or above this are never drawn and never reported (0 = the
    /// whole logits row).
    pub vocab_limit: u32,
    /// Whether the caller reads `Sampled::logprob`. A host draw without it
    /// and without `top_logprobs` skips the log-sum-exp, a pass of `exp`
    /// over the whole row (0.77 of a 1.1 ms first-token draw over 248,320
    /// logits), and reports NaN. The device sampler computes it anyway.
    pub logprob: bool,
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
            logprob: true,
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
    /// How many leading entries of a logits row of `len` take part.
    pub fn row_len(&self, len: usize) -> usize {
        match self.vocab_limit {
            0 => len,
            v => len.min(v as usize),
        }
    }
    /// How many alternatives a draw reports.
    pub fn top_count(&self) -> usize {
        self.top_logprobs.min(MAX_TOP_LOGPROBS) as usize
    }
}

/// The chosen token, its logprob (penalised, before temperature), and the
/// `top_logprobs` most likely ids with theirs, most likely first (ties: the
/// lower id first).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
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
    /// The token of the last draw recorded (`Feed::Previous` on the host).
    last: Option<u32>,
}

impl SampleState {
    pub fn new(params: SampleParams, prompt: &[u32]) -> Self {
        let mut counts = HashMap::new();
        if params.repetition_penalty != 1.0 {
            for &t in prompt {
                *counts.entry(t).or_insert(0) |= SEEN_IN_PROMPT;
            }
        }
        SampleState { params, step: 0, counts, device_copy: None, last: None }
    }

    /// Records a generated token that did not come from a draw (e.g. one
    /// the caller forced).
    pub fn accept(&mut self, token: u32) {
        self.count(token);
        self.device_copy = None;
    }

    /// Records the outcome of one draw: the token is counted and the step
    /// advances (`begin_draw` then `end_draw`). Backends call this; the
    /// device table, if any, made the same change.
    pub fn record_draw(&mut self, token: u32) {
        self.begin_draw();
        self.end_draw(token);
    }

    /// The first half of a draw whose token is not known yet (a pipelined
    /// step, at submit): returns the draw's step and advances the counter.
    pub fn begin_draw(&mut self) -> u64 {
        self.step += 1;
        self.step - 1
    }

    /// The second half (at collect): counts the drawn token and makes it
    /// `last_draw`.
    pub fn end_draw(&mut self, token: u32) {
        self.count(token);
        self.last = Some(token);
    }

    /// The token of the last recorded draw.
    pub fn last_draw(&self) -> Option<u32> {
        self.last
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

/// Everything one draw depends on: the penalised logits of the row (the
/// first `vocab_limit`), their log-sum-exp (NaN when `logprob` is off and
/// no alternatives are asked for), the argmax, the reported
/// alternatives, and (when sampling) the candidates left after min-p, top-k
/// and top-p as (id, weight) in id order.
pub struct Distribution {
    pub penalised: Vec<f32>,
    pub lse: f64,
    pub argmax: u32,
    /// The `top_logprobs` most likely ids and their logprobs.
    pub top: Vec<(u32, f32)>,
    /// None for greedy (temperature 0 or no finite logit).
    pub candidates: Option<Vec<(u32, f32)>>,
}

impl Distribution {
    pub fn new(logits: &[f32], state: &SampleState) -> Self {
        let p = &state.params;
        let mut penalised = logits[..p.row_len(logits.len())].to_vec();
        // Entries with a zero count are left as they are by `penalised`.
        for (&t, &c) in &state.counts {
            if let Some(l) = penalised.get_mut(t as usize) {
                *l = self::penalised(*l, c, p);
            }
        }
        let argmax = first_max(&penalised);
        let m = penalised.get(argmax as usize).copied().unwrap_or(f32::NEG_INFINITY);
        // NaN when nothing reads it: the logprobs then come out NaN.
        let lse = if p.logprob || p.top_count() > 0 { m as f64 + penalised.iter().map(|&l| (l - m).exp() as f64).sum::<f64>().ln() } else { f64::NAN };
        let top = top_logprobs(&penalised, lse, p.top_count());
        let candidates = (p.temperature > 0.0 && m.is_finite()).then(|| candidates(&penalised, m, p));
        Distribution { penalised, lse, argmax, top, candidates }
    }

    /// The logprob of `token` (penalised, before temperature).
    pub fn logprob(&self, token: u32) -> f32 {
        self.penalised.get(token as usize).map_or(f32::NEG_INFINITY, |&l| (l as f64 - self.lse) as f32)
    }

    /// The token for a uniform `u` in [0, 1), its logprob and the reported
    /// alternatives.
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
        Sampled { token, logprob: self.logprob(token), top: self.top.clone() }
    }
}

/// One draw on the host for `state` (the default `decode_sample`, and the
/// engine's first token after a prefill); advances the state as a device
/// draw does.
pub fn sample_host(logits: &[f32], state: &mut SampleState) -> Sampled {
    let s = draw_host(logits, state);
    state.record_draw(s.token);
    s
}

/// The draw `sample_host` makes for `state`, leaving the state as it is (a
/// pure function of the logits and the state, so the draws of several
/// sequences may run on threads at once); `SampleState::record_draw` then
/// advances the state as `sample_host` does.
pub fn draw_host(logits: &[f32], state: &SampleState) -> Sampled {
    Distribution::new(logits, state).draw(philox_uniform(state.params.seed, state.step))
}

/// Order of weight (or logprob) descending, then id ascending; NaN sorts
/// last. A strict total order on distinct ids, so selecting by it is exact.
fn heavier_first(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(&b.0))
}

/// The `n` most likely ids of the penalised row as (id, logprob), most
/// likely first.
fn top_logprobs(penalised: &[f32], lse: f64, n: usize) -> Vec<(u32, f32)> {
    let n = n.min(penalised.len());
    if n == 0 {
        return Vec::new();
    }
    let mut all: Vec<(u32, f32)> = penalised.iter().enumerate().map(|(i, &l)| (i as u32, (l as f64 - lse) as f32)).collect();
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, heavier_first);
        all.truncate(n);
    }
    all.sort_unstable_by(heavier_first);
    all
}

/// The candidates of a sampled draw (see the file comment, step 5), in id
/// order; `m` is the largest penalised logit (finite).
fn candidates(penalised: &[f32], m: f32, p: &SampleParams) -> Vec<(u32, f32)> {
    let inv_t = 1.0 / p.temperature;
    let k = p.top_k as usize;
    let mut cand = if k > 0 && k < penalised.len() && k <= ONE_PASS_TOP_K {
        heaviest_k(penalised, m, inv_t, p.min_p, k)
    } else {
        let mut cand = weighed(penalised, m, inv_t, p.min_p);
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, heavier_first);
            cand.truncate(k);
            cand.sort_unstable_by_key(|c| c.0);
        }
        cand
    };
    if p.top_p < 1.0 && !cand.is_empty() {
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        let target = p.top_p as f64 * total;
        // Only the heaviest tokens are sorted when they reach the target
        // already; the kept set is the same as with a full sort.
        let head = TOP_P_HEAD.min(cand.len());
        if head < cand.len() {
            cand.select_nth_unstable_by(head - 1, heavier_first);
        }
        cand[..head].sort_unstable_by(heavier_first);
        let keep = match mass_prefix(&cand[..head], target) {
            Some(n) => n,
            None => {
                cand.sort_unstable_by(heavier_first);
                mass_prefix(&cand, target).unwrap_or(cand.len())
            }
        };
        cand.truncate(keep);
        cand.sort_unstable_by_key(|c| c.0);
    }
    cand
}

/// The weight of a penalised logit `l` (`m` the largest, `inv_t` = 1 / T):
/// exp((l - m) / T), NaN taken as 0.
fn weight(l: f32, m: f32, inv_t: f32) -> f32 {
    weight_of_scaled((l - m) * inv_t)
}

/// exp(x) for a scaled logit x = (l - m) / T, NaN taken as 0.
fn weight_of_scaled(x: f32) -> f32 {
    let e = x.exp();
    if e.is_nan() {
        0.0
    } else {
        e
    }
}

/// Every id that survives min-p (w > 0, w >= min_p) with its weight, in id
/// order.
fn weighed(penalised: &[f32], m: f32, inv_t: f32, min_p: f32) -> Vec<(u32, f32)> {
    penalised.iter().enumerate().map(|(i, &l)| (i as u32, weight(l, m, inv_t))).filter(|&(_, w)| w > 0.0 && w >= min_p).collect()
}

/// The `k` heaviest of `weighed(..)` (weight descending, then id
/// ascending), in id order: the same set as selecting them from the whole
/// list, found in one pass that keeps the `k` best so far and skips the
/// exponential of a logit that cannot enter. Ids arrive in ascending order,
/// so one that only ties the weakest kept weight never displaces it (the
/// lower id wins a tie), and a logit whose scaled value lies clearly below
/// the weakest kept one's (by far more than exp's rounding, while that
/// weight is a normal float) has a strictly smaller weight. The first
/// token of every request draws on the host through this.
fn heaviest_k(penalised: &[f32], m: f32, inv_t: f32, min_p: f32, k: usize) -> Vec<(u32, f32)> {
    // (id, weight, scaled logit), at most k; `weakest` indexes the one the
    // next entrant must beat.
    let mut kept: Vec<(u32, f32, f32)> = Vec::with_capacity(k);
    let mut weakest = 0usize;
    // Skip threshold on the scaled logit, valid while the weakest kept
    // weight is normal (its scaled logit above -80): NEG_INFINITY = none.
    let mut skip_below = f32::NEG_INFINITY;
    // Blocks of SKIP_BLOCK entries: a block whose largest entry is below the
    // threshold is skipped at once ((l - m) * inv_t is monotonic in l for
    // inv_t > 0, so that entry decides for the block, and a NaN entry would
    // be skipped anyway); the block maximum is a vectorised pass, the
    // per-entry test a branch.
    for (bi, block) in penalised.chunks(SKIP_BLOCK).enumerate() {
        if skip_below > f32::NEG_INFINITY && (max_lanes(block) - m) * inv_t < skip_below {
            continue;
        }
        for (j, &l) in block.iter().enumerate() {
            let i = bi * SKIP_BLOCK + j;
            let x = (l - m) * inv_t;
            if x < skip_below {
                continue;
            }
            let w = weight_of_scaled(x);
            if !(w > 0.0 && w >= min_p) {
                continue;
            }
            let entry = (i as u32, w, x);
            if kept.len() < k {
                kept.push(entry);
                if kept.len() < k {
                    continue;
                }
            } else if heavier_first(&(entry.0, entry.1), &(kept[weakest].0, kept[weakest].1)) == Ordering::Less {
                kept[weakest] = entry;
            } else {
                continue;
            }
            weakest = (0..kept.len()).max_by(|&a, &b| heavier_first(&(kept[a].0, kept[a].1), &(kept[b].0, kept[b].1))).unwrap_or(0);
            let xw = kept[weakest].2;
            skip_below = if xw > -80.0 { xw - 1e-4 * xw.abs().max(1.0) } else { f32::NEG_INFINITY };
        }
    }
    let mut out: Vec<(u32, f32)> = kept.into_iter().map(|(id, w, _)| (id, w)).collect();
    out.sort_unstable_by_key(|c| c.0);
    out
}

/// Length of the shortest prefix of `sorted` whose mass reaches `target`.
fn mass_prefix(sorted: &[(u32, f32)], target: f64) -> Option<usize> {
    let mut acc = 0.0f64;
    sorted
        .iter()
        .position(|c| {
            acc += c.1 as f64;
            acc >= target
        })
        .map(|i| i + 1)
}

/// Index of the largest value, NaN never winning (ties: lowest id).
fn first_max(values: &[f32]) -> u32 {
    // The largest non-NaN value (`f32::max` skips NaN), then its first
    // index: two passes the compiler vectorises, ~4x faster than one with a
    // data-dependent branch per entry over a 248,320-entry row. All NaN (or
    // empty): 0.
    let m = max_lanes(values);
    values.iter().position(|&v| v == m).unwrap_or(0) as u32
}

/// Lanes of the vectorised maxima below.
const MAX_LANES: usize = 16;
/// Entries `heaviest_k` tests against its threshold at once.
const SKIP_BLOCK: usize = 256;

/// The largest non-NaN value of `values` (NEG_INFINITY when none).
fn max_lanes(values: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; MAX_LANES];
    let chunks = values.chunks_exact(MAX_LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    rest.iter().fold(acc.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a)), |m, &v| m.max(v))
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
mod tests;
