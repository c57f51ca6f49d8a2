//! Continuous batching on the engine thread: which requests hold a backend
//! sequence, what each engine step runs, and how every accepted request ends.
//!
//! One step = reap (cancelled, disconnected, past deadline), admit waiting
//! requests while there is room, one decode batch over every request that is
//! generating, then at most `prefill_chunk` prompt tokens of prefill (oldest
//! request first, chunks cut at snapshot boundaries). So a long prompt is
//! prefilled over several steps while running streams keep getting a token
//! per step, and a new request joins the decode batch the step after its
//! prompt is done. Every accepted request gets exactly one `Finished` or
//! `Failed`; a backend error fails only the request(s) it concerns.
//!
//! KV memory (backends with a fixed pool, `Backend::kv_room`): a request
//! is admitted only when its prompt fits beside what admitted requests still
//! have to prefill, plus a block to grow into; otherwise it waits (snapshots
//! are evicted first). When decoding outgrows the pool anyway, snapshots go
//! first, then the youngest running request is preempted: its sequence is
//! freed and it waits, keeping its tokens and sampling state, to be recomputed
//! (prefilled again up to its last token) when memory is back, so the
//! client sees a pause, not an error. Only a request that could never fit
//! the whole pool fails.
//!
//! This file owns the requests and the order of work. It owns no threading
//! or queue (`engine.rs`), no token choice (`sampling.rs`), no text
//! handling (`text.rs`), no account of backend memory (which sequences are
//! held, what fits the KV pool, snapshots: `kv.rs`) and no cache policy
//! (`prefix_cache.rs`): it calls them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lily_core::tokenizer::Tokenizer;
use lily_model::sample::sample_host;
use lily_model::{Backend, LogitsWanted, ModelError, SampleParams, SampleState, Sampled, SeqId};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{
    EngineError, EngineOptions, Event, FinishReason, GenerateRequest, Shared, Submission,
};
use crate::kv::{model_error, work_error, Acquired, Age, KvFit, KvLedger};
use crate::prefix_cache::PrefixCache;
use crate::sampling::{logprob_report, request_seed, sample_params};
use crate::text::TextStream;

/// How a request left the running set.
enum Outcome {
    Finished(FinishReason),
    Failed(EngineError),
}

/// Which running request gave its KV memory back, and how.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Released {
    /// Preempted: still in `running` at this index, without a sequence.
    Paused(usize),
    /// Failed and removed from `running` (it was at this index).
    Failed(usize),
}

impl Released {
    fn index(self) -> usize {
        match self {
            Released::Paused(i) | Released::Failed(i) => i,
        }
    }
}

/// An admitted request (its backend sequence, if it holds one, is in the
/// ledger under its `age`).
struct Active {
    id: u64,
    age: Age,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    deadline: Option<Instant>,
    prompt_len: usize,
    max_tokens: usize,
    logprobs: Option<usize>,
    stop_ids: Vec<u32>,
    /// Parameters, random-stream position and penalty counts of its draws.
    sampling: SampleState,
    text: TextStream,
    /// The prompt followed by the generated tokens. The ledger's `fed`
    /// says how many of them the backend sequence has consumed: while
    /// prefilling, fewer than `target()`; while generating, all but the
    /// last (which the next decode feeds).
    tokens: Vec<u32>,
    cached_tokens: usize,
}

impl Active {
    /// Tokens the sequence holds before its next decode: the prompt for a
    /// new request; after a preemption, everything but the last sampled
    /// token (which the next decode feeds).
    fn target(&self) -> usize {
        if self.generated() == 0 {
            self.prompt_len
        } else {
            self.tokens.len() - 1
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

pub(crate) struct Scheduler {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    kv: KvLedger,
    /// Age of the next admitted request.
    next_age: Age,
    max_batch: usize,
    prefill_chunk: usize,
    eos: Vec<u32>,
    /// Ids at or above this have no text (the embedding is padded past the
    /// tokenizer); they are never drawn (`SampleParams::vocab_limit`).
    text_vocab: usize,
    waiting: VecDeque<Submission>,
    running: Vec<Active>,
}

impl Scheduler {
    pub(crate) fn new(
        backend: Box<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        opts: &EngineOptions,
        shared: Arc<Shared>,
    ) -> Self {
        let eos = backend.config().eos_token_ids.clone();
        let text_vocab = tokenizer.vocab_size();
        let cache = PrefixCache::new(
            opts.snapshot_interval,
            opts.prefix_cache_tokens,
            opts.prefix_cache_max_entries,
        );
        Scheduler {
            kv: KvLedger::new(backend.max_sequences(), cache),
            next_age: 0,
            backend,
            tokenizer,
            shared,
            max_batch: opts.max_batch.max(1),
            prefill_chunk: opts.prefill_chunk.max(1),
            eos,
            text_vocab,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub(crate) fn enqueue(&mut self, sub: Submission) {
        self.waiting.push_back(sub);
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// One engine step (see the file comment).
    pub(crate) fn step(&mut self) {
        self.reap();
        self.admit();
        self.decode_step();
        self.prefill_step();
        self.publish_gauges();
    }

    /// Fails every request (after a panic inside a step, whose state is
    /// unknown) and drops the cache; the engine then carries on.
    pub(crate) fn fail_all(&mut self, why: &str) {
        self.kv.clear(self.backend.as_mut());
        for a in std::mem::take(&mut self.running) {
            self.send_outcome_active(&a, Outcome::Failed(EngineError::Backend(why.to_string())));
        }
        self.publish_gauges();
    }

    /// Frees every snapshot (at shutdown).
    pub(crate) fn clear_cache(&mut self) {
        self.kv.clear_cache(self.backend.as_mut());
        self.publish_gauges();
    }

    fn publish_gauges(&self) {
        let running = self.running.len();
        let cache = &self.kv.cache;
        let (entries, held, evictions) = (cache.len(), cache.held_tokens(), cache.evictions());
        let kv = self
            .backend
            .kv_room()
            .map(|r| (r.free_tokens, r.total_tokens));
        self.shared.with_stats(|s| {
            s.running = running;
            s.kv_tokens = kv;
            s.prefix_cache_entries = entries;
            s.prefix_cache_held_tokens = held;
            s.prefix_cache_evictions = evictions;
        });
    }

    // ----- ending requests -------------------------------------------------

    /// Counts `outcome` in the stats and makes the request's final event;
    /// (prompt, completion, cached) tokens go into a `Finished`.
    fn final_event(&self, outcome: Outcome, tokens: (usize, usize, usize)) -> Event {
        let (prompt_tokens, completion_tokens, cached_tokens) = tokens;
        match outcome {
            Outcome::Finished(reason) => {
                self.shared.with_stats(|s| {
                    s.requests_finished += 1;
                    if matches!(reason, FinishReason::Cancelled) {
                        s.requests_cancelled += 1;
                    }
                });
                Event::Finished {
                    reason,
                    completion_tokens,
                    prompt_tokens,
                    cached_tokens,
                }
            }
            Outcome::Failed(e) => {
                self.shared.with_stats(|s| s.requests_failed += 1);
                Event::Failed(e)
            }
        }
    }

    fn send_outcome_active(&self, a: &Active, outcome: Outcome) {
        if let Outcome::Failed(e) = &outcome {
            tracing::warn!(request = a.id, error = %e, "request failed");
        }
        let event = self.final_event(outcome, (a.prompt_len, a.generated(), a.cached_tokens));
        // The receiver may be gone (cancelled); nothing to tell then.
        let _ = a.events.send(event);
    }

    /// Ends a waiting request that never got a sequence.
    fn end_waiting(&self, sub: Submission, outcome: Outcome) {
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let event = self.final_event(outcome, (sub.req.prompt.len(), 0, 0));
        let _ = sub.events.send(event);
    }

    /// Removes running request `i` (keeping admission order, which the
    /// prefill queue relies on), frees its sequence and sends its end.
    fn retire(&mut self, i: usize, outcome: Outcome) {
        let a = self.running.remove(i);
        self.kv.release(self.backend.as_mut(), a.age);
        // Gauges first, so a caller that reads stats after the final event
        // sees this request gone.
        self.publish_gauges();
        self.send_outcome_active(&a, outcome);
    }

    /// Cancelled, disconnected and expired requests leave before any work
    /// is spent on them.
    fn reap(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let a = &self.running[i];
            let reason = if a.cancel.load(Ordering::SeqCst) || a.events.is_closed() {
                Some(FinishReason::Cancelled)
            } else if a.deadline.is_some_and(|d| now >= d) {
                Some(FinishReason::Deadline)
            } else {
                None
            };
            match reason {
                Some(r) => self.retire(i, Outcome::Finished(r)),
                None => i += 1,
            }
        }
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        for sub in std::mem::take(&mut self.waiting) {
            if sub.cancel.load(Ordering::SeqCst) || sub.events.is_closed() {
                self.end_waiting(sub, Outcome::Finished(FinishReason::Cancelled));
            } else if sub.req.deadline.is_some_and(|d| now >= d) {
                self.end_waiting(sub, Outcome::Finished(FinishReason::Deadline));
            } else {
                keep.push_back(sub);
            }
        }
        self.waiting = keep;
    }

    // ----- admission -------------------------------------------------------

    fn admit(&mut self) {
        // Preempted requests first, oldest first: they were admitted before
        // anything that is waiting, and nothing overtakes them.
        let mut i = 0;
        while i < self.running.len() {
            let a = &self.running[i];
            if self.kv.holding(a.age).is_some() {
                i += 1;
                continue;
            }
            let target = a.target();
            match self.kv.acquire(self.backend.as_mut(), &a.tokens, target) {
                Acquired::Go(seq, cached) => {
                    tracing::debug!(request = a.id, cached, "resumed after preemption");
                    self.kv.hold(a.age, seq, cached, target);
                    i += 1;
                }
                Acquired::Wait => return,
                Acquired::Fail(e) => self.retire(i, Outcome::Failed(e)),
            }
        }
        while self.running.len() < self.max_batch {
            let Some(sub) = self.waiting.pop_front() else {
                break;
            };
            let target = sub.req.prompt.len();
            let outcome = match self
                .kv
                .acquire(self.backend.as_mut(), &sub.req.prompt, target)
            {
                Acquired::Wait => {
                    self.waiting.push_front(sub);
                    break;
                }
                Acquired::Go(seq, cached) => Ok((seq, cached)),
                Acquired::Fail(e) => Err(e),
            };
            // One lookup per request that got an answer.
            let lookups = u64::from(self.kv.cache.enabled());
            self.shared
                .with_stats(|s| s.prefix_cache_lookups += lookups);
            match outcome {
                Ok((seq, cached)) => self.start(sub, seq, cached),
                Err(e) => self.end_waiting(sub, Outcome::Failed(e)),
            }
        }
    }

    fn start(&mut self, sub: Submission, seq: SeqId, cached: usize) {
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let Submission {
            id,
            req,
            events,
            cancel,
        } = sub;
        let GenerateRequest {
            prompt,
            max_tokens,
            sampling,
            stop_strings,
            stop_token_ids,
            logprobs,
            deadline,
        } = req;
        let prompt_len = prompt.len();
        let mut stop_ids = self.eos.clone();
        stop_ids.extend(stop_token_ids);
        let age = self.next_age;
        self.next_age += 1;
        let a = Active {
            id,
            age,
            cancel,
            deadline,
            prompt_len,
            max_tokens,
            logprobs,
            stop_ids,
            sampling: SampleState::new(
                sample_params(
                    &sampling,
                    request_seed(&sampling),
                    logprobs,
                    self.text_vocab,
                ),
                &prompt,
            ),
            text: TextStream::new(self.tokenizer.stream_decoder(), stop_strings),
            tokens: prompt,
            cached_tokens: cached,
            events,
        };
        self.shared.with_stats(|s| {
            s.prompt_tokens += prompt_len as u64;
            if cached > 0 {
                s.prefix_cache_hits += 1;
                s.prefix_cache_tokens += cached as u64;
            }
        });
        tracing::debug!(request = id, prompt = prompt_len, cached, "admitted");
        if a.events
            .send(Event::Started {
                prompt_tokens: prompt_len,
                cached_tokens: cached,
            })
            .is_err()
        {
            self.backend.free(seq);
            self.send_outcome_active(&a, Outcome::Finished(FinishReason::Cancelled));
            return;
        }
        self.kv.hold(age, seq, cached, prompt_len);
        self.running.push(a);
    }

    // ----- work ------------------------------------------------------------

    fn decode_step(&mut self) {
        let (idx, batch): (Vec<usize>, Vec<(SeqId, u32)>) = self
            .running
            .iter()
            .enumerate()
            .filter_map(|(i, a)| {
                let h = self.kv.holding(a.age).filter(|h| !h.prefilling())?;
                Some((i, (h.seq, a.tokens[h.fed])))
            })
            .unzip();
        if idx.is_empty() {
            return;
        }
        // One call samples every sequence (on the device where the backend
        // can); the states are lent to it and put back.
        let mut states: Vec<SampleState> = idx.iter().map(|&i| self.lend_state(i)).collect();
        let decoded = self.kv.evicting(self.backend.as_mut(), |b| {
            b.decode_sample(&batch, &mut states)
        });
        for (&i, st) in idx.iter().zip(states) {
            self.running[i].sampling = st;
        }
        // One result per entry of `idx`, except that the isolation below may
        // have preempted or failed the youngest entries: `results` then
        // covers a prefix of `idx`, still valid as indices into `running`.
        let results: Vec<Result<Sampled, EngineError>> = match decoded {
            Ok(rows) if rows.len() == batch.len() => rows.into_iter().map(Ok).collect(),
            Ok(rows) => {
                let e = EngineError::Backend(format!(
                    "decode returned {} tokens for a batch of {}",
                    rows.len(),
                    batch.len()
                ));
                vec![Err(e); batch.len()]
            }
            Err(e) => self.isolate_decode_failure(&idx, &batch, e),
        };
        self.shared.with_stats(|s| {
            s.decode_steps += 1;
            if s.decode_batch_sizes.len() <= batch.len() {
                s.decode_batch_sizes.resize(batch.len() + 1, 0);
            }
            s.decode_batch_sizes[batch.len()] += 1;
        });
        // Retire from the back so earlier indices stay valid.
        let mut ends: Vec<(usize, Outcome)> = Vec::new();
        for (&i, res) in idx.iter().zip(results) {
            match res {
                Ok(picked) => {
                    if let Some(h) = self.kv.holding_mut(self.running[i].age) {
                        h.fed += 1;
                    }
                    self.maybe_snapshot(i);
                    if let Some(o) = self.emit(i, picked) {
                        ends.push((i, o));
                    }
                }
                Err(e) => ends.push((i, Outcome::Failed(e))),
            }
        }
        ends.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, o) in ends {
            self.retire(i, o);
        }
    }

    /// A batched decode failed (after snapshots were evicted for it, if it
    /// was out of memory). Sequences the backend left untouched are retried
    /// one by one in admission order, so a fault in one request fails only
    /// that one; a sequence whose length moved (state unknown) fails.
    ///
    /// Out of memory is settled by age: when an entry still gets no memory
    /// and no snapshot is left, the youngest request holding a sequence is
    /// preempted (`release_youngest`), freeing its KV blocks, and the entry
    /// is retried; it is preempted itself only when it is the youngest.
    /// Older requests are thus served first and only as many of the
    /// youngest pause as the pool requires. Pausing just the entries that
    /// asked would be worse: with the pool exactly full every entry asks,
    /// although one request's memory is enough for the rest; and a younger
    /// request still prefilling a long prompt would hold on to memory the
    /// older ones need.
    ///
    /// Returns results for a prefix of `idx`; the entries past it were
    /// preempted (or failed) here. Only the youngest holders are touched,
    /// so the indices of the prefix stay valid.
    fn isolate_decode_failure(
        &mut self,
        idx: &[usize],
        batch: &[(SeqId, u32)],
        err: ModelError,
    ) -> Vec<Result<Sampled, EngineError>> {
        tracing::warn!(batch = batch.len(), error = %err, "batched decode failed; retrying sequences one by one");
        // A lone sequence's fault is its own; out of memory may still be
        // settled by a younger request that is prefilling.
        if batch.len() == 1 && !matches!(err, ModelError::Capacity(_)) {
            return vec![Err(model_error(err))];
        }
        let mut out = Vec::with_capacity(batch.len());
        // Entries `out.len()..end` are still to be decoded.
        let mut end = batch.len();
        while out.len() < end {
            let k = out.len();
            let (seq, tok) = batch[k];
            let fed = self.kv.holding(self.running[idx[k]].age).map(|h| h.fed);
            match self.backend.seq_len(seq) {
                Ok(n) if Some(n) == fed => {}
                Ok(_) => {
                    out.push(Err(model_error(ModelError::Device(format!(
                        "batched decode failed part-way: {err}"
                    )))));
                    continue;
                }
                Err(e) => {
                    out.push(Err(model_error(e)));
                    continue;
                }
            }
            let mut state = [self.lend_state(idx[k])];
            let r = self.kv.evicting(self.backend.as_mut(), |b| {
                b.decode_sample(&[(seq, tok)], &mut state)
            });
            let [state] = state;
            self.running[idx[k]].sampling = state;
            match r {
                Ok(mut rows) if rows.len() == 1 => out.push(Ok(rows.remove(0))),
                Ok(rows) => out.push(Err(EngineError::Backend(format!(
                    "decode returned {} tokens for one sequence",
                    rows.len()
                )))),
                Err(ModelError::Capacity(m)) => {
                    // The youngest holder gives its memory back: a
                    // prefilling one, the youngest entry still waiting in
                    // this batch, or entry `k` itself. Entries already
                    // decoded are older than `k`, so never chosen.
                    let Some(youngest) = self.release_youngest(&m).map(Released::index) else {
                        out.push(Err(work_error(ModelError::Capacity(m))));
                        continue;
                    };
                    if idx[end - 1] == youngest {
                        end -= 1;
                    }
                }
                Err(e) => out.push(Err(model_error(e))),
            }
        }
        out
    }

    /// Frees the KV memory of the youngest request holding a sequence: it
    /// is preempted (waits, tokens and sampling state kept, to be recomputed when
    /// memory is back), or failed when even the empty pool could not hold
    /// it. `None` when no request holds a sequence.
    fn release_youngest(&mut self, why: &str) -> Option<Released> {
        let age = self.kv.youngest()?;
        let v = self.running.binary_search_by_key(&age, |a| a.age).ok()?;
        let target = self.running[v].target();
        let never = matches!(
            self.kv.fits(self.backend.as_ref(), target, 0),
            KvFit::Never(_)
        );
        if never || self.kv.holders() == 1 {
            // Nobody else holds memory to give back: it cannot fit at all.
            let e = EngineError::Capacity(format!(
                "KV cache full: this request needs more KV memory than the whole pool ({why})"
            ));
            self.retire(v, Outcome::Failed(e));
            return Some(Released::Failed(v));
        }
        let a = &self.running[v];
        self.kv.release(self.backend.as_mut(), a.age);
        tracing::info!(
            request = a.id,
            tokens = a.tokens.len(),
            "out of KV memory: preempted, will be recomputed"
        );
        self.shared.with_stats(|s| s.preemptions += 1);
        Some(Released::Paused(v))
    }

    fn prefill_step(&mut self) {
        let mut budget = self.prefill_chunk;
        let mut i = 0;
        // Oldest admitted first (`running` is in admission order).
        while budget > 0 && i < self.running.len() {
            let a = &self.running[i];
            let Some((seq, start, target)) = self
                .kv
                .holding(a.age)
                .filter(|h| h.prefilling())
                .map(|h| (h.seq, h.fed, h.prefill_to))
            else {
                i += 1;
                continue;
            };
            let end = self
                .kv
                .chunk_end(&a.tokens, a.prompt_len, start, target.min(start + budget));
            let chunk = &self.running[i].tokens[start..end];
            let result = self.kv.evicting(self.backend.as_mut(), |b| {
                b.prefill(seq, chunk, LogitsWanted::Last)
            });
            let outcome = match result {
                // Out of memory with every snapshot evicted: the youngest
                // holder gives its memory back (this request, or a younger
                // one; then this chunk is tried again).
                Err(ModelError::Capacity(m)) => {
                    match self.release_youngest(&m) {
                        // This one paused: on to the next.
                        Some(Released::Paused(v)) if v == i => i += 1,
                        // This one failed (and left `running`, so `i` is
                        // already the next), or a younger one gave way and
                        // this chunk is tried again.
                        Some(_) => {}
                        None => {
                            self.retire(i, Outcome::Failed(work_error(ModelError::Capacity(m))))
                        }
                    }
                    continue;
                }
                Err(e) => Some(Outcome::Failed(work_error(e))),
                Ok(mut rows) => {
                    budget -= end - start;
                    self.shared
                        .with_stats(|s| s.prefill_tokens += (end - start) as u64);
                    if let Some(h) = self.kv.holding_mut(self.running[i].age) {
                        h.fed = end;
                    }
                    self.maybe_snapshot(i);
                    if end < target {
                        None
                    } else if self.running[i].generated() > 0 {
                        // Recomputed after a preemption up to its last
                        // token: it goes on decoding; these logits were
                        // sampled from already.
                        None
                    } else {
                        match rows.pop() {
                            Some(logits) => {
                                // The first token, on the host with the
                                // same math as every later one.
                                let picked = sample_host(&logits, &mut self.running[i].sampling);
                                self.emit(i, picked)
                            }
                            None => Some(Outcome::Failed(EngineError::Backend(
                                "prefill returned no logits".into(),
                            ))),
                        }
                    }
                }
            };
            match outcome {
                Some(o) => self.retire(i, o),
                None => i += 1,
            }
        }
    }

    /// Offers the prefix cache a snapshot of request `i`'s sequence.
    fn maybe_snapshot(&mut self, i: usize) {
        let a = &self.running[i];
        self.kv
            .maybe_snapshot(self.backend.as_mut(), a.age, &a.tokens, a.prompt_len);
    }

    /// Takes request `i`'s sampling state for a backend call; the caller
    /// puts it back (the placeholder left meanwhile allocates nothing).
    fn lend_state(&mut self, i: usize) -> SampleState {
        let placeholder = SampleState::new(SampleParams::default(), &[]);
        std::mem::replace(&mut self.running[i].sampling, placeholder)
    }

    /// Emits request `i`'s drawn token (already recorded in its sampling
    /// state) and says whether the request ends.
    fn emit(&mut self, i: usize, picked: Sampled) -> Option<Outcome> {
        let token = picked.token;
        self.running[i].tokens.push(token);
        self.shared.with_stats(|s| s.generated_tokens += 1);

        let a = &mut self.running[i];
        let (text, reason) = if a.stop_ids.contains(&token) {
            // The stop token's own text is never emitted; what was held back
            // (a partial stop string that did not complete) is released.
            let d = a.text.finish();
            (d.text, Some(FinishReason::Stop))
        } else {
            match a.text.push(token) {
                Err(e) => return Some(Outcome::Failed(EngineError::Tokenizer(e.to_string()))),
                Ok(d) if d.stopped => (d.text, Some(FinishReason::Stop)),
                Ok(mut d) => {
                    if a.generated() >= a.max_tokens {
                        let tail = a.text.finish();
                        d.text.push_str(&tail.text);
                        (
                            d.text,
                            Some(if tail.stopped {
                                FinishReason::Stop
                            } else {
                                FinishReason::Length
                            }),
                        )
                    } else {
                        (d.text, None)
                    }
                }
            }
        };
        let logprob = if a.stop_ids.contains(&token) || a.logprobs.is_none() {
            None
        } else {
            Some(logprob_report(
                &self.tokenizer,
                token,
                picked.logprob,
                &picked.top,
            ))
        };
        let a = &self.running[i];
        if a.events
            .send(Event::Token {
                id: token,
                text,
                logprob,
            })
            .is_err()
        {
            return Some(Outcome::Finished(FinishReason::Cancelled));
        }
        reason.map(Outcome::Finished)
    }
}
