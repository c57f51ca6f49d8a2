//! The accuracy check behind `lily agree`: how closely a model (the 4-bit
//! checkpoint) follows a reference (the unquantised one) over the same
//! tokens.
//!
//! Both backends prefill the same tokens with `LogitsWanted::All`; at every
//! position we compare the argmax (top-1 agreement, docs/design.md §7.3: the seed
//! reports 96.35% over 192 positions of real text) and the log-probability
//! each model gives the *reference's* top-1 token, which is defined at every
//! position and measures how much the model doubts the reference's choice.
//! Tokens go through in chunks so only a chunk of full-vocabulary logit rows
//! is held at once. It owns no tokenisation or file reading (the CLI does).

use lily_model::{Backend, LogitsWanted, ModelError};

/// Logit rows held per backend at once: 64 x 248,320 floats = 64 MB.
const CHUNK: usize = 64;

/// Result of one comparison.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AgreeReport {
    pub positions: usize,
    /// Positions where both argmaxes are the same token.
    pub top1_matches: usize,
    /// `top1_matches / positions`, in percent.
    pub top1_agreement_pct: f64,
    /// Mean over positions of |log p_model(r) - log p_reference(r)|, r the
    /// reference's top-1 token.
    pub mean_abs_dlogprob: f64,
    /// 99th percentile and maximum of the same.
    pub p99_abs_dlogprob: f64,
    pub max_abs_dlogprob: f64,
    pub model_backend: String,
    pub reference_backend: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AgreeError {
    #[error("the models disagree on the vocabulary: {model} ids vs {reference} for the reference")]
    VocabMismatch { model: usize, reference: usize },
    #[error("{0}")]
    Input(String),
    #[error("{which}: {source}")]
    Backend {
        which: &'static str,
        #[source]
        source: ModelError,
    },
}

/// Runs both backends over `tokens[..positions]` and compares them. Each
/// backend gets one fresh sequence, freed before returning.
pub fn agree(model: &mut dyn Backend, reference: &mut dyn Backend, tokens: &[u32], positions: usize) -> Result<AgreeReport, AgreeError> {
    let vocab = model.config().vocab_size;
    if reference.config().vocab_size != vocab {
        return Err(AgreeError::VocabMismatch { model: vocab, reference: reference.config().vocab_size });
    }
    if positions == 0 {
        return Err(AgreeError::Input("positions must be at least 1".into()));
    }
    if tokens.len() < positions {
        return Err(AgreeError::Input(format!("the text has {} tokens; {positions} positions were asked for", tokens.len())));
    }
    let tokens = &tokens[..positions];
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(AgreeError::Input(format!("token id {t} is outside the models' vocabulary of {vocab} ids")));
    }
    for (b, which) in [(&*model, "model"), (&*reference, "reference")] {
        if b.max_seq_len() < positions {
            return Err(AgreeError::Input(format!("the {which} holds at most {} tokens; {positions} positions were asked for", b.max_seq_len())));
        }
    }

    let m_seq = model.alloc().map_err(|source| AgreeError::Backend { which: "model", source })?;
    let r_seq = match reference.alloc() {
        Ok(s) => s,
        Err(source) => {
            model.free(m_seq);
            return Err(AgreeError::Backend { which: "reference", source });
        }
    };
    let result = compare(model, m_seq, reference, r_seq, tokens);
    model.free(m_seq);
    reference.free(r_seq);
    let (matches, mut deltas) = result?;

    deltas.sort_by(f64::total_cmp);
    let n = deltas.len();
    let p99_index = ((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1;
    Ok(AgreeReport {
        positions: n,
        top1_matches: matches,
        top1_agreement_pct: 100.0 * matches as f64 / n as f64,
        mean_abs_dlogprob: deltas.iter().sum::<f64>() / n as f64,
        p99_abs_dlogprob: deltas[p99_index],
        max_abs_dlogprob: deltas[n - 1],
        model_backend: model.name(),
        reference_backend: reference.name(),
    })
}

fn compare(
    model: &mut dyn Backend,
    m_seq: lily_model::SeqId,
    reference: &mut dyn Backend,
    r_seq: lily_model::SeqId,
    tokens: &[u32],
) -> Result<(usize, Vec<f64>), AgreeError> {
    let mut matches = 0;
    let mut deltas = Vec::with_capacity(tokens.len());
    for chunk in tokens.chunks(CHUNK) {
        let m = model.prefill(m_seq, chunk, LogitsWanted::All).map_err(|source| AgreeError::Backend { which: "model", source })?;
        let r = reference.prefill(r_seq, chunk, LogitsWanted::All).map_err(|source| AgreeError::Backend { which: "reference", source })?;
        if m.len() != chunk.len() || r.len() != chunk.len() {
            return Err(AgreeError::Input(format!("a backend returned {} / {} logit rows for {} tokens", m.len(), r.len(), chunk.len())));
        }
        for (mrow, rrow) in m.iter().zip(&r) {
            let top_m = lily_model::argmax(mrow);
            let top_r = lily_model::argmax(rrow) as usize;
            if top_m as usize == top_r {
                matches += 1;
            }
            let lp_m = mrow[top_r] as f64 - log_sum_exp(mrow);
            let lp_r = rrow[top_r] as f64 - log_sum_exp(rrow);
            deltas.push((lp_m - lp_r).abs());
        }
    }
    Ok((matches, deltas))
}

fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln()
}

impl AgreeReport {
    /// The human-readable summary `lily agree` prints.
    pub fn to_text(&self) -> String {
        format!(
            "positions: {}\ntop-1 agreement: {:.2}% ({} / {})\nmean |d logprob| (reference top-1): {:.4}\np99 |d logprob|: {:.4}\nmax |d logprob|: {:.4}\nmodel backend: {}\nreference backend: {}\n",
            self.positions,
            self.top1_agreement_pct,
            self.top1_matches,
            self.positions,
            self.mean_abs_dlogprob,
            self.p99_abs_dlogprob,
            self.max_abs_dlogprob,
            self.model_backend,
            self.reference_backend
        )
    }
}
