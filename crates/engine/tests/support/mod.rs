//! A fake, deterministic `Backend` for the engine tests, and helpers.
//!
//! The fake keeps each sequence's consumed tokens as its "state" and derives
//! logits from them, so a wrongly restored or truncated state changes the
//! output. It records every call (alloc/fork/free counts, prefill chunk
//! lengths, decode batch sizes) in a `Probe` the test keeps a handle to, can
//! sleep per call to make timing visible, samples in `decode_sample` (with
//! `lily_model`'s host math) and counts the calls that hand logits back, fails any call that touches a
//! "poison" token, to test fault isolation, and can share one token pool
//! among all sequences (snapshots included), as the CUDA backend shares its
//! KV blocks, to test running out of memory.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use lily_core::tokenizer::Tokenizer;
use lily_core::ModelConfig;
use lily_engine::{Event, FinishReason, RequestStream};
use lily_model::sample::sample_host;
use lily_model::{
    Backend, KvRoom, LogitsWanted, ModelError, ModelResult, SampleParams, SampleState, Sampled,
    SeqId,
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
    Prefill { seq: SeqId, tokens: usize },
    Decode { batch: usize },
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
    fn pool_room(&self, extra: usize) -> ModelResult<()> {
        let Some(n) = self.pool else {
            return Ok(());
        };
        let used = self.pool_used();
        if used + extra > n {
            self.lock().pool_refusals += 1;
            return Err(ModelError::Capacity(format!(
                "token pool full: {used} held + {extra} needed > {n}"
            )));
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
                        let x = (h ^ j.wrapping_mul(0x9e3779b97f4a7c15))
                            .wrapping_mul(0xbf58476d1ce4e5b9);
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
        let h = self
            .seqs
            .get(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        if let Some(p) = self.poison {
            if tokens.contains(&p) || h.contains(&p) {
                return Err(ModelError::Device(format!("poisoned token {p}")));
            }
        }
        if h.len() + tokens.len() > self.max_seq {
            return Err(ModelError::Capacity(format!(
                "sequence {seq:?} would exceed {}",
                self.max_seq
            )));
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
        Some(KvRoom {
            free_tokens: n.saturating_sub(self.pool_used()),
            total_tokens: n,
            block_tokens: 1,
        })
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
        if self.seqs.remove(&seq).is_some() {
            let mut p = self.lock();
            p.live -= 1;
            p.frees += 1;
        }
    }
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId> {
        let h = self
            .seqs
            .get(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?
            .clone();
        if self.seqs.len() >= self.max_seqs {
            return Err(ModelError::Capacity("no free sequence".into()));
        }
        self.pool_room(h.len())?;
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(id, h);
        let mut p = self.lock();
        p.live += 1;
        p.forks += 1;
        Ok(id)
    }
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
        self.seqs
            .get(&seq)
            .map(Vec::len)
            .ok_or(ModelError::UnknownSequence(seq))
    }
    fn prefill(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> ModelResult<Vec<Vec<f32>>> {
        self.pass_gate();
        std::thread::sleep(self.delay);
        self.check(seq, tokens)?;
        if tokens.is_empty() {
            return Err(ModelError::Invalid("empty prefill".into()));
        }
        self.pool_room(tokens.len())?;
        self.lock().calls.push(Call::Prefill {
            seq,
            tokens: tokens.len(),
        });
        let start = self.seqs[&seq].len();
        let h = self
            .seqs
            .get_mut(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        h.extend_from_slice(tokens);
        let h = h.clone();
        Ok(match wanted {
            LogitsWanted::Last => vec![self.logits(&h)],
            LogitsWanted::All => (start + 1..=h.len())
                .map(|n| self.logits(&h[..n]))
                .collect(),
        })
    }
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        self.lock().logits_decodes += 1;
        self.decode_rows(batch)
    }
    fn decode_sample(
        &mut self,
        batch: &[(SeqId, u32)],
        states: &mut [SampleState],
    ) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid("one sampling state per entry".into()));
        }
        let rows = self.decode_rows(batch)?;
        self.lock().last_params = states.iter().map(|s| s.params).collect();
        Ok(rows
            .iter()
            .zip(states.iter_mut())
            .map(|(l, s)| sample_host(l, s))
            .collect())
    }
}

impl Fake {
    /// One decode step's logits (what `decode` returns).
    fn decode_rows(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
        self.pass_gate();
        std::thread::sleep(self.delay);
        // Check everything first: a failed batch leaves every state as it was.
        for &(seq, t) in batch {
            self.check(seq, &[t])?;
        }
        self.pool_room(batch.len())?;
        self.lock().calls.push(Call::Decode { batch: batch.len() });
        let mut out = Vec::with_capacity(batch.len());
        for &(seq, t) in batch {
            let h = self
                .seqs
                .get_mut(&seq)
                .ok_or(ModelError::UnknownSequence(seq))?;
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
    TOK.get_or_init(|| Arc::new(Tokenizer::embedded().expect("embedded tokenizer")))
        .clone()
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
        Some(Event::Started {
            prompt_tokens,
            cached_tokens,
        }) => Collected {
            started: Some((prompt_tokens, cached_tokens)),
            ..Collected::default()
        },
        other => panic!("expected Started first, got {other:?}"),
    }
}

/// `collect` continued from what was already read into `c`.
pub fn collect_rest(mut s: RequestStream, mut c: Collected) -> Collected {
    while let Some(ev) = s.blocking_recv() {
        assert!(
            c.finish.is_none() && c.failed.is_none(),
            "event after the final one: {ev:?}"
        );
        match ev {
            Event::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                assert!(c.started.is_none(), "two Started events");
                c.started = Some((prompt_tokens, cached_tokens));
            }
            Event::Token { id, text, logprob } => {
                assert!(c.started.is_some(), "token before Started");
                c.ids.push(id);
                c.text.push_str(&text);
                c.logprobs.push(logprob);
            }
            Event::Finished {
                reason,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                c.finish = Some(reason);
                c.completion_tokens = completion_tokens;
                c.cached_tokens = cached_tokens;
            }
            Event::Failed(e) => c.failed = Some(e),
        }
    }
    assert!(
        c.finish.is_some() || c.failed.is_some(),
        "stream ended without Finished or Failed: {c:?}"
    );
    c
}

/// Text of ids as the tokenizer decodes them.
pub fn decode(ids: &[u32]) -> String {
    tokenizer().decode(ids).expect("decode")
}
