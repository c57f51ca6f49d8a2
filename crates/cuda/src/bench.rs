//! Timed entry points for `lily bench` and the examples: load, one timed
//! prefill until the first generated token is on the host, then N timed
//! greedy decode steps that never return to the host in between (docs/design.md §7.1).

use std::path::Path;
use std::time::Instant;

use lily_model::{Backend, SeqId};

use crate::backend::CudaBackend;
use crate::error::{CudaError, CudaResult};
use crate::state::Options;

pub use lily_model::contract::{fnv1a_digest, prompt_tokens};

/// Opens `dir` on GPU 0 sized for one sequence of `max_seq` tokens.
pub fn load(dir: &Path, max_seq: usize, progress: &mut dyn FnMut(u64, u64)) -> CudaResult<CudaBackend> {
    CudaBackend::open(dir, Options::for_context(max_seq), progress)
}

/// One timed run.
#[derive(Clone, Debug)]
pub struct Timed {
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    pub first_token: u32,
    pub decode_s: f64,
    pub ids: Vec<u32>,
}

impl Timed {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.ids.len() as f64 / self.decode_s
    }
}

/// Prefills `prompt` greedily (timed until the first token is on the host),
/// then `steps` greedy decode steps (timed until the last id is on the host).
pub fn timed_run(backend: &mut CudaBackend, prompt: &[u32], steps: usize) -> CudaResult<Timed> {
    let seq = backend.alloc().map_err(|e| CudaError::Capacity(e.to_string()))?;
    let t0 = Instant::now();
    let first = backend.prefill_greedy(seq, prompt).map_err(|e| CudaError::Invalid(e.to_string()));
    let prefill_s = t0.elapsed().as_secs_f64();
    let first = match first {
        Ok(f) => f,
        Err(e) => {
            backend.free(seq);
            return Err(e);
        }
    };
    let t1 = Instant::now();
    let ids = backend.decode_greedy(seq, first, steps).map_err(|e| CudaError::Invalid(e.to_string()));
    let decode_s = t1.elapsed().as_secs_f64();
    backend.free(seq);
    Ok(Timed { prompt_tokens: prompt.len(), prefill_s, first_token: first, decode_s, ids: ids? })
}

/// `b` new sequences, each prefilled greedily with its own prompt of
/// `prompt_len` tokens (`lily_model::contract::batch_prompt_tokens`, prompt
/// i for sequence i): (sequence, first generated token). The decode batches
/// of the speed probes (`bench --batch` and `--served`, `overlap_probe`).
pub fn prefilled(backend: &mut CudaBackend, b: usize, prompt_len: usize, vocab: usize) -> CudaResult<Vec<(SeqId, u32)>> {
    (0..b)
        .map(|i| {
            let prompt = lily_model::contract::batch_prompt_tokens(i, prompt_len, vocab);
            let s = backend.alloc().map_err(|e| CudaError::Capacity(e.to_string()))?;
            let first = backend.prefill_greedy(s, &prompt).map_err(|e| CudaError::Invalid(e.to_string()))?;
            Ok((s, first))
        })
        .collect()
}
