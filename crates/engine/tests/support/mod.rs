//! A fake, deterministic `Backend` for the engine tests, and helpers.
//!
//! The fake keeps each sequence's consumed tokens as its "state" and derives
//! logits from them, so a wrongly restored or truncated state changes the
//! output. It records every call (alloc/fork/free counts, prefill chunk
//! lengths, decode batch sizes) in a `Probe` the test keeps a handle to, can
//! sleep per call to make timing visible, samples in `decode_sample` (with
//! `lily_model`'s host math) and counts the calls that hand logits back,
//! can pipeline decode steps as a device does (`pipelined`: draws kept
//! until collected, `Feed::Previous` from its own record, counts mirrored)
//! while checking the engine keeps the pipelining contract, say what
//! `Backend::mixed_steps` says (`mixed`), fails any call that touches a
//! "poison" token, to test fault isolation, and can share one token pool
//! among all sequences (snapshots included), as the CUDA backend shares its
//! KV blocks, to test running out of memory.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use lily_core::tokenizer::Tokenizer;
use lily_core::ModelConfig;
use lily_engine::{Event, FinishReason, RequestStream};
use lily_model::sample::{philox_uniform, sample_host, Distribution};
use lily_model::{
    Backend, CapturePart, CapturedDraws, Feed, InFlight, KvRoom, LogitsWanted, MixedSteps, ModelError, ModelResult, SampleParams, SampleState, Sampled, SeqId,
    MAX_IN_FLIGHT,
};

pub const VOCAB: usize = 256;
pub const EOS: u32 = 255;
/// Token ids of 'a'..'z' in the Qwen vocabulary start here.
pub const A: u32 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The next token is (last + 1) % VOCAB by a wide margin.
    Count,
    /// Logits are pseudo-random in [0, 3) from a hash of the whole history
    /// and its length (EOS excluded): any state error changes the output.
    Hash,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Prefill {
        seq: SeqId,
        tokens: usize,
    },
    /// One `prefill_batch` call run as one pass (`batched_prefill`): each
    /// part's sequence and token count.
    PrefillBatch {
        parts: Vec<(SeqId, usize)>,
    },
    Decode {
        batch: usize,
    },
    /// A pipelined step collected.
    Collect {
        batch: usize,
    },
    /// A call refused because the token pool was full.
    Refused(&'static str),
}

#[derive(Default, Debug)]
pub struct Probe {
    pub live: usize,
    pub allocs: usize,
    pub forks: usize,
    pub frees: usize,
    pub calls: Vec<Call>,
    /// Calls refused because the token pool was full.
    pub pool_refusals: usize,
    /// `decode` calls (logits handed back to the engine for a decode step).
    pub logits_decodes: usize,
    /// The sampling parameters of the last `decode_sample` batch.
    pub last_params: Vec<SampleParams>,
    /// Every token fed by a decode step, with its sequence.
    pub fed: Vec<(SeqId, u32)>,
    /// Breaches of the pipelining contract by the engine.
    pub violations: Vec<String>,
    /// First tokens drawn in `prefill_capture_sampling` (`draws_first`).
    pub first_draws: usize,
}

/// Decode steps in flight, as a device would hold them.
#[derive(Default)]
struct Pipe {
    /// (ticket, each entry's sequence and draw), oldest first.
    steps: VecDeque<(u64, Vec<(SeqId, Sampled)>)>,
    next_ticket: u64,
    /// Each sequence's last draw, which `Feed::Previous` feeds.
    last: HashMap<SeqId, u32>,
}

pub struct Fake {
    config: ModelConfig,
    mode: Mode,
    max_seq: usize,
    max_seqs: usize,
    delay: Duration,
    poison: Option<u32>,
    pool: Option<usize>,
    gate: Option<Arc<Mutex<()>>>,
    pipe: Option<Pipe>,
    batch_prefill: bool,
    draws_first: bool,
    mixed: MixedSteps,
    seqs: HashMap<SeqId, Vec<u32>>,
    next: u64,
    probe: Arc<Mutex<Probe>>,
}

impl Fake {
    pub fn new(mode: Mode) -> (Self, Arc<Mutex<Probe>>) {
        let mut config = lily_core::config::production();
        config.vocab_size = VOCAB;
        config.eos_token_ids = vec![EOS];
        let probe = Arc::new(Mutex::new(Probe::default()));
        let fake = Fake {
            config,
            mode,
            max_seq: 4096,
            max_seqs: 64,
            delay: Duration::ZERO,
            poison: None,
            pool: None,
            gate: None,
            pipe: None,
            batch_prefill: false,
            draws_first: false,
            mixed: MixedSteps::Never,
            seqs: HashMap::new(),
            next: 1,
            probe: probe.clone(),
        };
        (fake, probe)
    }

    pub fn max_seq(mut self, n: usize) -> Self {
        self.max_seq = n;
        self
    }

    pub fn max_seqs(mut self, n: usize) -> Self {
        self.max_seqs = n;
        self
    }

    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }

    pub fn poison(mut self, t: u32) -> Self {
        self.poison = Some(t);
        self
    }

    /// At most `n` tokens held by all live sequences together (a fork
    /// holds a copy of its source's tokens). A prefill, decode or fork that
    /// would exceed it fails with `Capacity` and changes nothing, as the
    /// CUDA backend does when its KV blocks run out.
    pub fn kv_pool(mut self, n: usize) -> Self {
        self.pool = Some(n);
        self
    }

    /// Every prefill and decode first waits until `gate` is free, so a test
    /// holding it stops the engine inside its current step, e.g. to queue
    /// several requests that are then admitted in the same step.
    pub fn gate(mut self, gate: Arc<Mutex<()>>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Decode steps stay in flight until collected, as on a device: each
    /// is drawn at submit (from the counts the device would hold, the
    /// uncollected draws included) and handed out at collect, which records
    /// the draws in the caller's states. Freeing, prefilling or decoding
    /// a sequence some uncollected step computes on, more than
    /// `MAX_IN_FLIGHT` steps, collecting out of order and `Previous` for a
    /// sequence without a device draw are recorded as violations.
    pub fn pipelined(mut self) -> Self {
        self.pipe = Some(Pipe::default());
        self
    }

    /// `prefill_batch` runs as one call (recorded as one
    /// `Call::PrefillBatch`, one delay), all or nothing as the CUDA backend
    /// runs it; otherwise it is the trait's default, a `prefill` per part.
    pub fn batched_prefill(mut self) -> Self {
        self.batch_prefill = true;
        self
    }

    /// `prefill_capture_sampling` draws the first tokens itself (with
    /// `lily_model`'s host math, recording them in the states), as a
    /// device sampler does, for the parts on sequences of even id; it
    /// declines the others (a backend may decline any part), whose logits
    /// the engine draws from.
    pub fn draws_first(mut self) -> Self {
        self.draws_first = true;
        self
    }

    /// What `Backend::mixed_steps` says (at any context); `Never` unless
    /// set.
    pub fn mixed(mut self, said: MixedSteps) -> Self {
        self.mixed = said;
        self
    }

    fn in_flight(&self, seq: SeqId) -> bool {
        self.pipe.as_ref().is_some_and(|p| p.steps.iter().any(|(_, v)| v.iter().any(|(s, _)| *s == seq)))
    }

    fn violation(&self, what: String) -> ModelError {
        self.lock().violations.push(what.clone());
        ModelError::Invalid(what)
    }

    fn pass_gate(&self) {
        if let Some(g) = &self.gate {
            drop(g.lock().expect("gate lock"));
        }
    }

    /// Tokens held by all live sequences.
    fn pool_used(&self) -> usize {
        self.seqs.values().map(Vec::len).sum()
    }

    /// Refuses `extra` more tokens if the pool cannot hold them.
    fn pool_room(&self, extra: usize, op: &'static str) -> ModelResult<()> {
        let Some(n) = self.pool else {
            return Ok(());
        };
        let used = self.pool_used();
        if used + extra > n {
            let mut p = self.lock();
            p.pool_refusals += 1;
            p.calls.push(Call::Refused(op));
            drop(p);
            return Err(ModelError::Capacity(format!("token pool full: {used} held + {extra} needed > {n}")));
        }
        Ok(())
    }

    fn logits(&self, history: &[u32]) -> Vec<f32> {
        match self.mode {
            Mode::Count => {
                let mut l = vec![0.0; VOCAB];
                let last = history.last().copied().unwrap_or(0) as usize;
                l[(last + 1) % VOCAB] = 12.0;
                l
            }
            Mode::Hash => {
                let mut h: u64 = 0xcbf29ce484222325 ^ history.len() as u64;
                for &t in history {
                    h = (h ^ t as u64).wrapping_mul(0x100000001b3);
                }
                let mut l: Vec<f32> = (0..VOCAB as u64)
                    .map(|j| {
                        let x = (h ^ j.wrapping_mul(0x9e3779b97f4a7c15)).wrapping_mul(0xbf58476d1ce4e5b9);
                        let x = x ^ (x >> 31);
                        (x >> 40) as f32 / (1u64 << 24) as f32 * 3.0
                    })
                    .collect();
                // Never end early on EOS, so lengths are predictable.
                l[EOS as usize] = -1.0;
                l
            }
        }
    }

    fn check(&self, seq: SeqId, tokens: &[u32]) -> ModelResult<()> {
        let h = self.seqs.get(&seq).ok_or(ModelError::UnknownSequence(seq))?;
        if let Some(p) = self.poison {
            if tokens.contains(&p) || h.contains(&p) {
                return Err(ModelError::Device(format!("poisoned token {p}")));
            }
        }
        if h.len() + tokens.len() > self.max_seq {
            return Err(ModelError::Capacity(format!("sequence {seq:?} would exceed {}", self.max_seq)));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Probe> {
        self.probe.lock().expect("probe lock")
    }
}

impl Backend for Fake {
    fn name(&self) -> String {
        "fake".into()
    }
    fn kv_room(&self) -> Option<KvRoom> {
        let n = self.pool?;
        Some(KvRoom { free_tokens: n.saturating_sub(self.pool_used()), total_tokens: n, block_tokens: 1 })
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_seq_len(&self) -> usize {
        self.max_seq
    }
    fn max_sequences(&self) -> usize {
        self.max_seqs
    }
    fn alloc(&mut self) -> ModelResult<SeqId> {
        if self.seqs.len() >= self.max_seqs {
            return Err(ModelError::Capacity("no free sequence".into()));
        }
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(id, Vec::new());
        let mut p = self.lock();
        p.live += 1;
        p.allocs += 1;
        Ok(id)
    }
    fn free(&mut self, seq: SeqId) {
        if self.in_flight(seq) {
            self.violation(format!("{seq:?} freed while a step computes on it"));
        }
        if self.seqs.remove(&seq).is_some() {
            let mut p = self.lock();
            p.live -= 1;
            p.frees += 1;
        }
    }
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId> {
        let h = self.seqs.get(&seq).ok_or(ModelError::UnknownSequence(seq))?.clone();
        if self.seqs.len() >= self.max_seqs {
            return Err(ModelError::Capacity("no free sequence".into()));
        }
        self.pool_room(h.len(), "fork")?;
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(id, h);
        let mut p = self.lock();
        p.live += 1;
        p.forks += 1;
        Ok(id)
    }
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
        self.seqs.get(&seq).map(Vec::len).ok_or(ModelError::UnknownSequence(seq))
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>> {
        self.pass_gate();
        std::thread::sleep(self.delay);
        self.check(seq, tokens)?;
        if self.in_flight(seq) {
            return Err(self.violation(format!("{seq:?} prefilled while a step computes on it")));
        }
        if tokens.is_empty() {
            return Err(ModelError::Invalid("empty prefill".into()));
        }
        self.pool_room(tokens.len(), "prefill")?;
        self.lock().calls.push(Call::Prefill { seq, tokens: tokens.len() });
        let start = self.seqs[&seq].len();
        let h = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
        h.extend_from_slice(tokens);
        let h = h.clone();
        Ok(match wanted {
            LogitsWanted::Last => vec![self.logits(&h)],
            LogitsWanted::All => (start + 1..=h.len()).map(|n| self.logits(&h[..n])).collect(),
        })
    }
    fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
        if !self.batch_prefill {
            return lily_model::prefill_each(self, parts);
        }
        self.pass_gate();
        std::thread::sleep(self.delay);
        // Everything checked first: a refused batch changes nothing.
        for (i, &(seq, tokens)) in parts.iter().enumerate() {
            if parts[..i].iter().any(|p| p.0 == seq) {
                return Err(ModelError::Invalid(format!("{seq:?} twice in one prefill batch")));
            }
            if tokens.is_empty() {
                return Err(ModelError::Invalid("empty prefill".into()));
            }
            self.check(seq, tokens)?;
            if self.in_flight(seq) {
                return Err(self.violation(format!("{seq:?} prefilled while a step computes on it")));
            }
        }
        self.pool_room(parts.iter().map(|p| p.1.len()).sum(), "prefill_batch")?;
        self.lock().calls.push(Call::PrefillBatch { parts: parts.iter().map(|&(seq, t)| (seq, t.len())).collect() });
        let mut out = Vec::with_capacity(parts.len());
        for &(seq, tokens) in parts {
            let h = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
            h.extend_from_slice(tokens);
            let h = h.clone();
            out.push(self.logits(&h));
        }
        Ok(out)
    }
    fn prefill_capture_sampling(&mut self, parts: &[CapturePart], states: &mut [Option<SampleState>]) -> ModelResult<CapturedDraws> {
        if states.len() != parts.len() {
            return Err(ModelError::Invalid("one sampling state entry per part".into()));
        }
        let (mut rows, snaps) = self.prefill_capture(parts)?;
        let mut draws = Vec::with_capacity(parts.len());
        for ((row, st), part) in rows.iter_mut().zip(states.iter_mut()).zip(parts) {
            draws.push(match st {
                Some(st) if self.draws_first && part.0 .0 % 2 == 0 => {
                    let d = sample_host(row, st);
                    row.clear();
                    Some(d)
                }
                _ => None,
            });
        }
        self.lock().first_draws += draws.iter().flatten().count();
        Ok(((rows, snaps), draws))
    }
    fn mixed_steps(&self, _rows: usize) -> MixedSteps {
        self.mixed
    }
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        self.lock().logits_decodes += 1;
        self.decode_rows(batch, false)
    }
    fn decode_sample(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid("one sampling state per entry".into()));
        }
        let rows = self.decode_rows(batch, false)?;
        self.lock().last_params = states.iter().map(|s| s.params).collect();
        Ok(rows.iter().zip(states.iter_mut()).map(|(l, s)| sample_host(l, s)).collect())
    }

    fn submit_decode(&mut self, batch: &[(SeqId, Feed)], states: &mut [SampleState]) -> ModelResult<InFlight> {
        if self.pipe.is_none() {
            return self.submit_now(batch, states);
        }
        if states.len() != batch.len() {
            return Err(ModelError::Invalid("one sampling state per entry".into()));
        }
        let in_flight = self.pipe.as_ref().map_or(0, |p| p.steps.len());
        if in_flight >= MAX_IN_FLIGHT {
            return Err(self.violation(format!("a step submitted with {in_flight} in flight")));
        }
        let mut fed = Vec::with_capacity(batch.len());
        for &(seq, feed) in batch {
            let token = match feed {
                Feed::Token(t) => t,
                Feed::Previous => match self.pipe.as_ref().and_then(|p| p.last.get(&seq)) {
                    Some(&t) => t,
                    None => return Err(self.violation(format!("{seq:?} fed Previous without a draw"))),
                },
            };
            fed.push((seq, token));
        }
        let rows = self.decode_rows(&fed, true)?;
        let Some(pipe) = self.pipe.as_mut() else {
            return Err(ModelError::Invalid("not pipelined".into()));
        };
        let mut draws = Vec::with_capacity(batch.len());
        for ((&(seq, _), row), st) in batch.iter().zip(&rows).zip(states.iter_mut()) {
            // The device's counts: the host's plus the draws not collected.
            let mut device = st.clone();
            for (_, step) in &pipe.steps {
                for (s, d) in step {
                    if *s == seq {
                        device.accept(d.token);
                    }
                }
            }
            let n = st.begin_draw();
            let d = Distribution::new(row, &device).draw(philox_uniform(st.params.seed, n));
            pipe.last.insert(seq, d.token);
            draws.push((seq, d));
        }
        let ticket = pipe.next_ticket;
        pipe.next_ticket += 1;
        pipe.steps.push_back((ticket, draws));
        Ok(InFlight::Device { ticket, len: batch.len() })
    }

    fn collect_decode(&mut self, step: InFlight, states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        let ticket = match step {
            InFlight::Device { ticket, .. } if self.pipe.is_some() => ticket,
            InFlight::Ready(draws) if self.pipe.is_none() && draws.len() == states.len() => return Ok(draws),
            other => return Err(self.violation(format!("collected {other:?}"))),
        };
        let oldest = self.pipe.as_mut().and_then(|p| p.steps.pop_front());
        let Some((t, draws)) = oldest else {
            return Err(self.violation("collected with nothing in flight".into()));
        };
        if t != ticket || draws.len() != states.len() {
            return Err(self.violation(format!("collected step {ticket} with {} states; the oldest is {t} of {}", states.len(), draws.len())));
        }
        self.lock().calls.push(Call::Collect { batch: draws.len() });
        Ok(draws
            .into_iter()
            .zip(states.iter_mut())
            .map(|((_, d), st)| {
                st.end_draw(d.token);
                d
            })
            .collect())
    }
}

impl Fake {
    /// `Backend::submit_decode`'s default: the step runs now.
    fn submit_now(&mut self, batch: &[(SeqId, Feed)], states: &mut [SampleState]) -> ModelResult<InFlight> {
        let fed = batch
            .iter()
            .zip(states.iter())
            .map(|(&(seq, feed), st)| match feed {
                Feed::Token(t) => Ok((seq, t)),
                Feed::Previous => st.last_draw().map(|t| (seq, t)).ok_or_else(|| ModelError::Invalid("no previous draw".into())),
            })
            .collect::<ModelResult<Vec<_>>>()?;
        Ok(InFlight::Ready(self.decode_sample(&fed, states)?))
    }

    /// One decode step's logits (what `decode` returns). `pipelined`: a
    /// submitted step, which may feed sequences of the step in flight.
    fn decode_rows(&mut self, batch: &[(SeqId, u32)], pipelined: bool) -> ModelResult<Vec<Vec<f32>>> {
        if !pipelined {
            if let Some(&(seq, _)) = batch.iter().find(|(s, _)| self.in_flight(*s)) {
                return Err(self.violation(format!("{seq:?} decoded while a step computes on it")));
            }
        }
        self.pass_gate();
        std::thread::sleep(self.delay);
        // Check everything first: a failed batch leaves every state as it was.
        for &(seq, t) in batch {
            self.check(seq, &[t])?;
        }
        self.pool_room(batch.len(), "decode")?;
        let mut p = self.lock();
        p.calls.push(Call::Decode { batch: batch.len() });
        p.fed.extend_from_slice(batch);
        drop(p);
        let mut out = Vec::with_capacity(batch.len());
        for &(seq, t) in batch {
            let h = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
            h.push(t);
            let h = h.clone();
            out.push(self.logits(&h));
        }
        Ok(out)
    }
}

/// The real tokenizer, parsed once per test binary.
pub fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::embedded().expect("embedded tokenizer"))).clone()
}

/// Everything a request produced.
#[derive(Debug, Default)]
pub struct Collected {
    pub started: Option<(usize, usize)>,
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<Option<lily_engine::TokenLogprob>>,
    pub finish: Option<FinishReason>,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub failed: Option<lily_engine::EngineError>,
}

/// Reads a stream to its end (blocking; call off any runtime), checking
/// the event order contract on the way.
pub fn collect(s: RequestStream) -> Collected {
    collect_rest(s, Collected::default())
}

/// Waits for a stream's first event, which must be `Started` (the request
/// was admitted); `collect_rest` reads the rest.
pub fn wait_started(s: &mut RequestStream) -> Collected {
    match s.blocking_recv() {
        Some(Event::Started { prompt_tokens, cached_tokens }) => Collected { started: Some((prompt_tokens, cached_tokens)), ..Collected::default() },
        other => panic!("expected Started first, got {other:?}"),
    }
}

/// `collect` continued from what was already read into `c`.
pub fn collect_rest(mut s: RequestStream, mut c: Collected) -> Collected {
    while let Some(ev) = s.blocking_recv() {
        assert!(c.finish.is_none() && c.failed.is_none(), "event after the final one: {ev:?}");
        match ev {
            Event::Started { prompt_tokens, cached_tokens } => {
                assert!(c.started.is_none(), "two Started events");
                c.started = Some((prompt_tokens, cached_tokens));
            }
            Event::Token { id, text, logprob } => {
                assert!(c.started.is_some(), "token before Started");
                c.ids.push(id);
                c.text.push_str(&text);
                c.logprobs.push(logprob);
            }
            Event::Finished { reason, completion_tokens, cached_tokens, .. } => {
                c.finish = Some(reason);
                c.completion_tokens = completion_tokens;
                c.cached_tokens = cached_tokens;
            }
            Event::Failed(e) => c.failed = Some(e),
        }
    }
    assert!(c.finish.is_some() || c.failed.is_some(), "stream ended without Finished or Failed: {c:?}");
    c
}

/// Text of ids as the tokenizer decodes them.
pub fn decode(ids: &[u32]) -> String {
    tokenizer().decode(ids).expect("decode")
}
