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
//! freed and it waits, keeping its tokens and sampler, to be recomputed
//! (prefilled again up to its last token) when memory is back, so the
//! client sees a pause, not an error. Only a request that could never fit
//! the whole pool fails.
//!
//! This file owns no threading or queue (`engine.rs`), no token choice
//! (`sampling.rs`), no text handling (`text.rs`) and no cache policy
//! (`prefix_cache.rs`): it calls them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lily_core::tokenizer::Tokenizer;
use lily_model::{Backend, LogitsWanted, ModelError, SeqId};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{
    EngineError, EngineOptions, Event, FinishReason, GenerateRequest, Shared, Submission,
    TokenLogprob,
};
use crate::prefix_cache::{prompt_boundary_wanted, PrefixCache};
use crate::sampling::Sampler;
use crate::text::TextStream;

/// How a request left the running set.
enum Outcome {
    Finished(FinishReason),
    Failed(EngineError),
}

/// Whether a request's KV memory fits the backend's pool.
enum KvFit {
    Fits,
    /// Not beside what is held now.
    NotNow,
    /// Not even in the empty pool (which holds this many tokens).
    Never(usize),
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

/// What admission got for a request.
enum Acquired {
    /// A sequence holding `cached` tokens of the request's prefix.
    Go(SeqId, usize),
    /// Running requests hold what it needs: try again when one ends.
    Wait,
    Fail(EngineError),
}

/// A request that holds a backend sequence.
struct Active {
    id: u64,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    deadline: Option<Instant>,
    prompt_len: usize,
    max_tokens: usize,
    logprobs: Option<usize>,
    stop_ids: Vec<u32>,
    sampler: Sampler,
    text: TextStream,
    /// The backend sequence; `None` while preempted (waiting for KV memory
    /// to be recomputed).
    seq: Option<SeqId>,
    /// The prompt followed by the generated tokens.
    tokens: Vec<u32>,
    /// How many of `tokens` the backend sequence has consumed. While
    /// prefilling, `fed < target()`; while generating, `fed ==
    /// tokens.len() - 1` (the last sampled token is fed by the next decode).
    fed: usize,
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

    fn generating(&self) -> bool {
        self.seq.is_some() && self.fed >= self.target()
    }

    fn prefilling(&self) -> bool {
        self.seq.is_some() && self.fed < self.target()
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

pub(crate) struct Scheduler {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    cache: PrefixCache,
    max_batch: usize,
    prefill_chunk: usize,
    eos: Vec<u32>,
    /// Ids at or above this have no text (the embedding is padded past the
    /// tokenizer); they are masked out before sampling.
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
        Scheduler {
            backend,
            tokenizer,
            shared,
            cache: PrefixCache::new(
                opts.snapshot_interval,
                opts.prefix_cache_tokens,
                opts.prefix_cache_max_entries,
            ),
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
        for a in std::mem::take(&mut self.running) {
            if let Some(seq) = a.seq {
                self.backend.free(seq);
            }
            self.send_outcome_active(&a, Outcome::Failed(EngineError::Backend(why.to_string())));
        }
        for seq in self.cache.clear() {
            self.backend.free(seq);
        }
        self.publish_gauges();
    }

    /// Frees every snapshot (at shutdown).
    pub(crate) fn clear_cache(&mut self) {
        for seq in self.cache.clear() {
            self.backend.free(seq);
        }
        self.publish_gauges();
    }

    fn publish_gauges(&self) {
        let running = self.running.len();
        let (entries, held, evictions) = (
            self.cache.len(),
            self.cache.held_tokens(),
            self.cache.evictions(),
        );
        let kv = self.backend.kv_room().map(|r| (r.free_tokens, r.total_tokens));
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
        if let Some(seq) = a.seq {
            self.backend.free(seq);
        }
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

    /// Running requests that hold a backend sequence (not preempted).
    fn holders(&self) -> usize {
        self.running.iter().filter(|a| a.seq.is_some()).count()
    }

    /// Backend sequences in use: running requests plus cache snapshots.
    fn slots_used(&self) -> usize {
        self.holders() + self.cache.len()
    }

    /// Evicts snapshots until one more sequence fits; false if it cannot.
    fn make_room_for_one(&mut self) -> bool {
        while self.slots_used() + 1 > self.backend.max_sequences() {
            match self.cache.evict_lru() {
                Some(seq) => self.backend.free(seq),
                None => return false,
            }
        }
        true
    }

    /// KV blocks the admitted requests still have to take to finish their
    /// prefill.
    fn pending_prefill_blocks(&self, block: usize) -> usize {
        self.running
            .iter()
            .filter(|a| a.prefilling())
            .map(|a| a.target().div_ceil(block) - a.fed.div_ceil(block))
            .sum()
    }

    /// Whether a request that prefills up to `target` tokens, `cached` of
    /// them restored from a snapshot, fits the KV pool now, beside what the
    /// admitted requests still have to prefill and with one block to grow
    /// into. Backends without a fixed pool always have room.
    fn kv_fits(&self, target: usize, cached: usize) -> KvFit {
        let Some(room) = self.backend.kv_room() else {
            return KvFit::Fits;
        };
        let b = room.block_tokens.max(1);
        // A fork shares the snapshot's full blocks and copies the last one.
        let need = target.div_ceil(b) - cached / b + 1;
        if target.div_ceil(b) + 1 > room.total_tokens / b {
            return KvFit::Never(room.total_tokens);
        }
        let free = (room.free_tokens / b).saturating_sub(self.pending_prefill_blocks(b));
        if free >= need {
            KvFit::Fits
        } else {
            KvFit::NotNow
        }
    }

    /// A sequence for a request about to prefill `tokens[..target]`: a fork
    /// of the longest cached prefix, or a fresh one. Snapshots are evicted
    /// for a free slot or KV memory; the request waits (`Wait`) while
    /// running requests hold what it needs, and fails only when it could
    /// never be served.
    fn acquire(&mut self, tokens: &[u32], target: usize) -> Acquired {
        if !self.make_room_for_one() {
            if self.holders() == 0 {
                // No slot will ever free up (a backend with no sequences).
                return Acquired::Fail(EngineError::Capacity(format!(
                    "the backend holds at most {} sequences",
                    self.backend.max_sequences()
                )));
            }
            return Acquired::Wait;
        }
        let hit = loop {
            let hit = self.cache.lookup(&tokens[..target]);
            match self.kv_fits(target, hit.map_or(0, |h| h.1)) {
                KvFit::Fits => break hit,
                KvFit::Never(total) => {
                    return Acquired::Fail(EngineError::Capacity(format!(
                        "KV cache full: this request needs {target} tokens of KV cache \
                         and some room to grow; the whole pool holds {total}"
                    )))
                }
                KvFit::NotNow => match self.cache.evict_lru() {
                    Some(seq) => self.backend.free(seq),
                    // Memory comes back as running requests end.
                    None if self.holders() > 0 => return Acquired::Wait,
                    None => break hit,
                },
            }
        };
        // Restore from the snapshot. If the backend has no memory for the
        // copy, fall back to a fresh sequence (whose retry loop may evict
        // snapshots, the hit included) rather than fail.
        let forked = hit.and_then(|(snap, len)| match self.backend.fork(snap) {
            Ok(seq) => Some(Ok((seq, len))),
            Err(ModelError::Capacity(_)) => None,
            Err(e) => Some(Err(e)),
        });
        let got = forked.unwrap_or_else(|| {
            evicting_snapshots(self.backend.as_mut(), &mut self.cache, |b| b.alloc()).map(|s| (s, 0))
        });
        match got {
            Ok((seq, cached)) => Acquired::Go(seq, cached),
            Err(ModelError::Capacity(m)) if self.holders() > 0 => {
                tracing::debug!("admission deferred: {m}");
                Acquired::Wait
            }
            Err(e) => Acquired::Fail(model_error(e)),
        }
    }

    fn admit(&mut self) {
        // Preempted requests first, oldest first: they were admitted before
        // anything that is waiting, and nothing overtakes them.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].seq.is_some() {
                i += 1;
                continue;
            }
            // Lend the tokens to `acquire` (which needs `&mut self`).
            let target = self.running[i].target();
            let tokens = std::mem::take(&mut self.running[i].tokens);
            let got = self.acquire(&tokens, target);
            self.running[i].tokens = tokens;
            match got {
                Acquired::Go(seq, cached) => {
                    tracing::debug!(request = self.running[i].id, cached, "resumed after preemption");
                    self.running[i].seq = Some(seq);
                    self.running[i].fed = cached;
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
            let outcome = match self.acquire(&sub.req.prompt, target) {
                Acquired::Wait => {
                    self.waiting.push_front(sub);
                    break;
                }
                Acquired::Go(seq, cached) => Ok((seq, cached)),
                Acquired::Fail(e) => Err(e),
            };
            // One lookup per request that got an answer.
            self.shared
                .with_stats(|s| s.prefix_cache_lookups += u64::from(self.cache.enabled()));
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
        let a = Active {
            id,
            cancel,
            deadline,
            prompt_len,
            max_tokens,
            logprobs,
            stop_ids,
            sampler: Sampler::new(sampling, &prompt),
            text: TextStream::new(self.tokenizer.stream_decoder(), stop_strings),
            seq: Some(seq),
            tokens: prompt,
            fed: cached,
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
        self.running.push(a);
    }

    // ----- work ------------------------------------------------------------

    fn decode_step(&mut self) {
        let (idx, batch): (Vec<usize>, Vec<(SeqId, u32)>) = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, a)| a.generating())
            .filter_map(|(i, a)| Some((i, (a.seq?, a.tokens[a.fed]))))
            .unzip();
        if idx.is_empty() {
            return;
        }
        let decoded =
            evicting_snapshots(self.backend.as_mut(), &mut self.cache, |b| b.decode(&batch));
        // One result per entry of `idx`, except that the isolation below may
        // have preempted or failed the youngest entries: `results` then
        // covers a prefix of `idx`, still valid as indices into `running`.
        let results: Vec<Result<Vec<f32>, EngineError>> = match decoded {
            Ok(rows) if rows.len() == batch.len() => rows.into_iter().map(Ok).collect(),
            Ok(rows) => {
                let e = EngineError::Backend(format!(
                    "decode returned {} rows for a batch of {}",
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
                Ok(mut logits) => {
                    self.running[i].fed += 1;
                    self.maybe_snapshot(i);
                    if let Some(o) = self.sample_and_emit(i, &mut logits) {
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
    ) -> Vec<Result<Vec<f32>, EngineError>> {
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
            match self.backend.seq_len(seq) {
                Ok(n) if n == self.running[idx[k]].fed => {}
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
            let r = evicting_snapshots(self.backend.as_mut(), &mut self.cache, |b| {
                b.decode(&[(seq, tok)])
            });
            match r {
                Ok(mut rows) if rows.len() == 1 => out.push(Ok(rows.remove(0))),
                Ok(rows) => out.push(Err(EngineError::Backend(format!(
                    "decode returned {} rows for one sequence",
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
    /// is preempted (waits, tokens and sampler kept, to be recomputed when
    /// memory is back), or failed when even the empty pool could not hold
    /// it. `None` when no request holds a sequence.
    fn release_youngest(&mut self, why: &str) -> Option<Released> {
        let v = self.running.iter().rposition(|a| a.seq.is_some())?;
        let target = self.running[v].target();
        let never = matches!(self.kv_fits(target, 0), KvFit::Never(_));
        if never || self.holders() == 1 {
            // Nobody else holds memory to give back: it cannot fit at all.
            let e = EngineError::Capacity(format!(
                "KV cache full: this request needs more KV memory than the whole pool ({why})"
            ));
            self.retire(v, Outcome::Failed(e));
            return Some(Released::Failed(v));
        }
        let a = &mut self.running[v];
        if let Some(seq) = a.seq.take() {
            self.backend.free(seq);
        }
        a.fed = 0;
        tracing::info!(request = a.id, tokens = a.tokens.len(), "out of KV memory: preempted, will be recomputed");
        self.shared.with_stats(|s| s.preemptions += 1);
        Some(Released::Paused(v))
    }

    fn prefill_step(&mut self) {
        let mut budget = self.prefill_chunk;
        let mut i = 0;
        // Oldest admitted first (`running` is in admission order).
        while budget > 0 && i < self.running.len() {
            let Some(seq) = self.running[i].seq.filter(|_| self.running[i].prefilling()) else {
                i += 1;
                continue;
            };
            let (start, target) = (self.running[i].fed, self.running[i].target());
            let end = self.chunk_end(i, start, target.min(start + budget));
            let chunk = &self.running[i].tokens[start..end];
            let result = evicting_snapshots(self.backend.as_mut(), &mut self.cache, |b| {
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
                        None => self.retire(i, Outcome::Failed(work_error(ModelError::Capacity(m)))),
                    }
                    continue;
                }
                Err(e) => Some(Outcome::Failed(work_error(e))),
                Ok(mut rows) => {
                    budget -= end - start;
                    self.shared
                        .with_stats(|s| s.prefill_tokens += (end - start) as u64);
                    self.running[i].fed = end;
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
                            Some(mut logits) => self.sample_and_emit(i, &mut logits),
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

    /// Where a prefill chunk of request `i` from `start` ends: at `limit`,
    /// or earlier at the first boundary that will be snapshotted, so the
    /// snapshot holds exactly that prefix. Other boundaries do not cut the
    /// chunk (large chunks keep prefill efficient).
    fn chunk_end(&self, i: usize, start: usize, limit: usize) -> usize {
        let a = &self.running[i];
        let interval = self.cache.interval();
        let mut b = match self.cache.next_boundary(start) {
            Some(b) => b,
            None => return limit,
        };
        while b < limit {
            if prompt_boundary_wanted(b, a.prompt_len, interval)
                && self.cache.admits(&a.tokens[..b])
                && !self.cache.contains(&a.tokens[..b])
            {
                return b;
            }
            b += interval;
        }
        limit
    }

    /// Hands the cache a copy of request `i`'s sequence if it sits at a
    /// boundary worth a snapshot (see `prompt_boundary_wanted`; every
    /// boundary while generating) that the cache does not hold yet.
    fn maybe_snapshot(&mut self, i: usize) {
        let a = &self.running[i];
        let fed = a.fed;
        if fed == 0 || self.cache.next_boundary(fed - 1) != Some(fed) {
            return;
        }
        let in_prompt = fed <= a.prompt_len;
        if in_prompt && !prompt_boundary_wanted(fed, a.prompt_len, self.cache.interval()) {
            return;
        }
        if !self.cache.wants(&self.running[i].tokens[..fed]) {
            return;
        }
        // A snapshot never takes a slot a request could use: only evict
        // other snapshots for it.
        if !self.make_room_for_one() {
            return;
        }
        let Some(seq) = self.running[i].seq else {
            return;
        };
        match self.backend.fork(seq) {
            Ok(copy) => {
                for seq in self.cache.insert(&self.running[i].tokens[..fed], copy) {
                    self.backend.free(seq);
                }
            }
            // No memory for a snapshot is not an error for the request.
            Err(e) => tracing::debug!("prefix snapshot skipped: {e}"),
        }
    }

    /// Samples from request `i`'s logits, emits the token, and says whether
    /// the request ends.
    fn sample_and_emit(&mut self, i: usize, logits: &mut [f32]) -> Option<Outcome> {
        if logits.len() > self.text_vocab {
            logits[self.text_vocab..].fill(f32::NEG_INFINITY);
        }
        let a = &mut self.running[i];
        let picked = a.sampler.sample(logits, a.logprobs);
        let token = picked.token;
        a.sampler.accept(token);
        a.tokens.push(token);
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
        let logprob = if a.stop_ids.contains(&token) {
            None
        } else {
            picked.logprobs.map(|(lp, top)| TokenLogprob {
                token: token_text(&self.tokenizer, token),
                logprob: lp,
                bytes: self
                    .tokenizer
                    .token_bytes(token)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default(),
                top: top
                    .into_iter()
                    .map(|(t, l)| {
                        (
                            token_text(&self.tokenizer, t),
                            l,
                            self.tokenizer
                                .token_bytes(t)
                                .map(<[u8]>::to_vec)
                                .unwrap_or_default(),
                        )
                    })
                    .collect(),
            })
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

/// A token's text on its own (lossy for a fragment of a character).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.token_bytes(id)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default()
}

/// Runs `f`, a backend call that may need memory (alloc, prefill, decode);
/// on a capacity error evicts the least recently used snapshot and retries,
/// until `f` succeeds or no snapshot is left. Snapshots are the only memory
/// the engine can give back without failing a request. Retrying is sound
/// because a backend that answers `Capacity` has changed no sequence's
/// length (the CUDA backend reserves KV blocks before it runs anything).
///
/// A free function over the two fields it needs, so a caller can lend `f`
/// a borrow of a request's tokens (a method on `self` could not).
fn evicting_snapshots<T>(
    backend: &mut dyn Backend,
    cache: &mut PrefixCache,
    mut f: impl FnMut(&mut dyn Backend) -> Result<T, ModelError>,
) -> Result<T, ModelError> {
    loop {
        match f(backend) {
            Err(ModelError::Capacity(m)) => match cache.evict_lru() {
                Some(seq) => {
                    tracing::debug!("out of backend memory ({m}); evicting a prefix snapshot");
                    backend.free(seq);
                }
                None => return Err(ModelError::Capacity(m)),
            },
            other => return other,
        }
    }
}

/// The error for a request whose prefill or decode failed. Out of memory
/// there means the KV cache is full even with every snapshot evicted.
fn work_error(e: ModelError) -> EngineError {
    match e {
        ModelError::Capacity(m) => EngineError::Capacity(format!(
            "KV cache full: no memory left for this request after evicting every \
             prefix-cache snapshot ({m})"
        )),
        other => model_error(other),
    }
}

fn model_error(e: ModelError) -> EngineError {
    match e {
        ModelError::Capacity(m) => EngineError::Capacity(m),
        other => EngineError::Backend(other.to_string()),
    }
}
