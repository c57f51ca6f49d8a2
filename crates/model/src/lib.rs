//! lily-model: the boundary between the engine and a backend.
//!
//! A backend owns the weights on its device and the per-sequence state (KV
//! cache for the attention layers, conv window and recurrent state for the
//! DeltaNet layers). The engine only sees sequence handles, token ids,
//! prefill logits and decode draws (sampled by the backend with the one
//! definition in `sample`, possibly pipelined: `submit_decode`); how a
//! backend fuses the layer sequence is its own business, and every backend
//! is tested against the CPU reference and the goldens.

pub mod contract;
pub mod sample;

pub use sample::{SampleParams, SampleState, Sampled, MAX_TOP_LOGPROBS};

/// Most pipelined decode steps in flight at once (`Backend::submit_decode`).
pub const MAX_IN_FLIGHT: usize = 2;

/// What a pipelined decode step feeds one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// This token: the sequence's first decode after a prefill, or any
    /// step whose input the caller knows.
    Token(u32),
    /// The token this sequence's most recent submitted step drew, collected
    /// or not (on a device it never leaves the device). Valid only when
    /// that step was a `submit_decode` of this backend and nothing was fed
    /// to the sequence since.
    Previous,
}

/// A decode step submitted with `Backend::submit_decode` and not collected
/// yet. Handed back to `collect_decode`, oldest first.
#[must_use = "a submitted step must be collected"]
#[derive(Debug)]
pub enum InFlight {
    /// Already computed (the synchronous default): the draws, batch order.
    Ready(Vec<Sampled>),
    /// Still running on the device: the backend's own tag and the batch
    /// size.
    Device { ticket: u64, len: usize },
}

use lily_core::ModelConfig;

/// Handle of one sequence's state inside a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The backend has no room for another sequence or more tokens.
    #[error("capacity: {0}")]
    Capacity(String),
    /// The request is malformed for this model (token id out of range...).
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("unknown sequence {0:?}")]
    UnknownSequence(SeqId),
    /// A device error (CUDA launch failure, out of memory...).
    #[error("device: {0}")]
    Device(String),
}

pub type ModelResult<T> = Result<T, ModelError>;

/// Which positions' logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last position (normal generation).
    Last,
    /// Every position (goldens, accuracy checks, teacher forcing).
    All,
}

/// A part of `Backend::prefill_capture`: the sequence, its tokens, and
/// where among them to capture a snapshot.
pub type CapturePart<'a> = (SeqId, &'a [u32], Option<usize>);
/// What `Backend::prefill_capture` returns: each part's last-position
/// logits and its snapshot, in part order.
pub type Captured = (Vec<Vec<f32>>, Vec<Option<SeqId>>);
/// What `Backend::prefill_capture_sampling` returns: `Captured` and each
/// part's draw, if the backend drew it, in part order.
pub type CapturedDraws = (Captured, Vec<Option<Sampled>>);

/// What a backend says of carrying decode rows in a prefill call
/// (`Backend::mixed_steps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedSteps {
    /// Not on this backend, or not for that many rows (a promise it keeps
    /// would break, e.g. batch invariance, or its decode scratch is too
    /// small).
    Never,
    /// It gives the same tokens up to numerics the backend documents, but
    /// its speed is not established: only when the operator asks.
    Possible,
    /// Measured to pay: the engine mixes by default.
    Pays,
}

/// A model on some device, serving many sequences.
pub trait Backend: Send {
    /// Short name for logs and `/v1/models` (e.g. "cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;
    fn config(&self) -> &ModelConfig;
    /// Longest sequence (prompt + generated) one sequence may hold.
    fn max_seq_len(&self) -> usize;
    /// How many sequences can hold state at once.
    fn max_sequences(&self) -> usize;

    /// Creates an empty sequence.
    fn alloc(&mut self) -> ModelResult<SeqId>;
    /// Releases a sequence's memory; unknown ids are ignored.
    fn free(&mut self, seq: SeqId);
    /// Copies a sequence's whole state into a new sequence (prefix-cache
    /// snapshots, `n > 1` sampling).
    fn fork(&mut self, seq: SeqId) -> ModelResult<SeqId>;
    /// Tokens consumed so far by the sequence.
    fn seq_len(&self, seq: SeqId) -> ModelResult<usize>;

    /// Appends `tokens` to the sequence and returns logits (`vocab_size`
    /// floats per returned position).
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], wanted: LogitsWanted) -> ModelResult<Vec<Vec<f32>>>;
    /// Prefills several distinct sequences in one call: appends each
    /// part's tokens (non-empty) to its sequence and returns each part's
    /// last-position logits, in part order. The same result as calling
    /// `prefill(seq, tokens, LogitsWanted::Last)` part by part; a backend
    /// overrides this to run every part's tokens through one pass, so a
    /// matrix weight is read once for all of them.
    ///
    /// Errors: `Capacity` changed no sequence (room for every part is
    /// checked before any is prefilled), so the caller may retry any
    /// subset; nor did `Invalid` or `UnknownSequence` from the checks up
    /// front (the default's are `check_batch_room`'s; a backend may check
    /// more, e.g. token ids). After any other error any part's sequence may
    /// have advanced (the caller compares `seq_len`).
    ///
    /// The default is `prefill_each`.
    fn prefill_batch(&mut self, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
        prefill_each(self, parts)
    }

    /// `prefill_batch`, and for each part with a capture point `at` (0 <
    /// at < its token count) a new sequence holding the state after the
    /// first `at` of its tokens: what `prefill(seq, tokens[..at])`,
    /// `fork(seq)` and `prefill(seq, tokens[at..])` leave (prefix-cache
    /// snapshots at a boundary inside a prefill chunk). A capture the
    /// backend has no room for comes back as None; that is not an error.
    /// The logits are those of `prefill_batch` of the whole parts.
    ///
    /// Errors as `prefill_batch`'s. The default (`prefill_capture_split`)
    /// runs the prefixes, forks and the rest, in two batches; a backend
    /// overrides it to take the snapshots inside one pass.
    fn prefill_capture(&mut self, parts: &[CapturePart]) -> ModelResult<Captured> {
        prefill_capture_split(self, parts)
    }

    /// `prefill_capture`, and for each part whose `states` entry is `Some`
    /// (one entry per part) its next token drawn from its last-position
    /// logits, where the backend can do that without handing the logits
    /// over (a device sampler): the draw is `sample::sample_host`'s, as in
    /// `decode_sample`, that state has recorded it (`record_draw`), and the
    /// part's logits row comes back empty. A backend may decline any part:
    /// its draw is `None`, its state untouched and its logits returned, for
    /// the caller to draw from. The default declines every part.
    ///
    /// Errors as `prefill_capture`'s; on an error no state has advanced.
    fn prefill_capture_sampling(&mut self, parts: &[CapturePart], states: &mut [Option<SampleState>]) -> ModelResult<CapturedDraws> {
        if states.len() != parts.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a prefill of {} parts", states.len(), parts.len())));
        }
        Ok((self.prefill_capture(parts)?, vec![None; parts.len()]))
    }

    /// Appends one token to each sequence of the batch (distinct sequences)
    /// and returns each one's next-token logits, in batch order.
    fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>>;

    /// Prefills `tokens` and returns the greedy next token. Backends that can
    /// take the argmax on the device override this to avoid copying logits.
    fn prefill_greedy(&mut self, seq: SeqId, tokens: &[u32]) -> ModelResult<u32> {
        let logits = self.prefill(seq, tokens, LogitsWanted::Last)?;
        let last = logits.last().ok_or_else(|| ModelError::Invalid("empty prompt".into()))?;
        Ok(argmax(last))
    }

    /// Runs `steps` greedy decode steps starting from `first` (already
    /// sampled, not yet fed) and returns the `steps` tokens produced. Backends
    /// override this with a loop that never returns to the host per token.
    fn decode_greedy(&mut self, seq: SeqId, first: u32, steps: usize) -> ModelResult<Vec<u32>> {
        let mut out = Vec::with_capacity(steps);
        let mut token = first;
        for _ in 0..steps {
            let logits = self.decode(&[(seq, token)])?;
            token = argmax(&logits[0]);
            out.push(token);
        }
        Ok(out)
    }

    /// `steps` greedy steps of every sequence of `batch` decoded together
    /// (each from its first token, already chosen, not yet fed); returns
    /// each sequence's `steps` tokens. The same tokens as decoding each
    /// sequence alone. Backends override this with a loop that stays on the
    /// device (the batch throughput probe of `lily bench --batch`).
    fn decode_greedy_batch(&mut self, batch: &[(SeqId, u32)], steps: usize) -> ModelResult<Vec<Vec<u32>>> {
        let mut out: Vec<Vec<u32>> = vec![Vec::with_capacity(steps); batch.len()];
        let mut feed: Vec<(SeqId, u32)> = batch.to_vec();
        for _ in 0..steps {
            let logits = self.decode(&feed)?;
            for ((o, f), l) in out.iter_mut().zip(feed.iter_mut()).zip(&logits) {
                f.1 = argmax(l);
                o.push(f.1);
            }
        }
        Ok(out)
    }

    /// One decode step for a batch (as `decode`) that also chooses each
    /// sequence's next token with its `SampleState` (same order, one per
    /// entry) and advances that state (`SampleState::record_draw`). The
    /// chosen tokens are not fed; the next call feeds them. The draw is
    /// `sample::sample_host`'s, whatever the device: `vocab_limit` and
    /// `top_logprobs` included. On an error no state has advanced; as with
    /// `decode`, a `Capacity` error changed no sequence. Backends that
    /// sample on the device override this to avoid copying logits; this
    /// default samples on the host (sample.rs). The engine decodes through
    /// this (or `submit_decode`), never through `decode`.
    fn decode_sample(&mut self, batch: &[(SeqId, u32)], states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a batch of {}", states.len(), batch.len())));
        }
        let logits = self.decode(batch)?;
        Ok(logits.iter().zip(states.iter_mut()).map(|(l, s)| sample::sample_host(l, s)).collect())
    }

    /// Pipelined decode, first half: starts one decode step for a batch of
    /// distinct sequences (as `decode_sample`, states in the same order)
    /// and returns before its draws are known, so the caller can stream the
    /// previous step's tokens while this one runs. `collect_decode` hands
    /// back the draws.
    ///
    /// Contract:
    /// - At most `MAX_IN_FLIGHT` steps are uncollected at once; they are
    ///   collected in submission order. A sequence may be in both (the
    ///   second feeds it `Feed::Previous`).
    /// - When this returns `Ok`, every sequence of the batch has consumed
    ///   its fed token: `seq_len` counts it, and its KV room was reserved.
    /// - Each state's `step` has advanced by one (`begin_draw`: the draw's
    ///   counter is the value before). The drawn token is counted in the
    ///   state and is its `last_draw` (`end_draw`) by the time
    ///   `collect_decode` returns; a backend may do that earlier (the
    ///   default, which draws here, does it here). A backend that mirrors
    ///   the counts on its device keeps its table exact across the steps
    ///   in flight (the host counts lag until the collect).
    /// - While a sequence is in an uncollected step, the caller may fork it
    ///   (the copy holds every submitted token, in-flight ones included)
    ///   and ask its `seq_len`, and must not free, prefill or decode it by
    ///   another call. Other sequences may be used freely meanwhile.
    /// - On an error nothing was started and no state advanced; as with
    ///   `decode`, `Capacity` changed no sequence, and another error may
    ///   have (the caller compares `seq_len`). Steps already in flight are
    ///   unaffected and still to be collected.
    ///
    /// The default runs the step synchronously through `decode_sample`
    /// (`Feed::Previous` is the state's `last_draw`) and returns it ready.
    fn submit_decode(&mut self, batch: &[(SeqId, Feed)], states: &mut [SampleState]) -> ModelResult<InFlight> {
        if states.len() != batch.len() {
            return Err(ModelError::Invalid(format!("{} sampling states for a batch of {}", states.len(), batch.len())));
        }
        let mut fed = Vec::with_capacity(batch.len());
        for (&(seq, feed), st) in batch.iter().zip(states.iter()) {
            let token = match feed {
                Feed::Token(t) => t,
                Feed::Previous => st.last_draw().ok_or_else(|| ModelError::Invalid(format!("{seq:?} is fed its previous draw but has none")))?,
            };
            fed.push((seq, token));
        }
        Ok(InFlight::Ready(self.decode_sample(&fed, states)?))
    }

    /// Pipelined decode, second half: waits for the oldest uncollected
    /// step (`step`, as `submit_decode` returned it) and returns its draws
    /// in batch order. `states` are the step's sequences' states in the
    /// same order; for a sequence whose draw the caller will discard (its
    /// request ended meanwhile) any state may stand in. On an error the
    /// step's draws are lost and its sequences' states are unknown (the
    /// caller frees them).
    fn collect_decode(&mut self, step: InFlight, states: &mut [SampleState]) -> ModelResult<Vec<Sampled>> {
        match step {
            InFlight::Ready(draws) if draws.len() == states.len() => Ok(draws),
            InFlight::Ready(draws) => Err(ModelError::Invalid(format!("{} sampling states to collect a step of {}", states.len(), draws.len()))),
            InFlight::Device { .. } => Err(ModelError::Invalid("a device step handed to a backend that runs steps synchronously".into())),
        }
    }

    /// Prompt tokens per engine step this backend prefills efficiently
    /// (the default of the server's `--prefill-chunk`), when it differs from
    /// the engine's default. A GPU backend whose prefill cost barely grows
    /// with tokens up to a few thousand wants larger steps, so the chunks
    /// of several new requests share one `prefill_batch` pass.
    fn preferred_prefill_chunk(&self) -> Option<usize> {
        None
    }

    /// Readies pipelined decode steps of 1..=`max_batch` sequences before
    /// the first requests (the CUDA backend captures each batch size's
    /// step graph, which the first step of that size would otherwise pay
    /// for while every running stream waits); returns how many sizes it
    /// prepared. Nothing else changes: no sequence, no state.
    fn prepare_decode(&mut self, max_batch: usize) -> ModelResult<usize> {
        let _ = max_batch;
        Ok(0)
    }

    /// Whether decode rows may ride in a prefill call on this backend: when
    /// an engine step has both a decode step for the generating sequences
    /// and prompt chunks to prefill, one `prefill_capture_sampling` call
    /// can take each generating sequence as a one-token part beside the
    /// chunks, so every weight is read once for both (a mixed step).
    /// `rows` is the number of decode rows. The default, `Never`, keeps the
    /// two apart.
    fn mixed_steps(&self, rows: usize) -> MixedSteps {
        let _ = rows;
        MixedSteps::Never
    }

    /// Bytes of device memory in use (weights + state), if the backend knows.
    fn memory_in_use(&self) -> Option<u64> {
        None
    }

    /// Room left in the KV memory all sequences share, for backends whose
    /// KV cache is a fixed pool (the CUDA backend); `None` where memory
    /// grows on demand (the CPU backend). The engine admits work only when
    /// it fits, so requests wait rather than fail.
    fn kv_room(&self) -> Option<KvRoom> {
        None
    }
}

/// The last row of the logits a prefill of `seq` returned (what
/// `LogitsWanted::Last` asks for); none is a device error.
pub fn last_row(seq: SeqId, rows: Vec<Vec<f32>>) -> ModelResult<Vec<f32>> {
    rows.into_iter().last().ok_or_else(|| ModelError::Device(format!("prefill of {seq:?} returned no logits")))
}

/// `Backend::prefill_batch` part by part: checks every part first
/// (`check_batch_room`), then calls `prefill` for each. Should a part still
/// be refused for room after an earlier one was prefilled (a limit the
/// checks do not see), it answers `Device`, not `Capacity`, so that
/// `Capacity` keeps meaning "nothing changed".
pub fn prefill_each<B: Backend + ?Sized>(backend: &mut B, parts: &[(SeqId, &[u32])]) -> ModelResult<Vec<Vec<f32>>> {
    check_batch_room(backend, parts)?;
    let mut out = Vec::with_capacity(parts.len());
    for (k, &(seq, tokens)) in parts.iter().enumerate() {
        let rows = match backend.prefill(seq, tokens, LogitsWanted::Last) {
            Err(ModelError::Capacity(m)) if k > 0 => {
                return Err(ModelError::Device(format!("out of room after {k} of {} parts were prefilled: {m}", parts.len())))
            }
            other => other?,
        };
        out.push(last_row(seq, rows)?);
    }
    Ok(out)
}

/// `Backend::prefill_capture` as two batches: every captured part's prefix,
/// a fork of each, then the rest of every part. Room for the whole parts is
/// checked first, so a `Capacity` error leaves every sequence as it was.
/// Without any capture point it is `prefill_batch`.
pub fn prefill_capture_split<B: Backend + ?Sized>(backend: &mut B, parts: &[CapturePart]) -> ModelResult<Captured> {
    for &(seq, tokens, at) in parts {
        if let Some(at) = at {
            if at == 0 || at >= tokens.len() {
                return Err(ModelError::Invalid(format!("capture point {at} of {seq:?} is not inside its {} tokens", tokens.len())));
            }
        }
    }
    let whole: Vec<(SeqId, &[u32])> = parts.iter().map(|&(seq, tokens, _)| (seq, tokens)).collect();
    // No capture, or no room for the whole parts: the call the caller would
    // make without captures (which may refuse for memory, changing nothing).
    if parts.iter().all(|p| p.2.is_none()) || check_batch_room(backend, &whole).is_err() {
        let rows = match whole[..] {
            [(seq, tokens)] => vec![last_row(seq, backend.prefill(seq, tokens, LogitsWanted::Last)?)?],
            _ => backend.prefill_batch(&whole)?,
        };
        return Ok((rows, vec![None; parts.len()]));
    }
    let prefixes: Vec<(SeqId, &[u32])> = parts.iter().filter_map(|&(seq, tokens, at)| at.map(|at| (seq, &tokens[..at]))).collect();
    backend.prefill_batch(&prefixes)?;
    let rest: Vec<(SeqId, &[u32])> = parts.iter().map(|&(seq, tokens, at)| (seq, &tokens[at.unwrap_or(0)..])).collect();
    // A snapshot never takes room the rest of the parts need: one that
    // does (a fork may copy a partly filled KV block) is given back.
    let mut snaps = Vec::with_capacity(parts.len());
    for &(seq, _, at) in parts {
        let snap = match at {
            Some(_) => backend.fork(seq).ok(),
            None => None,
        };
        snaps.push(match snap {
            Some(s) if check_batch_room(backend, &rest).is_err() => {
                backend.free(s);
                None
            }
            other => other,
        });
    }
    match backend.prefill_batch(&rest) {
        Ok(rows) => Ok((rows, snaps)),
        Err(e) => {
            for s in snaps.into_iter().flatten() {
                backend.free(s);
            }
            // The prefixes advanced: never report that as "nothing changed".
            Err(match e {
                ModelError::Capacity(m) => ModelError::Device(format!("out of room after the captured prefixes were prefilled: {m}")),
                other => other,
            })
        }
    }
}

/// The checks `Backend::prefill_batch`'s default makes before it prefills
/// anything: every part names a known sequence once and has tokens, no
/// sequence outgrows `max_seq_len`, and (for a backend with a fixed KV pool)
/// the pool has the blocks every part needs, counted as the pool counts
/// them (`KvRoom`). Backends that override `prefill_batch` may call it too.
pub fn check_batch_room<B: Backend + ?Sized>(backend: &B, parts: &[(SeqId, &[u32])]) -> ModelResult<()> {
    let mut blocks = 0usize;
    let room = backend.kv_room();
    for (i, &(seq, tokens)) in parts.iter().enumerate() {
        if parts[..i].iter().any(|p| p.0 == seq) {
            return Err(ModelError::Invalid(format!("sequence {seq:?} appears twice in one prefill batch")));
        }
        if tokens.is_empty() {
            return Err(ModelError::Invalid(format!("empty prefill for {seq:?}")));
        }
        let len = backend.seq_len(seq)?;
        let new_len = len + tokens.len();
        if new_len > backend.max_seq_len() {
            return Err(ModelError::Capacity(format!(
                "sequence {seq:?} holds {len} tokens; {} more exceed the limit of {}",
                tokens.len(),
                backend.max_seq_len()
            )));
        }
        if let Some(r) = room {
            let b = r.block_tokens.max(1);
            blocks += new_len.div_ceil(b) - len.div_ceil(b);
        }
    }
    if let Some(r) = room {
        let b = r.block_tokens.max(1);
        if blocks > r.free_tokens / b {
            return Err(ModelError::Capacity(format!("KV cache full: the batch needs {blocks} more blocks of {b} tokens, {} free", r.free_tokens / b)));
        }
    }
    Ok(())
}

/// A fixed KV pool's state, in tokens. Memory is handed out in blocks of
/// `block_tokens`: a sequence of `n` tokens holds `ceil(n / block_tokens)`
/// blocks (forks share their full blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRoom {
    pub free_tokens: usize,
    pub total_tokens: usize,
    pub block_tokens: usize,
}

/// Index of the largest value (the first one on ties); 0 for an empty slice.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Logits from a hash of each sequence's history, so a wrong feed
    /// changes the draws.
    struct Toy {
        config: ModelConfig,
        seqs: HashMap<SeqId, Vec<u32>>,
    }

    impl Toy {
        fn new() -> Self {
            let mut config = lily_core::config::production();
            config.vocab_size = 64;
            Toy { config, seqs: HashMap::new() }
        }
        fn logits(history: &[u32]) -> Vec<f32> {
            let h = history.iter().fold(0x9e37u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100_0000_01b3));
            (0..64u64).map(|j| ((h ^ j).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 40) as f32 / 4e6).collect()
        }
    }

    impl Backend for Toy {
        fn name(&self) -> String {
            "toy".into()
        }
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn max_seq_len(&self) -> usize {
            1024
        }
        fn max_sequences(&self) -> usize {
            8
        }
        fn alloc(&mut self) -> ModelResult<SeqId> {
            let id = SeqId(self.seqs.len() as u64);
            self.seqs.insert(id, Vec::new());
            Ok(id)
        }
        fn free(&mut self, seq: SeqId) {
            self.seqs.remove(&seq);
        }
        fn fork(&mut self, _seq: SeqId) -> ModelResult<SeqId> {
            Err(ModelError::Invalid("not needed".into()))
        }
        fn seq_len(&self, seq: SeqId) -> ModelResult<usize> {
            self.seqs.get(&seq).map(Vec::len).ok_or(ModelError::UnknownSequence(seq))
        }
        fn prefill(&mut self, seq: SeqId, tokens: &[u32], _: LogitsWanted) -> ModelResult<Vec<Vec<f32>>> {
            let h = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
            h.extend_from_slice(tokens);
            Ok(vec![Toy::logits(h)])
        }
        fn decode(&mut self, batch: &[(SeqId, u32)]) -> ModelResult<Vec<Vec<f32>>> {
            let mut out = Vec::new();
            for &(seq, t) in batch {
                let h = self.seqs.get_mut(&seq).ok_or(ModelError::UnknownSequence(seq))?;
                h.push(t);
                out.push(Toy::logits(h));
            }
            Ok(out)
        }
    }

    #[test]
    fn default_prefill_batch_equals_prefill_per_part_and_refuses_up_front() {
        let (a, b) = ([1u32, 2, 3], [4u32, 5]);
        let mut one = Toy::new();
        let (s0, s1) = (one.alloc().expect("alloc"), one.alloc().expect("alloc"));
        one.prefill(s1, &[9], LogitsWanted::Last).expect("prefill");
        let want =
            vec![one.prefill(s0, &a, LogitsWanted::Last).expect("prefill").remove(0), one.prefill(s1, &b, LogitsWanted::Last).expect("prefill").remove(0)];
        let mut batch = Toy::new();
        let (t0, t1) = (batch.alloc().expect("alloc"), batch.alloc().expect("alloc"));
        batch.prefill(t1, &[9], LogitsWanted::Last).expect("prefill");
        assert_eq!(batch.prefill_batch(&[(t0, &a), (t1, &b)]).expect("batch"), want);
        // Refusals found by the checks change no sequence, whichever part
        // they concern: a part past max_seq_len (1024) after one that fits,
        // a sequence twice, an empty part, an unknown sequence.
        let long = vec![1u32; 1024];
        assert!(matches!(batch.prefill_batch(&[(t0, &a), (t1, &long)]), Err(ModelError::Capacity(_))));
        assert!(matches!(batch.prefill_batch(&[(t0, &a), (t0, &b)]), Err(ModelError::Invalid(_))));
        assert!(matches!(batch.prefill_batch(&[(t0, &a), (t1, &[])]), Err(ModelError::Invalid(_))));
        assert!(matches!(batch.prefill_batch(&[(t0, &a), (SeqId(99), &b)]), Err(ModelError::UnknownSequence(_))));
        assert_eq!((batch.seq_len(t0).expect("len"), batch.seq_len(t1).expect("len")), (3, 3));
        assert!(batch.prefill_batch(&[]).expect("empty batch").is_empty());
    }

    #[test]
    fn default_pipeline_equals_decode_sample_step_by_step() {
        let params = SampleParams { seed: 3, presence_penalty: 0.5, ..Default::default() };
        // Reference: decode_sample, feeding each draw back.
        let mut reference = Toy::new();
        let seq = reference.alloc().expect("alloc");
        let mut st = SampleState::new(params, &[1, 2]);
        let first = sample::sample_host(&reference.prefill(seq, &[1, 2], LogitsWanted::Last).expect("prefill")[0], &mut st);
        let mut want = vec![first.token];
        for _ in 0..6 {
            let t = *want.last().expect("a token");
            want.push(reference.decode_sample(&[(seq, t)], std::slice::from_mut(&mut st)).expect("decode")[0].token);
        }
        // Pipelined: the first step fed the token, then Previous, two in flight.
        let mut toy = Toy::new();
        let seq = toy.alloc().expect("alloc");
        let mut st = SampleState::new(params, &[1, 2]);
        let first = sample::sample_host(&toy.prefill(seq, &[1, 2], LogitsWanted::Last).expect("prefill")[0], &mut st);
        let mut got = vec![first.token];
        let states = std::slice::from_mut(&mut st);
        let mut pending = std::collections::VecDeque::new();
        pending.push_back(toy.submit_decode(&[(seq, Feed::Token(first.token))], states).expect("submit"));
        for _ in 0..5 {
            pending.push_back(toy.submit_decode(&[(seq, Feed::Previous)], states).expect("submit"));
            assert_eq!(pending.len(), MAX_IN_FLIGHT);
            let step = pending.pop_front().expect("in flight");
            got.push(toy.collect_decode(step, states).expect("collect")[0].token);
        }
        let step = pending.pop_front().expect("in flight");
        got.push(toy.collect_decode(step, states).expect("collect")[0].token);
        assert_eq!(got, want);
        assert_eq!((st.step, st.last_draw()), (7, want.last().copied()));
        assert_eq!(toy.seq_len(seq).expect("len"), 2 + 6);
        // Previous with no draw yet, and a step collected with the wrong
        // number of states, are refused.
        let fresh = toy.alloc().expect("alloc");
        let mut none = [SampleState::new(params, &[])];
        assert!(toy.submit_decode(&[(fresh, Feed::Previous)], &mut none).is_err());
        let step = toy.submit_decode(&[(fresh, Feed::Token(4))], &mut none).expect("submit");
        assert!(toy.collect_decode(step, &mut []).is_err());
    }
}
