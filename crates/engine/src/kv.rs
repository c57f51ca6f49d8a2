//! The engine's ledger of backend memory: which backend sequences are held
//! (by admitted requests and by the prefix cache's snapshots), how far each
//! request's sequence has been fed and how much prefill it still has to do
//! (the KV blocks it has reserved), and the rules built on that data:
//! whether a request fits the KV pool (`Backend::kv_room`), getting a
//! sequence for it (a fork of a cached prefix or a fresh one, evicting
//! snapshots for a slot or for memory), and which holder is the one to give
//! memory back when the pool runs out (the youngest).
//!
//! Requests are known here only by their admission age (`Age`, increasing
//! in admission order), so the oldest-first policies need no request data.
//! A sequence can be ahead of its request: fed by decode steps submitted
//! and not yet collected (`Backend::submit_decode`). Such a sequence is
//! never freed while a step still computes on it: when its request ends
//! meanwhile it becomes an orphan, freed as its last step is collected.
//! This file owns no request state (tokens, events, sampling: the
//! scheduler) and no cache policy (which prefixes to keep: `prefix_cache.rs`);
//! it holds the cache as the memory the engine can take back at will.

use std::collections::BTreeMap;

use lily_model::{Backend, ModelError, SeqId};

use crate::api::EngineError;
use crate::prefix_cache::{prompt_boundary_wanted, PrefixCache};

/// Admission order of a request: a younger request has a larger age.
pub(crate) type Age = u64;

/// The backend sequence an admitted request holds.
pub(crate) struct Holding {
    pub(crate) seq: SeqId,
    /// Tokens the sequence has consumed, those fed by steps in flight
    /// included.
    pub(crate) fed: usize,
    /// Where the prefill ends: the prompt, or after a preemption every
    /// token but the last sampled one (the next decode feeds that one).
    pub(crate) prefill_to: usize,
    /// Decode steps submitted with this sequence and not collected yet.
    pub(crate) ahead: usize,
    /// The largest `fed` already offered to the prefix cache.
    offered: usize,
}

impl Holding {
    pub(crate) fn prefilling(&self) -> bool {
        self.fed < self.prefill_to
    }

    /// KV blocks of `block` tokens the sequence will still take to finish
    /// its prefill.
    fn reserved_blocks(&self, block: usize) -> usize {
        if self.prefilling() {
            self.prefill_to.div_ceil(block) - self.fed.div_ceil(block)
        } else {
            0
        }
    }
}

/// Whether a request's KV memory fits the backend's pool.
pub(crate) enum KvFit {
    Fits,
    /// Not beside what is held now.
    NotNow,
    /// Not even in the empty pool (which holds this many tokens).
    Never(usize),
}

/// What admission got for a request.
pub(crate) enum Acquired {
    /// A sequence holding `cached` tokens of the request's prefix.
    Go(SeqId, usize),
    /// Running requests hold what it needs: try again when one ends.
    Wait,
    Fail(EngineError),
}

pub(crate) struct KvLedger {
    /// `Backend::max_sequences`: request sequences and snapshots together.
    max_sequences: usize,
    /// Snapshots: backend memory the engine may free at any time.
    pub(crate) cache: PrefixCache,
    /// Sequences held by admitted requests, oldest first.
    held: BTreeMap<Age, Holding>,
    /// Sequences of ended requests that steps in flight still compute on.
    orphans: BTreeMap<Age, Holding>,
}

impl KvLedger {
    pub(crate) fn new(max_sequences: usize, cache: PrefixCache) -> Self {
        KvLedger { max_sequences, cache, held: BTreeMap::new(), orphans: BTreeMap::new() }
    }

    pub(crate) fn holding(&self, age: Age) -> Option<&Holding> {
        self.held.get(&age)
    }

    pub(crate) fn holding_mut(&mut self, age: Age) -> Option<&mut Holding> {
        self.held.get_mut(&age)
    }

    /// Requests holding a backend sequence (not preempted).
    pub(crate) fn holders(&self) -> usize {
        self.held.len()
    }

    /// The youngest request holding a sequence: the one that gives its
    /// memory back when the pool runs out.
    pub(crate) fn youngest(&self) -> Option<Age> {
        self.held.keys().next_back().copied()
    }

    /// Records that request `age` holds `seq`, fed with `fed` tokens and to
    /// be prefilled up to `prefill_to`.
    pub(crate) fn hold(&mut self, age: Age, seq: SeqId, fed: usize, prefill_to: usize) {
        self.held.insert(age, Holding { seq, fed, prefill_to, ahead: 0, offered: fed });
    }

    /// Frees request `age`'s sequence, if it holds one; one that steps in
    /// flight still compute on is freed when the last of them is collected.
    pub(crate) fn release(&mut self, backend: &mut dyn Backend, age: Age) {
        match self.held.remove(&age) {
            Some(h) if h.ahead > 0 => {
                self.orphans.insert(age, h);
            }
            Some(h) => backend.free(h.seq),
            None => {}
        }
    }

    /// A decode step feeding request `age`'s sequence one token was
    /// submitted.
    pub(crate) fn submitted(&mut self, age: Age) {
        if let Some(h) = self.held.get_mut(&age) {
            h.fed += 1;
            h.ahead += 1;
        }
    }

    /// A submitted step with request `age`'s sequence was collected; an
    /// orphan no step computes on any more is freed.
    pub(crate) fn landed(&mut self, backend: &mut dyn Backend, age: Age) {
        if let Some(h) = self.held.get_mut(&age) {
            h.ahead = h.ahead.saturating_sub(1);
        } else if let Some(h) = self.orphans.get_mut(&age) {
            h.ahead = h.ahead.saturating_sub(1);
            if h.ahead == 0 {
                backend.free(h.seq);
                self.orphans.remove(&age);
            }
        }
    }

    /// Frees every sequence, requests' and snapshots' alike (after a panic,
    /// or at shutdown when no request is left).
    pub(crate) fn clear(&mut self, backend: &mut dyn Backend) {
        let orphans = std::mem::take(&mut self.orphans);
        for (_, h) in std::mem::take(&mut self.held).into_iter().chain(orphans) {
            backend.free(h.seq);
        }
        self.clear_cache(backend);
    }

    /// Frees every snapshot.
    pub(crate) fn clear_cache(&mut self, backend: &mut dyn Backend) {
        for seq in self.cache.clear() {
            backend.free(seq);
        }
    }

    /// Backend sequences in use: requests', orphans and snapshots.
    fn slots_used(&self) -> usize {
        self.held.len() + self.orphans.len() + self.cache.len()
    }

    /// Evicts snapshots until one more sequence fits; false if it cannot.
    pub(crate) fn make_room_for_one(&mut self, backend: &mut dyn Backend) -> bool {
        self.make_room_for(backend, 1)
    }

    /// Evicts snapshots until `n` more sequences fit; false if they cannot.
    pub(crate) fn make_room_for(&mut self, backend: &mut dyn Backend, n: usize) -> bool {
        while self.slots_used() + n > self.max_sequences {
            match self.cache.evict_lru() {
                Some(seq) => backend.free(seq),
                None => return false,
            }
        }
        true
    }

    /// KV blocks the admitted requests still have to take to finish their
    /// prefill.
    fn reserved_blocks(&self, block: usize) -> usize {
        self.held.values().map(|h| h.reserved_blocks(block)).sum()
    }

    /// Whether a request that prefills up to `target` tokens, `cached` of
    /// them restored from a snapshot, fits the KV pool now, beside what the
    /// admitted requests still have to prefill and with one block to grow
    /// into. Backends without a fixed pool always have room.
    pub(crate) fn fits(&self, backend: &dyn Backend, target: usize, cached: usize) -> KvFit {
        let Some(room) = backend.kv_room() else {
            return KvFit::Fits;
        };
        let b = room.block_tokens.max(1);
        // A fork shares the snapshot's full blocks and copies the last one.
        let need = target.div_ceil(b) - cached / b + 1;
        if target.div_ceil(b) + 1 > room.total_tokens / b {
            return KvFit::Never(room.total_tokens);
        }
        let free = (room.free_tokens / b).saturating_sub(self.reserved_blocks(b));
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
    pub(crate) fn acquire(&mut self, backend: &mut dyn Backend, tokens: &[u32], target: usize) -> Acquired {
        if !self.make_room_for_one(backend) {
            if self.holders() == 0 {
                // No slot will ever free up (a backend with no sequences).
                return Acquired::Fail(EngineError::Capacity(format!("the backend holds at most {} sequences", backend.max_sequences())));
            }
            return Acquired::Wait;
        }
        let hit = loop {
            let hit = self.cache.lookup(&tokens[..target]);
            match self.fits(backend, target, hit.map_or(0, |h| h.1)) {
                KvFit::Fits => break hit,
                KvFit::Never(total) => {
                    return Acquired::Fail(EngineError::Capacity(format!(
                        "KV cache full: this request needs {target} tokens of KV cache \
                         and some room to grow; the whole pool holds {total}"
                    )))
                }
                KvFit::NotNow => match self.cache.evict_lru() {
                    Some(seq) => backend.free(seq),
                    // Memory comes back as running requests end.
                    None if self.holders() > 0 => return Acquired::Wait,
                    None => break hit,
                },
            }
        };
        // Restore from the snapshot. If the backend has no memory for the
        // copy, fall back to a fresh sequence (whose retry loop may evict
        // snapshots, the hit included) rather than fail.
        let forked = hit.and_then(|(snap, len)| match backend.fork(snap) {
            Ok(seq) => Some(Ok((seq, len))),
            Err(ModelError::Capacity(_)) => None,
            Err(e) => Some(Err(e)),
        });
        let got = forked.unwrap_or_else(|| self.evicting(backend, |b| b.alloc()).map(|s| (s, 0)));
        match got {
            Ok((seq, cached)) => Acquired::Go(seq, cached),
            Err(ModelError::Capacity(m)) if self.holders() > 0 => {
                tracing::debug!("admission deferred: {m}");
                Acquired::Wait
            }
            Err(e) => Acquired::Fail(model_error(e)),
        }
    }

    /// Runs `f`, a backend call that may need memory (alloc, prefill,
    /// decode); on a capacity error evicts the least recently used
    /// snapshot and retries, until `f` succeeds or no snapshot is left.
    /// Snapshots are the only memory the engine can give back without
    /// failing a request. Retrying is sound because a backend that answers
    /// `Capacity` has changed no sequence's length (the CUDA backend
    /// reserves KV blocks before it runs anything).
    pub(crate) fn evicting<T>(&mut self, backend: &mut dyn Backend, mut f: impl FnMut(&mut dyn Backend) -> Result<T, ModelError>) -> Result<T, ModelError> {
        loop {
            match f(backend) {
                Err(ModelError::Capacity(m)) => match self.cache.evict_lru() {
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

    /// Hands the cache a copy of request `age`'s sequence, whose consumed
    /// tokens are `tokens[..fed]` (a prompt of `prompt_len`), if it sits at
    /// a boundary worth a snapshot (see `prompt_boundary_wanted`; every
    /// boundary while generating) that the cache does not hold yet. Each
    /// length is offered once, as soon as the request knows every token the
    /// sequence consumed (a step in flight may have fed one it has not seen
    /// yet); a sequence fed a token its request never keeps (a step run
    /// ahead past a stop) is never offered, since the request has ended.
    pub(crate) fn maybe_snapshot(&mut self, backend: &mut dyn Backend, age: Age, tokens: &[u32], prompt_len: usize) {
        let Some(h) = self.held.get_mut(&age) else {
            return;
        };
        let (seq, fed) = (h.seq, h.fed);
        if fed <= h.offered || fed > tokens.len() {
            return;
        }
        h.offered = fed;
        if self.cache.next_boundary(fed - 1) != Some(fed) {
            return;
        }
        let in_prompt = fed <= prompt_len;
        if in_prompt && !prompt_boundary_wanted(fed, prompt_len, self.cache.interval()) {
            return;
        }
        if !self.cache.wants(&tokens[..fed]) {
            return;
        }
        // A snapshot never takes a slot a request could use: only evict
        // other snapshots for it.
        if !self.make_room_for_one(backend) {
            return;
        }
        match backend.fork(seq) {
            Ok(copy) => {
                for seq in self.cache.insert(&tokens[..fed], copy) {
                    backend.free(seq);
                }
            }
            // No memory for a snapshot is not an error for the request.
            Err(e) => tracing::debug!("prefix snapshot skipped: {e}"),
        }
    }

    /// Where a prefill chunk of a request (`tokens`, a prompt of
    /// `prompt_len`) from `start` ends, and where inside it a snapshot is
    /// captured: the first boundary in (start, limit) that will be
    /// snapshotted is captured inside the chunk (`Backend::prefill_capture`),
    /// and the chunk ends at `limit` or at the next such boundary (which
    /// `maybe_snapshot` then takes at the chunk's end). A boundary at
    /// `limit` itself is taken at the end, not captured. Other boundaries do
    /// not cut the chunk (large chunks keep prefill efficient).
    pub(crate) fn chunk_plan(&self, tokens: &[u32], prompt_len: usize, start: usize, limit: usize) -> (usize, Option<usize>) {
        let interval = self.cache.interval();
        let Some(mut b) = self.cache.next_boundary(start) else {
            return (limit, None);
        };
        let mut capture = None;
        while b < limit {
            if prompt_boundary_wanted(b, prompt_len, interval) && self.cache.admits(&tokens[..b]) && !self.cache.contains(&tokens[..b]) {
                if capture.is_some() {
                    return (b, capture);
                }
                capture = Some(b);
            }
            b += interval;
        }
        (limit, capture)
    }

    /// Files the snapshot `snap` of request `age`'s first `at` tokens
    /// (captured inside a prefill chunk) in the prefix cache, or frees it.
    pub(crate) fn insert_captured(&mut self, backend: &mut dyn Backend, tokens: &[u32], at: usize, snap: SeqId) {
        if at > tokens.len() || !self.cache.wants(&tokens[..at]) {
            backend.free(snap);
            return;
        }
        for seq in self.cache.insert(&tokens[..at], snap) {
            backend.free(seq);
        }
    }
}

/// The error for a request whose prefill or decode failed. Out of memory
/// there means the KV cache is full even with every snapshot evicted.
pub(crate) fn work_error(e: ModelError) -> EngineError {
    match e {
        ModelError::Capacity(m) => EngineError::Capacity(format!(
            "KV cache full: no memory left for this request after evicting every \
             prefix-cache snapshot ({m})"
        )),
        other => model_error(other),
    }
}

pub(crate) fn model_error(e: ModelError) -> EngineError {
    match e {
        ModelError::Capacity(m) => EngineError::Capacity(m),
        other => EngineError::Backend(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(interval: usize) -> KvLedger {
        KvLedger::new(8, PrefixCache::new(interval, 1 << 20, 16))
    }

    #[test]
    fn a_snapshot_boundary_inside_a_chunk_is_captured_not_cut() {
        let toks: Vec<u32> = (0..2000).collect();
        let l = ledger(256);
        // A 265-token prompt: boundary 256 inside the only chunk.
        assert_eq!(l.chunk_plan(&toks, 265, 0, 265), (265, Some(256)));
        // A boundary at the chunk's end is taken there, not captured.
        assert_eq!(l.chunk_plan(&toks, 600, 0, 256), (256, None));
        // Two wanted boundaries in reach: the first captured, the chunk
        // ends at the second (snapshotted at the end).
        assert_eq!(l.chunk_plan(&toks, 2000, 0, 1024), (512, Some(256)));
        // No boundary between 1,800 and 2,000; 2,304 (9 blocks) is wanted
        // by no rule in a 4,000-token prompt (not in the head of 8, not a
        // power of two, not in the last 4), so it does not cut either.
        assert_eq!(l.chunk_plan(&toks, 2000, 1800, 2000), (2000, None));
        let long: Vec<u32> = (0..4000).collect();
        assert_eq!(l.chunk_plan(&long, 4000, 2100, 2400), (2400, None));
        // No prefix cache: chunks run to their limit.
        let off = KvLedger::new(8, PrefixCache::new(256, 0, 16));
        assert_eq!(off.chunk_plan(&toks, 265, 0, 265), (265, None));
    }
}
