//! The engine's side of sampling: a request's API parameters mapped onto
//! `lily_model::SampleParams`, and a drawn token turned into the API's
//! logprob report.
//!
//! The math itself (penalties, temperature, min-p, top-k, top-p, the seeded
//! draw, logprobs) has one definition, `lily_model::sample`, which the
//! backends run on their device and the engine runs on the host for the
//! first token after a prefill; its module comment gives the order of
//! operations and how a seed maps to draws. This file owns no math.

use lily_core::tokenizer::Tokenizer;
use lily_model::SampleParams;

use crate::api::{SamplingParams, TokenLogprob};

/// The parameters of one request's draws. `seed` is the request's own, or
/// one drawn at random (once, when the request is admitted); `logprobs`
/// the alternatives it asked for; `vocab_limit` the tokenizer's vocabulary
/// size (ids past it have no text and are never drawn).
pub fn sample_params(p: &SamplingParams, seed: u64, logprobs: Option<usize>, vocab_limit: usize) -> SampleParams {
    SampleParams {
        temperature: p.temperature,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        top_p: p.top_p,
        min_p: p.min_p,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        seed,
        top_logprobs: logprobs.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        // A vocabulary past u32 ids cannot occur (ids are u32): no limit.
        vocab_limit: u32::try_from(vocab_limit).unwrap_or(0),
        logprob: logprobs.is_some(),
    }
}

/// The seed of a request's draws: its own, or a random one.
pub fn request_seed(p: &SamplingParams) -> u64 {
    p.seed.unwrap_or_else(rand::random)
}

/// The API report of a drawn token: its text, bytes and logprob, and the
/// alternatives `lily_model` reported.
pub fn logprob_report(tok: &Tokenizer, token: u32, logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
    TokenLogprob {
        token: token_text(tok, token),
        logprob,
        bytes: token_bytes(tok, token),
        top: top.iter().map(|&(t, l)| (token_text(tok, t), l, token_bytes(tok, t))).collect(),
    }
}

/// A token's text on its own (lossy for a fragment of a character).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default()
}

fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    tok.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_parameters_map_onto_the_model_parameters() {
        let api = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            repetition_penalty: 1.1,
            seed: Some(3),
        };
        let p = sample_params(&api, request_seed(&api), Some(5), 1000);
        let want = SampleParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            repetition_penalty: 1.1,
            seed: 3,
            top_logprobs: 5,
            vocab_limit: 1000,
            logprob: true,
        };
        assert_eq!(p, want);
        let p = sample_params(&SamplingParams { top_k: usize::MAX, ..api }, 3, None, 1000);
        assert_eq!((p.top_k, p.top_logprobs, p.logprob), (u32::MAX, 0, false));
    }

    #[test]
    fn a_request_without_a_seed_gets_a_random_one() {
        let api = SamplingParams::default();
        // Two 64-bit draws colliding would be a broken generator.
        assert_ne!(request_seed(&api), request_seed(&api));
    }
}
