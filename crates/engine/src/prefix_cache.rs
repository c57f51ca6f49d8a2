//! The prefix cache's bookkeeping: which backend snapshots exist, which
//! token prefix each one holds, and which to evict.
//!
//! DeltaNet's recurrent state cannot be rolled back to an earlier position,
//! so a prefix is reusable only if a copy of the whole sequence state was
//! taken exactly at its end. The engine forks a sequence (`Backend::fork`)
//! each time it crosses a block boundary (every `interval` tokens) and hands
//! the copy to this cache, keyed by the hash chain of the token blocks before
//! it. A new request restores the longest cached prefix by forking that
//! snapshot and prefills only the rest. This file owns no backend calls: it
//! returns the `SeqId`s the engine must fork or free, so it is tested on its
//! own.
//!
//! Budget: the tokens held by all snapshots (each snapshot holds the KV of
//! its whole prefix) and a cap on the number of snapshots (each one also
//! holds a full DeltaNet state and a backend sequence slot). Least recently
//! used snapshots are evicted first.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use lily_model::SeqId;

struct Entry {
    seq: SeqId,
    /// The exact prefix, compared on lookup so a hash collision can never
    /// restore the wrong state.
    tokens: Vec<u32>,
    last_used: u64,
}

/// Snapshots keyed by the hash chain of their prefix blocks.
pub struct PrefixCache {
    interval: usize,
    budget_tokens: usize,
    max_entries: usize,
    entries: HashMap<u64, Entry>,
    held_tokens: usize,
    clock: u64,
    evictions: u64,
}

/// Hash of `prev` followed by one block; the chain makes the key of block k
/// depend on every token before it.
fn chain(prev: u64, block: &[u32]) -> u64 {
    // DefaultHasher::new() uses fixed keys, so keys are stable in-process.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    block.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// `interval` 0 or a zero budget disables the cache.
    pub fn new(interval: usize, budget_tokens: usize, max_entries: usize) -> Self {
        PrefixCache { interval, budget_tokens, max_entries, entries: HashMap::new(), held_tokens: 0, clock: 0, evictions: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.interval > 0 && self.budget_tokens > 0 && self.max_entries > 0
    }

    pub fn interval(&self) -> usize {
        self.interval
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn held_tokens(&self) -> usize {
        self.held_tokens
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The next snapshot boundary strictly after `len` tokens.
    pub fn next_boundary(&self, len: usize) -> Option<usize> {
        self.enabled().then(|| (len / self.interval + 1) * self.interval)
    }

    fn key_of(&self, tokens: &[u32]) -> u64 {
        tokens.chunks(self.interval).fold(0u64, chain)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest cached prefix of `prompt` that leaves at least one token
    /// to prefill (the last position's logits are needed): the snapshot to
    /// fork and its length. Marks it used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(SeqId, usize)> {
        if !self.enabled() || self.entries.is_empty() || prompt.len() <= self.interval {
            return None;
        }
        let usable_blocks = (prompt.len() - 1) / self.interval;
        let mut key = 0u64;
        let mut best = None;
        for (b, block) in prompt.chunks(self.interval).take(usable_blocks).enumerate() {
            key = chain(key, block);
            let len = (b + 1) * self.interval;
            if let Some(e) = self.entries.get(&key) {
                if e.tokens[..] == prompt[..len] {
                    best = Some((key, len));
                }
            }
        }
        let (key, len) = best?;
        let now = self.tick();
        let e = self.entries.get_mut(&key)?;
        e.last_used = now;
        Some((e.seq, len))
    }

    /// Whether the cache could hold a snapshot of exactly `tokens`: enabled,
    /// at a boundary, and within budget on its own.
    pub fn admits(&self, tokens: &[u32]) -> bool {
        self.enabled() && !tokens.is_empty() && tokens.len().is_multiple_of(self.interval) && tokens.len() <= self.budget_tokens
    }

    /// Whether a snapshot of exactly `tokens` (or of a prefix with the same
    /// key, which is kept instead) is held.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.admits(tokens) && self.entries.contains_key(&self.key_of(tokens))
    }

    /// Marks the snapshot of exactly `tokens` used, if held: a prefix many
    /// requests pass through stays cached. Returns whether it is held.
    pub fn touch(&mut self, tokens: &[u32]) -> bool {
        if !self.admits(tokens) {
            return false;
        }
        let key = self.key_of(tokens);
        let now = self.tick();
        match self.entries.get_mut(&key) {
            Some(e) => {
                if e.tokens[..] == tokens[..] {
                    e.last_used = now;
                }
                true
            }
            None => false,
        }
    }

    /// Whether a snapshot of exactly `tokens` should be taken now (admitted
    /// and not held; a held one is marked used instead).
    pub fn wants(&mut self, tokens: &[u32]) -> bool {
        self.admits(tokens) && !self.touch(tokens)
    }

    /// Stores the snapshot `seq` of `tokens` (after `wants` said yes and the
    /// engine forked) and returns the snapshots evicted to stay within
    /// budget, which the engine must free. If the cache cannot take it after
    /// all, `seq` itself is in the returned list.
    pub fn insert(&mut self, tokens: &[u32], seq: SeqId) -> Vec<SeqId> {
        if !self.admits(tokens) {
            return vec![seq];
        }
        let key = self.key_of(tokens);
        if self.entries.contains_key(&key) {
            return vec![seq];
        }
        let mut evicted = Vec::new();
        while self.held_tokens + tokens.len() > self.budget_tokens || self.entries.len() + 1 > self.max_entries {
            match self.evict_lru() {
                Some(s) => evicted.push(s),
                None => break,
            }
        }
        let now = self.tick();
        self.held_tokens += tokens.len();
        self.entries.insert(key, Entry { seq, tokens: tokens.to_vec(), last_used: now });
        evicted
    }

    /// Evicts the least recently used snapshot; the engine frees its
    /// sequence (used when the backend needs the slot or memory back).
    pub fn evict_lru(&mut self) -> Option<SeqId> {
        let key = self.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| *k)?;
        let e = self.entries.remove(&key)?;
        self.held_tokens -= e.tokens.len();
        self.evictions += 1;
        Some(e.seq)
    }

    /// Drops every snapshot; returns the sequences to free.
    pub fn clear(&mut self) -> Vec<SeqId> {
        self.held_tokens = 0;
        self.entries.drain().map(|(_, e)| e.seq).collect()
    }
}

/// Which prompt boundaries are worth a snapshot. Each snapshot is a full
/// copy of the sequence state (KV of its whole prefix plus the DeltaNet
/// state), so one at every boundary of a long prompt would copy
/// O(len^2 / interval) tokens. Taken: the first `DENSE_HEAD` boundaries (a
/// shared system prompt or tool list diverges somewhere in there), every
/// power-of-two block count (log many, total copy under twice the prompt),
/// and the last `DENSE_TAIL` boundaries before the prompt's end (the next
/// turn of a chat, or a retried request, diverges near the end). While
/// generating, every boundary is taken: one copy per `interval` tokens.
pub fn prompt_boundary_wanted(boundary: usize, prompt_len: usize, interval: usize) -> bool {
    if interval == 0 || boundary == 0 || !boundary.is_multiple_of(interval) || boundary > prompt_len {
        return false;
    }
    let k = boundary / interval;
    k <= DENSE_HEAD || k.is_power_of_two() || boundary + DENSE_TAIL * interval > prompt_len
}

/// Boundaries always snapshotted at the start of a prompt.
pub const DENSE_HEAD: usize = 8;
/// Boundaries snapshotted before the end of a prompt.
pub const DENSE_TAIL: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i.wrapping_mul(31).wrapping_add(salt)).collect()
    }

    #[test]
    fn longest_prefix_wins_and_one_token_is_left_to_prefill() {
        let mut c = PrefixCache::new(4, 1000, 10);
        let p = toks(12, 0);
        assert!(c.wants(&p[..4]));
        assert!(c.insert(&p[..4], SeqId(1)).is_empty());
        assert!(c.wants(&p[..8]));
        assert!(c.insert(&p[..8], SeqId(2)).is_empty());
        assert_eq!(c.lookup(&p), Some((SeqId(2), 8)));
        // A prompt of exactly 8 tokens can only use the 4-token snapshot.
        assert_eq!(c.lookup(&p[..8]), Some((SeqId(1), 4)));
        assert_eq!(c.lookup(&p[..4]), None);
    }

    #[test]
    fn divergence_after_a_boundary_still_reuses_the_common_part() {
        let mut c = PrefixCache::new(4, 1000, 10);
        let p = toks(12, 0);
        c.insert(&p[..4], SeqId(1));
        c.insert(&p[..8], SeqId(2));
        let mut q = p.clone();
        q[6] = 999;
        assert_eq!(c.lookup(&q), Some((SeqId(1), 4)));
        q[0] = 999;
        assert_eq!(c.lookup(&q), None);
    }

    #[test]
    fn wants_only_boundaries_not_already_held() {
        let mut c = PrefixCache::new(4, 1000, 10);
        let p = toks(8, 0);
        assert!(!c.wants(&p[..3]));
        assert!(c.wants(&p[..4]));
        c.insert(&p[..4], SeqId(1));
        assert!(!c.wants(&p[..4]));
        // Inserting a duplicate hands the sequence back.
        assert_eq!(c.insert(&p[..4], SeqId(9)), vec![SeqId(9)]);
    }

    #[test]
    fn lru_eviction_by_tokens_and_by_entries() {
        let mut c = PrefixCache::new(4, 16, 10);
        let a = toks(8, 1);
        let b = toks(8, 2);
        let d = toks(8, 3);
        c.insert(&a, SeqId(1));
        c.insert(&b, SeqId(2));
        assert_eq!(c.held_tokens(), 16);
        // Touch a, so b is the least recently used.
        assert_eq!(c.lookup(&[a.clone(), vec![0]].concat()), Some((SeqId(1), 8)));
        assert_eq!(c.insert(&d, SeqId(3)), vec![SeqId(2)]);
        assert_eq!(c.held_tokens(), 16);
        assert_eq!(c.evictions(), 1);
        assert_eq!(c.lookup(&[b.clone(), vec![0]].concat()), None);

        let mut c = PrefixCache::new(4, 1000, 2);
        c.insert(&a[..4], SeqId(1));
        c.insert(&b[..4], SeqId(2));
        assert_eq!(c.insert(&d[..4], SeqId(3)), vec![SeqId(1)]);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_snapshot_larger_than_the_budget_is_refused() {
        let mut c = PrefixCache::new(4, 4, 10);
        let a = toks(8, 1);
        assert!(!c.wants(&a));
        assert_eq!(c.insert(&a, SeqId(5)), vec![SeqId(5)]);
        assert!(c.is_empty());
    }

    #[test]
    fn disabled_cache_holds_nothing() {
        let mut c = PrefixCache::new(0, 100, 10);
        assert!(!c.enabled());
        assert!(!c.wants(&[1, 2, 3, 4]));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), None);
        assert_eq!(c.next_boundary(3), None);
    }

    #[test]
    fn prompt_boundaries_dense_at_both_ends_sparse_between() {
        let taken: Vec<usize> = (1..=100).map(|k| k * 10).filter(|&b| prompt_boundary_wanted(b, 1005, 10)).map(|b| b / 10).collect();
        assert_eq!(taken, vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 97, 98, 99, 100]);
        assert!(!prompt_boundary_wanted(15, 1000, 10));
        assert!(!prompt_boundary_wanted(1010, 1005, 10));
        assert!(!prompt_boundary_wanted(10, 100, 0));
    }

    #[test]
    fn contains_and_touch_do_not_insert() {
        let mut c = PrefixCache::new(2, 100, 10);
        assert!(c.admits(&[1, 2]) && !c.admits(&[1, 2, 3]));
        assert!(!c.contains(&[1, 2]));
        assert!(!c.touch(&[1, 2]));
        c.insert(&[1, 2], SeqId(1));
        assert!(c.contains(&[1, 2]) && c.touch(&[1, 2]));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn clear_returns_every_sequence() {
        let mut c = PrefixCache::new(2, 100, 10);
        c.insert(&[1, 2], SeqId(1));
        c.insert(&[1, 2, 3, 4], SeqId(2));
        let mut all = c.clear();
        all.sort();
        assert_eq!(all, vec![SeqId(1), SeqId(2)]);
        assert_eq!(c.held_tokens(), 0);
    }
}
