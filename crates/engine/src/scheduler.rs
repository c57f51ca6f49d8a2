//! Continuous batching on the engine thread: which requests hold a backend
//! sequence, what each engine step runs, and how every accepted request ends.
//!
//! One step = reap (cancelled, disconnected, past deadline), admit waiting
//! requests while there is room, one decode batch over every request that is
//! generating, then at most `prefill_chunk` prompt tokens of prefill (oldest
//! request first, chunks cut at snapshot boundaries; the chunks of several
//! requests in one `Backend::prefill_batch` call; a prompt whose rest past
//! the budget is a short tail finishes in the same step: `chunk_limit`). So a long prompt is
//! prefilled over several steps while running streams keep getting a token
//! per step, and a new request joins the decode batch the step after its
//! prompt is done. Where the backend takes them (`EngineOptions::mixed_steps`,
//! `Backend::mixed_steps`), a step with both runs its decode batch inside
//! that prefill call, a one-token part per request (`mixed_step`). Every accepted request gets exactly one `Finished` or
//! `Failed`; a backend error fails only the request(s) it concerns.
//!
//! Decode runs ahead of the host (`Backend::submit_decode`): a step's batch
//! is submitted before the previous step is collected, each sequence fed
//! the token the previous step drew on the device, so the device computes
//! step t+1 while the host detokenises and streams step t (see
//! `decode_step` for stops, and `release_youngest` for preemption while a
//! step is in flight).
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
use lily_model::sample::{draw_host, sample_host};
use lily_model::{Backend, CapturePart, CapturedDraws, Feed, InFlight, ModelError, ModelResult, SampleParams, SampleState, Sampled, SeqId};
use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{EngineError, EngineOptions, EngineTime, Event, FinishReason, GenerateRequest, MixPolicy, Shared, Submission};
use crate::kv::{model_error, work_error, Acquired, Age, Holding, KvFit, KvLedger};
use crate::prefix_cache::PrefixCache;
use crate::sampling::{logprob_report, request_seed, sample_params};
use crate::text::TextStream;

/// How a request left the running set.
enum Outcome {
    Finished(FinishReason),
    Failed(EngineError),
}

/// What a prefill call hands back for a request's next token: a prompt's
/// first (`Scheduler::prefilled`) or a mixed step's decode row
/// (`Scheduler::decoded_in_pass`).
enum NextToken {
    /// The last position's logits (drawn there, if the prompt ended).
    Logits(Vec<f32>),
    /// Drawn already from them (`next_tokens`); the state is not advanced
    /// yet.
    Drawn(Sampled),
    /// Drawn by the backend in the prefill call
    /// (`Backend::prefill_capture_sampling`) and recorded in the state.
    Recorded(Sampled),
    /// The backend returned no logits.
    Missing,
}

/// One request's prefill chunk in a step: its index in `running`, age,
/// sequence, token range, and the prompt boundary inside it whose snapshot
/// the prefill captures (`KvLedger::chunk_plan`).
#[derive(Clone, Copy, Debug)]
struct PlannedChunk {
    i: usize,
    age: Age,
    seq: SeqId,
    start: usize,
    end: usize,
    capture: Option<usize>,
}

/// A generating request's row in a mixed step (`Scheduler::mixed_step`):
/// its age, sequence, and the token the step feeds it.
#[derive(Clone, Copy, Debug)]
struct DecodeRow {
    age: Age,
    seq: SeqId,
    token: u32,
}

/// Which running request gave its KV memory back, and how.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Released {
    /// Preempted: still in `running`, without a sequence.
    Paused(Age),
    /// Failed and removed from `running`.
    Failed(Age),
    /// Its sequence was in a step in flight: every step in flight was
    /// collected instead, and the caller tries again.
    Drained,
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
    /// `GenerateRequest::client`.
    client: Option<u64>,
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
    /// Admitted requests, in admission (age) order.
    running: Vec<Active>,
    /// Decode steps submitted and not collected yet, oldest first (at most
    /// one between engine steps, two inside one).
    in_flight: VecDeque<Step>,
    /// Whether the next step is submitted before the last one is collected
    /// (`EngineOptions::run_ahead`).
    run_ahead: bool,
    /// When a step's decode rows ride in its prefill call
    /// (`EngineOptions::mixed_steps`).
    mix: MixPolicy,
    /// Requests ended so far (finished or failed), for the engine loop's
    /// count of requests that end together (`engine::Burst`). The stats
    /// count the same, behind their lock; this is read twice a step.
    ended: std::cell::Cell<usize>,
    /// The client of the request that ended last (`GenerateRequest::client`).
    last_ended_client: std::cell::Cell<Option<u64>>,
}

/// A decode step in flight.
struct Step {
    handle: InFlight,
    /// The requests it decodes, by age, in batch order.
    members: Vec<Age>,
}

impl Scheduler {
    pub(crate) fn new(backend: Box<dyn Backend>, tokenizer: Arc<Tokenizer>, opts: &EngineOptions, shared: Arc<Shared>) -> Self {
        let eos = backend.config().eos_token_ids.clone();
        let text_vocab = tokenizer.vocab_size();
        let cache = PrefixCache::new(opts.snapshot_interval, opts.prefix_cache_tokens, opts.prefix_cache_max_entries);
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
            in_flight: VecDeque::new(),
            run_ahead: opts.run_ahead,
            mix: opts.mixed_steps,
            ended: std::cell::Cell::new(0),
            last_ended_client: std::cell::Cell::new(None),
        }
    }

    /// Requests ended so far, finished or failed.
    pub(crate) fn ended(&self) -> usize {
        self.ended.get()
    }

    /// Whether the oldest waiting request comes from a known client other
    /// than the one whose request ended last (`GenerateRequest::client`).
    pub(crate) fn newcomer_waits(&self) -> bool {
        self.waiting.front().and_then(|w| w.req.client).is_some_and(|c| Some(c) != self.last_ended_client.get())
    }

    pub(crate) fn enqueue(&mut self, sub: Submission) {
        self.waiting.push_back(sub);
    }

    /// Nothing to do: no request waiting or running, no step in flight
    /// (whose sequences are freed as it is collected).
    pub(crate) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.runs_nothing()
    }

    /// Requests wait for admission and nothing runs: holding the first
    /// prefill back stalls no stream (`engine::gather_arrivals`).
    pub(crate) fn only_waiting(&self) -> bool {
        !self.waiting.is_empty() && self.runs_nothing()
    }

    /// No request admitted and no step in flight.
    fn runs_nothing(&self) -> bool {
        self.running.is_empty() && self.in_flight.is_empty()
    }

    /// Requests received and not yet admitted.
    pub(crate) fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether the waiting requests' prompts already fill a prefill pass
    /// (`prefill_chunk` tokens and the short tails `chunk_limit` lets
    /// finish with them): more would wait for a later pass anyway.
    pub(crate) fn pass_is_full(&self) -> bool {
        let most = self.prefill_chunk + self.prefill_chunk / PREFILL_TAIL_DIV;
        self.waiting.iter().map(|w| w.req.prompt.len()).sum::<usize>() >= most
    }

    /// One engine step (see the file comment).
    pub(crate) fn step(&mut self) {
        let t0 = Instant::now();
        let busy = !self.is_idle();
        self.reap();
        self.admit();
        if !self.mixed_step() {
            self.decode_step();
            self.prefill_step();
        }
        if busy {
            let dt = t0.elapsed().as_secs_f64();
            self.shared.with_stats(|s| s.time.step_s += dt);
        }
        self.publish_gauges();
    }

    /// Fails every request (after a panic inside a step, whose state is
    /// unknown) and drops the cache; the engine then carries on.
    pub(crate) fn fail_all(&mut self, why: &str) {
        // Steps in flight are waited for (their draws dropped) before their
        // sequences are freed.
        for step in std::mem::take(&mut self.in_flight) {
            let mut states: Vec<SampleState> = step.members.iter().map(|_| placeholder_state()).collect();
            if let Err(e) = self.backend.collect_decode(step.handle, &mut states) {
                tracing::warn!("collecting a decode step after a panic: {e}");
            }
        }
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
    fn final_event(&self, outcome: Outcome, tokens: (usize, usize, usize), client: Option<u64>) -> Event {
        let (prompt_tokens, completion_tokens, cached_tokens) = tokens;
        self.ended.set(self.ended.get() + 1);
        self.last_ended_client.set(client);
        match outcome {
            Outcome::Finished(reason) => {
                self.shared.with_stats(|s| {
                    s.requests_finished += 1;
                    if matches!(reason, FinishReason::Cancelled) {
                        s.requests_cancelled += 1;
                    }
                });
                Event::Finished { reason, completion_tokens, prompt_tokens, cached_tokens }
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
        let event = self.final_event(outcome, (a.prompt_len, a.generated(), a.cached_tokens), a.client);
        // The receiver may be gone (cancelled); nothing to tell then.
        let _ = a.events.send(event);
    }

    /// Ends a waiting request that never got a sequence.
    fn end_waiting(&self, sub: Submission, outcome: Outcome) {
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let event = self.final_event(outcome, (sub.req.prompt.len(), 0, 0), sub.req.client);
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
            let outcome = match self.kv.acquire(self.backend.as_mut(), &sub.req.prompt, target) {
                Acquired::Wait => {
                    self.waiting.push_front(sub);
                    break;
                }
                Acquired::Go(seq, cached) => Ok((seq, cached)),
                Acquired::Fail(e) => Err(e),
            };
            // One lookup per request that got an answer.
            let lookups = u64::from(self.kv.cache.enabled());
            self.shared.with_stats(|s| s.prefix_cache_lookups += lookups);
            match outcome {
                Ok((seq, cached)) => self.start(sub, seq, cached),
                Err(e) => self.end_waiting(sub, Outcome::Failed(e)),
            }
        }
    }

    fn start(&mut self, sub: Submission, seq: SeqId, cached: usize) {
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let Submission { id, req, events, cancel, .. } = sub;
        let GenerateRequest { prompt, max_tokens, sampling, stop_strings, stop_token_ids, logprobs, deadline, client } = req;
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
            sampling: SampleState::new(sample_params(&sampling, request_seed(&sampling), logprobs, self.text_vocab), &prompt),
            text: TextStream::new(self.tokenizer.stream_decoder(), stop_strings),
            tokens: prompt,
            cached_tokens: cached,
            events,
            client,
        };
        self.shared.with_stats(|s| {
            s.prompt_tokens += prompt_len as u64;
            if cached > 0 {
                s.prefix_cache_hits += 1;
                s.prefix_cache_tokens += cached as u64;
            }
        });
        tracing::debug!(request = id, prompt = prompt_len, cached, "admitted");
        if a.events.send(Event::Started { prompt_tokens: prompt_len, cached_tokens: cached }).is_err() {
            self.backend.free(seq);
            self.send_outcome_active(&a, Outcome::Finished(FinishReason::Cancelled));
            return;
        }
        self.kv.hold(age, seq, cached, prompt_len);
        self.running.push(a);
    }

    // ----- decode ----------------------------------------------------------

    /// One decode step for every generating request, run ahead of the host:
    /// the step is submitted first, then the step before it (if any) is
    /// collected and its tokens streamed while the new one runs on the
    /// device. A request still in the step in flight is fed
    /// `Feed::Previous`, one that is not (it just finished its prefill, or
    /// the pipeline was drained) its last token. A request whose steps in
    /// flight already produce its last token (`max_tokens`) is left out;
    /// one that stops at a step already fed the next (EOS, stop string,
    /// cancel): that step's draw is discarded and its sequence freed as the
    /// step is collected. Without `run_ahead`, or when there is nothing to
    /// submit, every step in flight is collected before the step ends.
    fn decode_step(&mut self) {
        let mut members = Vec::new();
        let mut batch = Vec::new();
        for a in &self.running {
            let Some(h) = self.decodes_next(a) else {
                continue;
            };
            let feed = if h.ahead > 0 { Feed::Previous } else { Feed::Token(a.tokens[h.fed]) };
            members.push(a.age);
            batch.push((h.seq, feed));
        }
        let submitted = !batch.is_empty() && self.submit(members, &batch);
        let keep = usize::from(self.run_ahead && submitted);
        while self.in_flight.len() > keep {
            self.collect_oldest();
        }
    }

    /// Request `a`'s sequence when a decode step is due for it: it holds
    /// one, has finished its prefill, and its steps in flight do not
    /// already produce its last token (`max_tokens`).
    fn decodes_next(&self, a: &Active) -> Option<&Holding> {
        self.kv.holding(a.age).filter(|h| !h.prefilling() && a.generated() + h.ahead < a.max_tokens)
    }

    /// Submits one decode step for `members` (request ages, batch order);
    /// false if it failed, in which case the steps in flight were collected
    /// and the requests decoded one by one instead.
    fn submit(&mut self, members: Vec<Age>, batch: &[(SeqId, Feed)]) -> bool {
        let mut states = self.lend_states(&members);
        let r = timed(&self.shared, |t| &mut t.decode_submit_s, || self.kv.evicting(self.backend.as_mut(), |b| b.submit_decode(batch, &mut states)));
        self.return_states(&members, states);
        self.count_decode_step(batch.len());
        match r {
            Ok(handle) => {
                for &age in &members {
                    self.kv.submitted(age);
                }
                // A request that was fed a token it knows offers its new
                // length to the cache now; one fed `Previous` does when
                // that token is collected.
                for &age in &members {
                    if let Some(i) = self.find(age) {
                        self.maybe_snapshot(i);
                    }
                }
                self.in_flight.push_back(Step { handle, members });
                true
            }
            Err(e) => {
                self.drain();
                self.decode_isolated(e);
                false
            }
        }
    }

    fn count_decode_step(&self, n: usize) {
        self.shared.with_stats(|s| {
            s.decode_steps += 1;
            if s.decode_batch_sizes.len() <= n {
                s.decode_batch_sizes.resize(n + 1, 0);
            }
            s.decode_batch_sizes[n] += 1;
        });
    }

    /// Collects the oldest step in flight and streams its tokens; the draws
    /// of requests that ended meanwhile are discarded.
    fn collect_oldest(&mut self) {
        let Some(step) = self.in_flight.pop_front() else {
            return;
        };
        let mut states = self.lend_states(&step.members);
        let r = timed(&self.shared, |t| &mut t.decode_wait_s, || self.backend.collect_decode(step.handle, &mut states));
        self.return_states(&step.members, states);
        for &age in &step.members {
            self.kv.landed(self.backend.as_mut(), age);
        }
        let draws = match r {
            Ok(d) if d.len() == step.members.len() => d,
            // The step's draws are lost and its sequences' states unknown.
            other => {
                let e = match other {
                    Ok(d) => EngineError::Backend(format!("collect returned {} tokens for a batch of {}", d.len(), step.members.len())),
                    Err(e) => model_error(e),
                };
                for &age in &step.members {
                    if let Some(i) = self.find(age) {
                        self.retire(i, Outcome::Failed(e.clone()));
                    }
                }
                return;
            }
        };
        for (&age, picked) in step.members.iter().zip(draws) {
            let Some(i) = self.find(age) else {
                continue;
            };
            match self.emit(i, picked) {
                Some(o) => self.retire(i, o),
                None => self.maybe_snapshot(i),
            }
        }
    }

    /// Collects every step in flight (streaming their tokens), so that no
    /// sequence is ahead of its request.
    fn drain(&mut self) {
        while !self.in_flight.is_empty() {
            self.collect_oldest();
        }
    }

    /// A batched decode step failed (after snapshots were evicted for it,
    /// if it was out of memory) and nothing is in flight any more: every
    /// generating request is decoded once more, one by one
    /// (`isolate_decode_failure`), and its token streamed.
    fn decode_isolated(&mut self, err: ModelError) {
        let members: Vec<(Age, SeqId, u32)> = self
            .running
            .iter()
            .filter_map(|a| {
                let h = self.kv.holding(a.age).filter(|h| !h.prefilling())?;
                Some((a.age, h.seq, *a.tokens.get(h.fed)?))
            })
            .collect();
        if members.is_empty() {
            return;
        }
        for (age, res) in self.isolate_decode_failure(&members, err) {
            let Some(i) = self.find(age) else {
                continue;
            };
            match res {
                Ok(picked) => {
                    self.maybe_snapshot(i);
                    if let Some(o) = self.emit(i, picked) {
                        self.retire(i, o);
                    }
                }
                Err(e) => self.retire(i, Outcome::Failed(e)),
            }
        }
    }

    /// Decodes `members` (age, sequence, token to feed; admission order)
    /// one by one in admission order, so a fault in one request fails only
    /// that one; a sequence whose length moved in the failed batch (state
    /// unknown) fails.
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
    /// Returns results for a prefix of `members`; the entries past it were
    /// preempted (or failed) here.
    fn isolate_decode_failure(&mut self, members: &[(Age, SeqId, u32)], err: ModelError) -> Vec<(Age, Result<Sampled, EngineError>)> {
        tracing::warn!(batch = members.len(), error = %err, "batched decode failed; retrying sequences one by one");
        // A lone sequence's fault is its own; out of memory may still be
        // settled by a younger request that is prefilling.
        if members.len() == 1 && !matches!(err, ModelError::Capacity(_)) {
            return vec![(members[0].0, Err(model_error(err)))];
        }
        let mut out = Vec::with_capacity(members.len());
        // Entries `out.len()..end` are still to be decoded.
        let mut end = members.len();
        while out.len() < end {
            let (age, seq, tok) = members[out.len()];
            let fed = self.kv.holding(age).map(|h| h.fed);
            let Some(i) = self.find(age).filter(|_| fed.is_some()) else {
                out.push((age, Err(EngineError::Backend("sequence lost".into()))));
                continue;
            };
            match self.backend.seq_len(seq) {
                Ok(n) if Some(n) == fed => {}
                Ok(_) => {
                    let e = ModelError::Device(format!("batched decode failed part-way: {err}"));
                    out.push((age, Err(model_error(e))));
                    continue;
                }
                Err(e) => {
                    out.push((age, Err(model_error(e))));
                    continue;
                }
            }
            let mut state = [self.lend_state(i)];
            let r = self.kv.evicting(self.backend.as_mut(), |b| b.decode_sample(&[(seq, tok)], &mut state));
            let [state] = state;
            self.running[i].sampling = state;
            match r {
                Ok(mut rows) if rows.len() == 1 => {
                    if let Some(h) = self.kv.holding_mut(age) {
                        h.fed += 1;
                    }
                    out.push((age, Ok(rows.remove(0))));
                }
                Ok(rows) => out.push((age, Err(EngineError::Backend(format!("decode returned {} tokens for one sequence", rows.len()))))),
                Err(ModelError::Capacity(m)) => {
                    // The youngest holder gives its memory back: a
                    // prefilling one, the youngest entry still waiting in
                    // this batch, or this entry itself. Entries already
                    // decoded are older, so never chosen.
                    match self.release_youngest(&m) {
                        None => out.push((age, Err(work_error(ModelError::Capacity(m))))),
                        Some(Released::Paused(v) | Released::Failed(v)) => {
                            if members[end - 1].0 == v {
                                end -= 1;
                            }
                        }
                        // Nothing is in flight here; retry all the same.
                        Some(Released::Drained) => {}
                    }
                }
                Err(e) => out.push((age, Err(model_error(e)))),
            }
        }
        out
    }

    /// Frees the KV memory of the youngest request holding a sequence: it
    /// is preempted (waits, tokens and sampling state kept, to be
    /// recomputed when memory is back), or failed when even the empty pool
    /// could not hold it. If steps in flight still compute on its sequence,
    /// they are collected first instead (`Drained`; the caller retries, and
    /// requests ending there may have given memory back already). `None`
    /// when no request holds a sequence.
    fn release_youngest(&mut self, why: &str) -> Option<Released> {
        let age = self.kv.youngest()?;
        if self.kv.holding(age).is_some_and(|h| h.ahead > 0) {
            self.drain();
            return Some(Released::Drained);
        }
        let v = self.find(age)?;
        let target = self.running[v].target();
        let never = matches!(self.kv.fits(self.backend.as_ref(), target, 0), KvFit::Never(_));
        if never || self.kv.holders() == 1 {
            // Nobody else holds memory to give back: it cannot fit at all.
            let e = EngineError::Capacity(format!("KV cache full: this request needs more KV memory than the whole pool ({why})"));
            self.retire(v, Outcome::Failed(e));
            return Some(Released::Failed(age));
        }
        let a = &self.running[v];
        self.kv.release(self.backend.as_mut(), a.age);
        tracing::info!(request = a.id, tokens = a.tokens.len(), "out of KV memory: preempted, will be recomputed");
        self.shared.with_stats(|s| s.preemptions += 1);
        Some(Released::Paused(age))
    }

    // ----- mixed steps -----------------------------------------------------

    /// The decode step and the prefill of this step as one prefill call,
    /// when both are due and the backend takes decode rows in it
    /// (`EngineOptions::mixed_steps`, `Backend::mixed_steps`): each
    /// generating request is a one-token part beside the prompt chunks, so
    /// every weight is read once for both, and its draw is streamed as a
    /// decode step's would be. The steps in flight are collected first (a
    /// prefill takes its tokens from the host, so this step gives up
    /// running ahead). False when the step is not mixed or the call
    /// failed: the caller then runs the decode step and the prefill apart,
    /// which settle out of memory (preemption) and faults (one request at
    /// a time) as usual.
    fn mixed_step(&mut self) -> bool {
        if !self.mix_due() {
            return false;
        }
        // Collecting may end requests (stops, cancels), so the rows and
        // the plan are made after it.
        self.drain();
        let rows = self.decode_rows();
        let plan = self.prefill_plan();
        if rows.is_empty() || plan.is_empty() {
            return false;
        }
        self.prefill_together(&rows, plan)
    }

    /// Whether this step has both a decode batch and prompt chunks, and
    /// the backend takes those decode rows in a prefill call. Runs every
    /// step, so it builds no plan: `prefill_plan` is non-empty exactly when
    /// a request is still prefilling (its budget is at least one token, and
    /// the first such request gets a chunk of at least one).
    fn mix_due(&self) -> bool {
        if self.mix == MixPolicy::Off || !self.running.iter().any(|a| self.kv.holding(a.age).is_some_and(Holding::prefilling)) {
            return false;
        }
        let rows = self.running.iter().filter(|a| self.decodes_next(a).is_some()).count();
        rows > 0 && self.mix.mixes(self.backend.mixed_steps(rows))
    }

    /// Every generating request that holds no step in flight (all of
    /// them, after `drain`), with the token its next step feeds.
    fn decode_rows(&self) -> Vec<DecodeRow> {
        self.running
            .iter()
            .filter_map(|a| {
                let h = self.decodes_next(a).filter(|h| h.ahead == 0)?;
                Some(DecodeRow { age: a.age, seq: h.seq, token: *a.tokens.get(h.fed)? })
            })
            .collect()
    }

    /// Runs `plan`'s chunks and the decode `rows` (a mixed step; none for
    /// a batched prefill) in one `prefill_capture_sampling` call, chunks
    /// first (snapshots evicted for room first). False when the call
    /// failed: with `Capacity` nothing changed; after another error the
    /// requests whose sequence moved (state unknown) have failed here, and
    /// the rest are untouched. Either way the caller goes on apart (the
    /// decode step, then one request's chunk at a time).
    fn prefill_together(&mut self, rows: &[DecodeRow], mut plan: Vec<PlannedChunk>) -> bool {
        let what = if rows.is_empty() { "batched prefill" } else { "mixed step" };
        self.room_for_captures(&mut plan);
        let mut states = self.lend_first_states(&plan);
        for r in rows {
            let st = self.find(r.age).map(|i| self.lend_state(i));
            states.push(st);
        }
        let fed: Vec<[u32; 1]> = rows.iter().map(|r| [r.token]).collect();
        let running = &self.running;
        let mut parts: Vec<CapturePart> = plan.iter().map(|c| (c.seq, &running[c.i].tokens[c.start..c.end], c.capture.map(|at| at - c.start))).collect();
        parts.extend(rows.iter().zip(&fed).map(|(r, t)| (r.seq, &t[..], None)));
        let result = prefill_pass(&self.shared, &mut self.kv, self.backend.as_mut(), &parts, &mut states);
        let row_states = states.split_off(plan.len());
        self.return_first_states(&plan, states);
        for (r, st) in rows.iter().zip(row_states) {
            if let (Some(i), Some(st)) = (self.find(r.age), st) {
                self.running[i].sampling = st;
            }
        }
        let n = plan.len() + rows.len();
        let err = match result {
            Ok(((mut logits, mut snaps), mut draws)) if logits.len() == n && snaps.len() == n && draws.len() == n => {
                for s in snaps.split_off(plan.len()).into_iter().flatten() {
                    self.backend.free(s);
                }
                if !rows.is_empty() {
                    self.count_decode_step(rows.len());
                    self.shared.with_stats(|s| s.mixed_steps += 1);
                    let (row_logits, row_draws) = (logits.split_off(plan.len()), draws.split_off(plan.len()));
                    self.decoded_in_pass(rows, row_logits, row_draws);
                }
                self.file_captures(&plan, snaps);
                let firsts = self.first_draws(&plan, logits, draws);
                for (c, first) in plan.iter().zip(firsts) {
                    // By age: a request retired above shifts the indices.
                    if let Some(i) = self.find(c.age) {
                        if let Some(o) = self.prefilled(i, c.start, c.end, first) {
                            self.retire(i, o);
                        }
                    }
                }
                return true;
            }
            Ok(((logits, snaps), _)) => {
                for s in snaps.into_iter().flatten() {
                    self.backend.free(s);
                }
                ModelError::Device(format!("prefill_capture returned {} rows of logits for {n} parts", logits.len()))
            }
            Err(ModelError::Capacity(m)) => {
                tracing::debug!(parts = n, "{what} out of memory ({m}); going on apart");
                return false;
            }
            Err(e) => e,
        };
        tracing::warn!(parts = n, error = %err, "{what} failed; going on apart");
        // Each part's sequence length before the call.
        let before = plan.iter().map(|c| (c.age, c.seq, c.start)).chain(rows.iter().filter_map(|r| Some((r.age, r.seq, self.kv.holding(r.age)?.fed))));
        let moved: Vec<Age> = before.filter(|&(_, seq, len)| !self.backend.seq_len(seq).is_ok_and(|n| n == len)).map(|(age, _, _)| age).collect();
        for age in moved {
            if let Some(i) = self.find(age) {
                let e = ModelError::Device(format!("{what} failed part-way: {err}"));
                self.retire(i, Outcome::Failed(work_error(e)));
            }
        }
        false
    }

    /// The decode rows of a mixed step ran: each sequence consumed its
    /// token, and its draw (the backend's, or made here from its logits
    /// with the request's state, as `collect_decode` would) is streamed.
    fn decoded_in_pass(&mut self, rows: &[DecodeRow], logits: Vec<Vec<f32>>, draws: Vec<Option<Sampled>>) {
        for r in rows {
            if let Some(h) = self.kv.holding_mut(r.age) {
                h.fed += 1;
            }
        }
        let states: Vec<Option<&SampleState>> = rows.iter().map(|r| self.find(r.age).map(|i| &self.running[i].sampling)).collect();
        let next = next_tokens(logits, states, draws);
        for (r, next) in rows.iter().zip(next) {
            let Some(i) = self.find(r.age) else {
                continue;
            };
            match self.emit_next(i, next) {
                Some(o) => self.retire(i, o),
                None => self.maybe_snapshot(i),
            }
        }
    }

    // ----- prefill ---------------------------------------------------------

    /// At most `prefill_chunk` prompt tokens of the requests still
    /// prefilling, oldest first; a request whose prefill ends gets its
    /// first token (drawn on the host with `lily_model`'s math). When the
    /// budget covers chunks of several requests, they run in one
    /// `Backend::prefill_batch` call (one pass on a device); if the backend
    /// has no room for them together, or the call fails, they run one at a
    /// time (`prefill_one_by_one`), where out of memory is settled by
    /// preemption and a fault fails only its own request.
    fn prefill_step(&mut self) {
        let plan = self.prefill_plan();
        if plan.len() > 1 && self.prefill_together(&[], plan) {
            return;
        }
        self.prefill_one_by_one();
    }

    /// The chunks `prefill_one_by_one` would run now, oldest request first,
    /// within the budget.
    fn prefill_plan(&self) -> Vec<PlannedChunk> {
        let mut budget = self.prefill_chunk;
        let mut plan = Vec::new();
        for (i, a) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let Some(h) = self.kv.holding(a.age).filter(|h| h.prefilling()) else {
                continue;
            };
            let limit = chunk_limit(h.fed, h.prefill_to, budget, self.prefill_chunk);
            let (end, capture) = self.kv.chunk_plan(&a.tokens, a.prompt_len, h.fed, limit);
            if end > h.fed {
                budget = budget.saturating_sub(end - h.fed);
                plan.push(PlannedChunk { i, age: a.age, seq: h.seq, start: h.fed, end, capture });
            }
        }
        plan
    }

    /// Drops the capture points of `plan` the sequence pool has no room
    /// for (snapshots are evicted for them first): those chunks run whole,
    /// with no snapshot inside.
    fn room_for_captures(&mut self, plan: &mut [PlannedChunk]) {
        let mut wanted = plan.iter().filter(|c| c.capture.is_some()).count();
        while wanted > 0 && !self.kv.make_room_for(self.backend.as_mut(), wanted) {
            if let Some(c) = plan.iter_mut().rev().find(|c| c.capture.is_some()) {
                c.capture = None;
            }
            wanted -= 1;
        }
    }

    /// Files the snapshots a prefill captured (`snaps` in `plan` order).
    fn file_captures(&mut self, plan: &[PlannedChunk], snaps: Vec<Option<SeqId>>) {
        for (c, snap) in plan.iter().zip(snaps) {
            let Some(snap) = snap else { continue };
            match (c.capture, self.find(c.age)) {
                (Some(at), Some(i)) => self.kv.insert_captured(self.backend.as_mut(), &self.running[i].tokens, at, snap),
                _ => self.backend.free(snap),
            }
        }
    }

    /// `prefill_step` one request at a time: each chunk its own `prefill`
    /// call; out of memory preempts the youngest holder.
    fn prefill_one_by_one(&mut self) {
        let mut budget = self.prefill_chunk;
        // By age: a preemption below may collect the step in flight, and
        // requests ending there leave `running`.
        let ages: Vec<Age> = self.running.iter().map(|a| a.age).collect();
        let mut k = 0;
        while budget > 0 && k < ages.len() {
            let age = ages[k];
            let Some(i) = self.find(age) else {
                k += 1;
                continue;
            };
            let a = &self.running[i];
            let Some((seq, start, target)) = self.kv.holding(age).filter(|h| h.prefilling()).map(|h| (h.seq, h.fed, h.prefill_to)) else {
                k += 1;
                continue;
            };
            let (end, capture) = self.kv.chunk_plan(&a.tokens, a.prompt_len, start, chunk_limit(start, target, budget, self.prefill_chunk));
            let mut planned = [PlannedChunk { i, age, seq, start, end, capture }];
            self.room_for_captures(&mut planned);
            let [PlannedChunk { capture, .. }] = planned;
            let mut states = self.lend_first_states(&planned);
            let chunk = &self.running[i].tokens[start..end];
            let result = prefill_pass(&self.shared, &mut self.kv, self.backend.as_mut(), &[(seq, chunk, capture.map(|at| at - start))], &mut states);
            self.return_first_states(&planned, states);
            let result = result.map(|((rows, snaps), draws)| {
                self.file_captures(&planned, snaps);
                (rows, draws)
            });
            let outcome = match result {
                // Out of memory with every snapshot evicted: the youngest
                // holder gives its memory back (this request, or a younger
                // one; then this chunk is tried again).
                Err(ModelError::Capacity(m)) => {
                    match self.release_youngest(&m) {
                        // This one paused or failed: on to the next.
                        Some(Released::Paused(v) | Released::Failed(v)) if v == age => k += 1,
                        // A younger one gave way: this chunk is tried again.
                        Some(_) => {}
                        None => {
                            self.retire(i, Outcome::Failed(work_error(ModelError::Capacity(m))));
                            k += 1;
                        }
                    }
                    continue;
                }
                Err(e) => Some(Outcome::Failed(work_error(e))),
                Ok((mut rows, mut draws)) => {
                    budget = budget.saturating_sub(end - start);
                    let first = match draws.pop().flatten() {
                        Some(drawn) => NextToken::Recorded(drawn),
                        None => rows.pop().map_or(NextToken::Missing, NextToken::Logits),
                    };
                    self.prefilled(i, start, end, first)
                }
            };
            if let Some(o) = outcome {
                self.retire(i, o);
            }
            k += 1;
        }
    }

    /// Whether request `i`'s prefill chunk ending at `end` finishes a new
    /// request's prompt, so that its logits give the first token (a request
    /// recomputed after a preemption has drawn from them already).
    fn ends_prompt(&self, i: usize, end: usize) -> bool {
        let a = &self.running[i];
        let target = self.kv.holding(a.age).map_or(end, |h| h.prefill_to);
        end >= target && a.generated() == 0
    }

    /// The sampling states a prefill of `plan` may draw the first token
    /// with (`Backend::prefill_capture_sampling`): lent for the chunks
    /// that finish a new request's prompt, None for the others.
    fn lend_first_states(&mut self, plan: &[PlannedChunk]) -> Vec<Option<SampleState>> {
        plan.iter().map(|c| self.ends_prompt(c.i, c.end).then(|| self.lend_state(c.i))).collect()
    }

    /// Puts back what `lend_first_states` lent (before any request of
    /// `plan` leaves `running`).
    fn return_first_states(&mut self, plan: &[PlannedChunk], states: Vec<Option<SampleState>>) {
        for (c, st) in plan.iter().zip(states) {
            if let Some(st) = st {
                self.running[c.i].sampling = st;
            }
        }
    }

    /// The first tokens of the requests whose prompts a batched prefill
    /// just finished (`next_tokens`); the other chunks' logits pass
    /// through unread.
    fn first_draws(&self, plan: &[PlannedChunk], rows: Vec<Vec<f32>>, draws: Vec<Option<Sampled>>) -> Vec<NextToken> {
        let states: Vec<Option<&SampleState>> =
            plan.iter().map(|c| self.find(c.age).filter(|&i| self.ends_prompt(i, c.end)).map(|i| &self.running[i].sampling)).collect();
        next_tokens(rows, states, draws)
    }

    /// Request `i`'s sequence consumed `tokens[start..end]`, and `first`
    /// holds its last position's logits (or the draw from them): counts
    /// them, offers a snapshot, and draws the first token when that was the
    /// end of a new request's prompt. Returns how the request ends, if it
    /// does.
    fn prefilled(&mut self, i: usize, start: usize, end: usize, first: NextToken) -> Option<Outcome> {
        let age = self.running[i].age;
        self.shared.with_stats(|s| s.prefill_tokens += (end - start) as u64);
        if let Some(h) = self.kv.holding_mut(age) {
            h.fed = end;
        }
        self.maybe_snapshot(i);
        if !self.ends_prompt(i, end) {
            // More prompt to go, or recomputed after a preemption up to
            // its last token: it goes on decoding; these logits were
            // sampled from already.
            return None;
        }
        self.emit_next(i, first)
    }

    /// Emits request `i`'s next token from what a prefill call handed back
    /// (drawing it here from logits), and says whether the request ends.
    fn emit_next(&mut self, i: usize, next: NextToken) -> Option<Outcome> {
        match next {
            NextToken::Logits(logits) => {
                // On the host with the same math as every other token.
                let t0 = Instant::now();
                let picked = sample_host(&logits, &mut self.running[i].sampling);
                tracing::debug!(request = self.running[i].id, draw_ms = t0.elapsed().as_secs_f64() * 1e3, "token drawn from a prefill call's logits");
                self.emit(i, picked)
            }
            NextToken::Drawn(picked) => {
                self.running[i].sampling.record_draw(picked.token);
                tracing::debug!(request = self.running[i].id, "token drawn from a prefill call's logits (with others', on threads)");
                self.emit(i, picked)
            }
            NextToken::Recorded(picked) => {
                tracing::debug!(request = self.running[i].id, "token drawn by the backend in a prefill call");
                self.emit(i, picked)
            }
            NextToken::Missing => Some(Outcome::Failed(EngineError::Backend("a prefill call returned no logits".into()))),
        }
    }

    // ----- per request -----------------------------------------------------

    /// The index in `running` of the request of age `age`, if it runs.
    fn find(&self, age: Age) -> Option<usize> {
        self.running.binary_search_by_key(&age, |a| a.age).ok()
    }

    /// Offers the prefix cache a snapshot of request `i`'s sequence.
    fn maybe_snapshot(&mut self, i: usize) {
        let a = &self.running[i];
        self.kv.maybe_snapshot(self.backend.as_mut(), a.age, &a.tokens, a.prompt_len);
    }

    /// The sampling states of the requests of `ages` for a backend call
    /// (`return_states` puts them back); a request that ended lends a
    /// placeholder (its draw is discarded).
    fn lend_states(&mut self, ages: &[Age]) -> Vec<SampleState> {
        ages.iter()
            .map(|&age| match self.find(age) {
                Some(i) => self.lend_state(i),
                None => placeholder_state(),
            })
            .collect()
    }

    fn return_states(&mut self, ages: &[Age], states: Vec<SampleState>) {
        for (&age, st) in ages.iter().zip(states) {
            if let Some(i) = self.find(age) {
                self.running[i].sampling = st;
            }
        }
    }

    /// Takes request `i`'s sampling state for a backend call; the caller
    /// puts it back (the placeholder left meanwhile allocates nothing).
    fn lend_state(&mut self, i: usize) -> SampleState {
        std::mem::replace(&mut self.running[i].sampling, placeholder_state())
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
                        (d.text, Some(if tail.stopped { FinishReason::Stop } else { FinishReason::Length }))
                    } else {
                        (d.text, None)
                    }
                }
            }
        };
        let logprob =
            if a.stop_ids.contains(&token) || a.logprobs.is_none() { None } else { Some(logprob_report(&self.tokenizer, token, picked.logprob, &picked.top)) };
        let a = &self.running[i];
        if a.events.send(Event::Token { id: token, text, logprob }).is_err() {
            return Some(Outcome::Finished(FinishReason::Cancelled));
        }
        reason.map(Outcome::Finished)
    }
}

/// The next tokens a prefill call hands back, row by row: the backend's
/// draws where it made them; for the rows with a state to draw with
/// (`states[k]`), whose draw the backend declined, drawn here from their
/// logits, on threads at once when there are several (each host draw reads
/// ~1 MB of logits, ~1 ms; a pass of 8 new prompts would otherwise hold
/// the engine thread, and with it the device, ~8 ms). The other rows'
/// logits pass through. The host draws are `sample_host`'s (pure in the
/// logits and the request's state), so the tokens are the same.
fn next_tokens(rows: Vec<Vec<f32>>, states: Vec<Option<&SampleState>>, draws: Vec<Option<Sampled>>) -> Vec<NextToken> {
    let on_threads = states.iter().zip(&draws).filter(|(st, d)| st.is_some() && d.is_none()).count() >= 2;
    let next = |((logits, state), drawn): ((Vec<f32>, Option<&SampleState>), Option<Sampled>)| match (drawn, state) {
        (Some(d), _) => NextToken::Recorded(d),
        (None, _) if logits.is_empty() => NextToken::Missing,
        (None, Some(st)) if on_threads => NextToken::Drawn(draw_host(&logits, st)),
        (None, _) => NextToken::Logits(logits),
    };
    if on_threads {
        rows.into_par_iter().zip(states).zip(draws).map(next).collect()
    } else {
        rows.into_iter().zip(states).zip(draws).map(next).collect()
    }
}

/// A sampling state that stands in for a lent or discarded one (allocates
/// nothing).
fn placeholder_state() -> SampleState {
    SampleState::new(SampleParams::default(), &[])
}

/// One `prefill_capture` call (snapshots evicted for room), its time added
/// to the engine's prefill time and logged with its size at debug level.
fn prefill_pass(
    shared: &Shared,
    kv: &mut KvLedger,
    backend: &mut dyn Backend,
    parts: &[CapturePart],
    states: &mut [Option<SampleState>],
) -> ModelResult<CapturedDraws> {
    let t0 = Instant::now();
    let result = kv.evicting(backend, |b| b.prefill_capture_sampling(parts, states));
    let dt = t0.elapsed().as_secs_f64();
    shared.with_stats(|s| s.time.prefill_s += dt);
    let tokens: usize = parts.iter().map(|p| p.1.len()).sum();
    tracing::debug!(parts = parts.len(), tokens, ms = dt * 1e3, "prefill pass");
    result
}

/// Runs `f` and adds its wall time to the engine-time counter `field` picks.
fn timed<R>(shared: &Shared, field: fn(&mut EngineTime) -> &mut f64, f: impl FnOnce() -> R) -> R {
    let t0 = Instant::now();
    let r = f();
    let dt = t0.elapsed().as_secs_f64();
    shared.with_stats(|s| *field(&mut s.time) += dt);
    r
}

/// A step's prefill may run past its budget by at most `prefill_chunk /
/// PREFILL_TAIL_DIV` tokens to finish a prompt.
pub(crate) const PREFILL_TAIL_DIV: usize = 4;

/// Where a prefill chunk of a request fed up to `fed`, to be prefilled up
/// to `prefill_to`, may end with `budget` (> 0) of the step's
/// `prefill_chunk` tokens left: at `fed + budget`, or at `prefill_to` when
/// what would be left past the budget is at most `prefill_chunk /
/// PREFILL_TAIL_DIV` tokens. Cut there, such a tail would cost its request
/// a decode step and a pass of its own, and a short pass costs far more
/// than its share of a long one (on the GPU a pass reads the active
/// weights once: a 256-token prompt prefills in ~16 ms on the H200, 2,048
/// tokens of 8 prompts in ~65). Measured there with 64 streaming clients
/// (~265-token prompts, budget 2,048): +5.4% throughput, TTFT p50 232 ->
/// 196 ms. So a step prefills at most `prefill_chunk * (1 + 1 /
/// PREFILL_TAIL_DIV)` tokens.
pub(crate) fn chunk_limit(fed: usize, prefill_to: usize, budget: usize, prefill_chunk: usize) -> usize {
    let limit = prefill_to.min(fed + budget);
    if prefill_to - limit <= prefill_chunk / PREFILL_TAIL_DIV {
        prefill_to
    } else {
        limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_tail_finishes_its_prompt_in_the_same_step() {
        // Budget 64 of a 64-token step, so tails of up to 16 ride along.
        assert_eq!(chunk_limit(0, 100, 64, 64), 64, "36 left: cut at the budget");
        assert_eq!(chunk_limit(0, 80, 64, 64), 80, "16 left: finished now");
        assert_eq!(chunk_limit(0, 81, 64, 64), 64, "17 left: cut");
        assert_eq!(chunk_limit(10, 30, 64, 64), 30, "within the budget");
        // The allowance is a share of the step's budget, not of what is left.
        assert_eq!(chunk_limit(50, 70, 4, 64), 70, "16 past the last 4 tokens of budget");
        assert_eq!(chunk_limit(50, 71, 4, 64), 54);
        assert_eq!(chunk_limit(0, 5, 1, 3), 1, "a budget of 3 allows no tail");
    }
}
