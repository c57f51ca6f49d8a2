//! The engine end to end on a fake deterministic backend (tests/support):
//! batching, chunked prefill, cancellation, deadlines, limits, stops, seeds,
//! the prefix cache, fault isolation and shutdown.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily_engine::{Engine, EngineError, EngineHandle, EngineOptions, EngineStats, FinishReason, GenerateRequest, MixPolicy, SamplingParams, SubmitError};
use lily_model::{MixedSteps, SeqId};
use support::{collect, collect_rest, decode, tokenizer, wait_started, Call, Fake, Mode, Probe, A, EOS};

fn opts() -> EngineOptions {
    EngineOptions { prefix_cache_tokens: 0, ..EngineOptions::default() }
}

fn start(fake: Fake, opts: EngineOptions) -> EngineHandle {
    Engine::start(Box::new(fake), tokenizer(), opts).expect("engine thread")
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { sampling: SamplingParams::greedy(), ..GenerateRequest::new(prompt, max_tokens) }
}

/// Polls `f` until it holds or `limit` passes.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

/// Once every request has ended, the only live sequences are the prefix
/// cache's snapshots (anything more is a sequence some request leaked).
fn assert_only_snapshots_hold_sequences(probe: &Mutex<Probe>, h: &EngineHandle) {
    assert!(
        eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == h.stats().prefix_cache_entries),
        "live sequences {} != snapshots {}",
        probe.lock().expect("probe").live,
        h.stats().prefix_cache_entries
    );
}

fn pseudo_prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) >> 7).wrapping_add(salt.wrapping_mul(7919))) % 250).collect()
}

#[test]
fn greedy_generation_length_and_text() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake, opts());
    let c = collect(h.submit(greedy(vec![A], 5)).expect("submit"));
    assert_eq!(c.started, Some((1, 0)));
    assert_eq!(c.text, "bcdef");
    assert_eq!(c.ids, vec![A + 1, A + 2, A + 3, A + 4, A + 5]);
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert_eq!(c.completion_tokens, 5);
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
    let s = h.stats();
    assert_eq!((s.requests_submitted, s.requests_finished, s.generated_tokens), (1, 1, 5));
    let info = h.model_info();
    assert_eq!((info.backend.as_str(), info.context_length, info.vocab_size), ("fake", 4096, 256));
}

#[test]
fn concurrent_requests_are_batched_and_all_finish() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(2)), opts());
    let streams: Vec<_> = (0..6u32).map(|i| h.submit(greedy(vec![A + i], 12)).expect("submit")).collect();
    let threads: Vec<_> = streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect();
    for (i, t) in threads.into_iter().enumerate() {
        let c = t.join().expect("collector");
        let expect: Vec<u32> = (1..=12).map(|k| A + i as u32 + k).collect();
        assert_eq!(c.ids, expect, "request {i}");
        assert_eq!(c.finish, Some(FinishReason::Length));
    }
    let calls = probe.lock().expect("probe").calls.clone();
    let max_batch = calls
        .iter()
        .filter_map(|c| match c {
            Call::Decode { batch } => Some(*batch),
            _ => None,
        })
        .max();
    assert!(max_batch.unwrap_or(0) > 1, "no decode batch larger than 1");
    let s = h.stats();
    assert!(s.decode_batch_sizes.iter().skip(2).sum::<u64>() > 0, "{:?}", s.decode_batch_sizes);
    assert_eq!(s.requests_finished, 6);
    // The engine's time split: every decode and prefill call of the fake
    // sleeps 2 ms; 12 tokens each (the first from the prefill) need at
    // least 11 decode steps and one prefill call, and the parts fit inside
    // the steps' total.
    let t = s.time;
    assert!(t.decode_submit_s + t.decode_wait_s >= 11.0 * 0.002, "{t:?}");
    assert!(t.prefill_s >= 0.002, "{t:?}");
    assert!(t.step_s >= t.decode_submit_s + t.decode_wait_s + t.prefill_s, "{t:?}");
}

#[test]
fn long_prefill_is_chunked_and_interleaved_with_decode() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(1)), EngineOptions { prefill_chunk: 32, ..opts() });
    let short = h.submit(greedy(vec![A], 40)).expect("submit");
    let long_prompt = pseudo_prompt(300, 1);
    let long = h.submit(greedy(long_prompt, 4)).expect("submit");
    let (a, b) = (std::thread::spawn(move || collect(short)), std::thread::spawn(move || collect(long)));
    let (a, b) = (a.join().expect("short"), b.join().expect("long"));
    assert_eq!(a.finish, Some(FinishReason::Length));
    assert_eq!(b.finish, Some(FinishReason::Length));
    assert_eq!(b.started, Some((300, 0)));

    let calls = probe.lock().expect("probe").calls.clone();
    let short_seq = calls
        .iter()
        .find_map(|c| match c {
            Call::Prefill { seq, tokens: 1 } => Some(*seq),
            _ => None,
        })
        .expect("short prompt prefill");
    let long_chunks: Vec<usize> =
        calls.iter().enumerate().filter_map(|(i, c)| matches!(c, Call::Prefill { seq, .. } if *seq != short_seq).then_some(i)).collect();
    let sizes: Vec<usize> = long_chunks
        .iter()
        .map(|&i| match calls[i] {
            Call::Prefill { tokens, .. } => tokens,
            _ => 0,
        })
        .collect();
    assert_eq!(sizes.iter().sum::<usize>(), 300);
    assert!(sizes.iter().all(|&n| n <= 32), "{sizes:?}");
    let (first, last) = (long_chunks[0], *long_chunks.last().expect("chunks"));
    let decodes_between = calls[first..last].iter().filter(|c| matches!(c, Call::Decode { .. })).count();
    assert!(decodes_between >= long_chunks.len() - 1, "decode steps did not run between prefill chunks: {calls:?}");
}

/// Prompt tokens prefilled between consecutive decode steps, in order.
fn prefill_between_decodes(calls: &[Call]) -> Vec<usize> {
    let mut windows = vec![0];
    for c in calls {
        match c {
            Call::Decode { .. } => windows.push(0),
            Call::Prefill { tokens, .. } => *windows.last_mut().expect("a window") += tokens,
            Call::PrefillBatch { parts } => *windows.last_mut().expect("a window") += parts.iter().map(|p| p.1).sum::<usize>(),
            Call::Collect { .. } | Call::Refused(_) => {}
        }
    }
    windows
}

/// A greedy stream of 60 tokens runs while three 100-token prompts (2
/// tokens each) arrive at once, with a 32-token prefill budget a step;
/// checks every request's tokens (Count logits) and that every sequence is
/// freed, and returns the backend's calls and the engine's counters.
fn three_prompts_beside_a_stream(fake: Fake, probe: &Mutex<Probe>) -> (Vec<Call>, EngineStats) {
    let gate = Arc::new(Mutex::new(()));
    let h = start(fake.gate(gate.clone()), EngineOptions { prefill_chunk: 32, ..opts() });
    let held = gate.lock().expect("gate");
    let mut stream = h.submit(greedy(vec![A], 60)).expect("submit");
    let started = wait_started(&mut stream);
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| pseudo_prompt(100, 20 + k)).collect();
    let longs: Vec<_> = prompts.iter().map(|p| h.submit(greedy(p.clone(), 2)).expect("submit")).collect();
    drop(held);
    let longs: Vec<_> = longs.into_iter().map(collect).collect();
    let stream = collect_rest(stream, started);
    assert_eq!(stream.ids, (1..=60).map(|k| A + k).collect::<Vec<_>>());
    for (c, p) in longs.iter().zip(&prompts) {
        assert_eq!(c.finish, Some(FinishReason::Length), "{c:?}");
        assert_eq!(c.ids, vec![(p[99] + 1) % 256, (p[99] + 2) % 256]);
    }
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
    let calls = probe.lock().expect("probe").calls.clone();
    (calls, h.stats())
}

#[test]
fn prefill_per_step_is_bounded_while_prompts_arrive_together() {
    // Three 100-token prompts arrive at once beside a running stream: they
    // share one 32-token prefill budget per step (plus, to finish a prompt,
    // a tail of at most a quarter of it), and the stream gets a decode step
    // between every two budgets.
    let (fake, probe) = Fake::new(Mode::Count);
    let (calls, _) = three_prompts_beside_a_stream(fake, &probe);
    let windows = prefill_between_decodes(&calls);
    assert_eq!(windows.iter().sum::<usize>(), 301);
    assert!(windows.iter().all(|&n| n <= 32 + 32 / 4), "{windows:?}");
    // A tail rode along at least once (100 = 3 x 32 + 4).
    assert!(windows.iter().any(|&n| n > 32), "{windows:?}");
    // The 300 prompt tokens took at least ceil(300 / 40) steps, each with a
    // decode step for the running stream before the next.
    assert!(windows.iter().filter(|&&n| n > 0).count() >= 300usize.div_ceil(40), "{windows:?}");
    // All of it while the stream ran (it decodes 59 of its 60 tokens).
    let busy = windows.iter().rposition(|&n| n > 0).expect("prefill ran");
    assert!(busy < 59, "{windows:?}");
}

/// Seeded, sampled requests with Hash logits (any wrong state changes
/// what follows), each with a different prompt length.
fn sampled_requests(lens: &[usize], max_tokens: usize) -> Vec<GenerateRequest> {
    lens.iter()
        .enumerate()
        .map(|(k, &n)| GenerateRequest {
            sampling: SamplingParams { temperature: 0.8, seed: Some(300 + k as u64), ..SamplingParams::default() },
            ..GenerateRequest::new(pseudo_prompt(n, 90 + k as u32), max_tokens)
        })
        .collect()
}

#[test]
fn prompts_arriving_together_are_prefilled_in_one_call_within_the_budget() {
    let lens = [20usize, 30, 25, 40, 9];
    let requests = sampled_requests(&lens, 6);
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Hash);
    let h = start(fake.batched_prefill().gate(gate.clone()), EngineOptions { prefill_chunk: 64, ..opts() });
    let held = gate.lock().expect("gate");
    // The engine waits at the gate in the blocker's prefill, so the five
    // requests below are admitted in the same step.
    let mut blocker = h.submit(greedy(vec![A + 50], 1)).expect("submit");
    let started = wait_started(&mut blocker);
    let streams: Vec<_> = requests.iter().map(|r| h.submit(r.clone()).expect("submit")).collect();
    drop(held);
    let outs: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(collect_rest(blocker, started).finish, Some(FinishReason::Length));

    let calls = probe.lock().expect("probe").calls.clone();
    let batches: Vec<Vec<usize>> = calls
        .iter()
        .filter_map(|c| match c {
            Call::PrefillBatch { parts } => Some(parts.iter().map(|p| p.1).collect()),
            _ => None,
        })
        .collect();
    // Oldest first within the 64-token budget: two whole prompts and the
    // third, whose 11 tokens past the budget are a tail of at most a
    // quarter of it (16), in one call; the other two in the next step's.
    assert_eq!(batches, vec![vec![20, 30, 25], vec![40, 9]], "{calls:?}");
    assert!(batches.iter().all(|b| b.iter().sum::<usize>() <= 64 + 16), "{calls:?}");
    assert!(!calls.iter().any(|c| matches!(c, Call::Prefill { tokens, .. } if *tokens > 1)), "a prompt prefilled alone: {calls:?}");

    // The same tokens as each request served alone.
    for (k, (got, r)) in outs.iter().zip(&requests).enumerate() {
        let (fake, _) = Fake::new(Mode::Hash);
        let alone = collect(start(fake, opts()).submit(r.clone()).expect("submit"));
        assert_eq!((got.finish, got.completion_tokens), (Some(FinishReason::Length), 6), "request {k}: {got:?}");
        assert_eq!(got.ids, alone.ids, "request {k}");
        assert_eq!(got.text, alone.text, "request {k}");
    }
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}

#[test]
fn a_failed_prefill_batch_fails_only_the_faulty_request() {
    // The fake refuses the whole batch for a poisoned prompt (changing no
    // sequence); the engine retries one request at a time, where only the
    // poisoned one fails.
    const POISON: u32 = 251;
    let mut requests = sampled_requests(&[12, 18, 15], 5);
    requests[1].prompt[7] = POISON;
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Hash);
    let h = start(fake.batched_prefill().poison(POISON).gate(gate.clone()), opts());
    let held = gate.lock().expect("gate");
    let mut blocker = h.submit(greedy(vec![A + 50], 1)).expect("submit");
    let started = wait_started(&mut blocker);
    let streams: Vec<_> = requests.iter().map(|r| h.submit(r.clone()).expect("submit")).collect();
    drop(held);
    let outs: Vec<_> = streams.into_iter().map(collect).collect();
    assert_eq!(collect_rest(blocker, started).finish, Some(FinishReason::Length));
    assert!(matches!(outs[1].failed, Some(EngineError::Backend(_))), "{:?}", outs[1]);
    for k in [0, 2] {
        let (fake, _) = Fake::new(Mode::Hash);
        let alone = collect(start(fake, opts()).submit(requests[k].clone()).expect("submit"));
        assert_eq!((outs[k].finish, &outs[k].ids), (Some(FinishReason::Length), &alone.ids), "request {k}: {:?}", outs[k]);
    }
    let calls = probe.lock().expect("probe").calls.clone();
    let solo: Vec<usize> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Prefill { tokens, .. } if *tokens > 1 => Some(*tokens),
            _ => None,
        })
        .collect();
    assert_eq!(solo, vec![12, 15], "the healthy prompts prefilled alone after the refused batch: {calls:?}");
    assert_eq!(h.stats().requests_failed, 1);
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}

#[test]
fn dropping_the_stream_cancels_and_frees_the_sequence() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(2)), opts());
    let mut s = h.submit(greedy(vec![A], 1000)).expect("submit");
    let mut tokens = 0;
    while tokens < 3 {
        if let Some(lily_engine::Event::Token { .. }) = s.blocking_recv() {
            tokens += 1;
        }
    }
    assert_eq!(probe.lock().expect("probe").live, 1);
    drop(s);
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0), "sequence not freed");
    assert!(eventually(Duration::from_secs(2), || h.stats().requests_cancelled == 1));
    assert_eq!(h.stats().running, 0);
    // The engine still serves.
    assert_eq!(collect(h.submit(greedy(vec![A], 2)).expect("submit")).text, "bc");
}

#[test]
fn explicit_cancel_answers_cancelled() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(2)), opts());
    let mut s = h.submit(greedy(vec![A], 1000)).expect("submit");
    assert!(matches!(s.blocking_recv(), Some(lily_engine::Event::Started { .. })));
    s.cancel();
    let mut finish = None;
    while let Some(ev) = s.blocking_recv() {
        if let lily_engine::Event::Finished { reason, completion_tokens, .. } = ev {
            assert!(completion_tokens < 1000);
            finish = Some(reason);
        }
    }
    assert_eq!(finish, Some(FinishReason::Cancelled));
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}

#[test]
fn deadline_ends_the_request() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(3)), opts());
    let req = GenerateRequest { deadline: Some(Instant::now() + Duration::from_millis(60)), ..greedy(vec![A], 1000) };
    let t0 = Instant::now();
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!(c.finish, Some(FinishReason::Deadline));
    assert!(c.completion_tokens > 0 && c.completion_tokens < 1000);
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Already expired on arrival: ends without generating.
    let req = GenerateRequest { deadline: Some(Instant::now()), ..greedy(vec![A], 10) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!((c.finish, c.completion_tokens), (Some(FinishReason::Deadline), 0));
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}

#[test]
fn queue_full_is_refused_and_accepted_requests_finish() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(5)), EngineOptions { max_batch: 1, max_queue: 2, ..opts() });
    let mut accepted = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        match h.submit(greedy(vec![A], 8)) {
            Ok(s) => accepted.push(s),
            Err(SubmitError::QueueFull { retry_after, .. }) => {
                assert!(retry_after >= Duration::from_secs(1));
                refused += 1;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(refused > 0, "the queue bound was never hit");
    assert!(accepted.len() <= 4);
    for s in accepted {
        assert_eq!(collect(s).finish, Some(FinishReason::Length));
    }
}

#[test]
fn limits_are_checked_at_submit() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.max_seq(64), opts());
    assert!(matches!(h.submit(greedy(vec![A; 64], 1)), Err(SubmitError::PromptTooLong { prompt: 64, max: 64 })));
    assert!(matches!(h.submit(greedy(vec![A; 10], 60)), Err(SubmitError::MaxTokensTooLarge { prompt: 10, max_tokens: 60, max: 64 })));
    assert!(h.submit(greedy(vec![A; 10], 54)).is_ok());
    assert!(matches!(h.submit(greedy(vec![], 5)), Err(SubmitError::Invalid(_))));
    assert!(matches!(h.submit(greedy(vec![999], 5)), Err(SubmitError::Invalid(_))));
    assert!(matches!(h.submit(greedy(vec![A], 0)), Err(SubmitError::Invalid(_))));
    let bad = GenerateRequest { logprobs: Some(21), ..greedy(vec![A], 1) };
    assert!(matches!(h.submit(bad), Err(SubmitError::Invalid(_))));
    let bad = GenerateRequest { sampling: SamplingParams { top_p: 0.0, ..SamplingParams::default() }, ..greedy(vec![A], 1) };
    assert!(matches!(h.submit(bad), Err(SubmitError::Invalid(_))));

    // The engine's own cap below the backend's.
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake, EngineOptions { max_seq_len: Some(16), ..opts() });
    assert_eq!(h.model_info().context_length, 16);
    assert!(matches!(h.submit(greedy(vec![A; 16], 1)), Err(SubmitError::PromptTooLong { .. })));
}

#[test]
fn stop_strings_spanning_tokens_are_never_emitted() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake, opts());
    let req = GenerateRequest { stop_strings: vec!["efg".into()], ..greedy(vec![A], 20) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!(c.text, "bcd");
    assert_eq!(c.finish, Some(FinishReason::Stop));
    // The tokens up to the one completing the stop were generated.
    assert_eq!(c.completion_tokens, 6);

    // A held prefix of a stop string that never completes is released at
    // the length limit.
    let req = GenerateRequest { stop_strings: vec!["dex".into()], ..greedy(vec![A], 3) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!((c.text.as_str(), c.finish), ("bcd", Some(FinishReason::Length)));

    // ... and when a stop token arrives.
    let req = GenerateRequest { stop_strings: vec!["dex".into()], stop_token_ids: vec![A + 4], ..greedy(vec![A], 10) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!((c.text.as_str(), c.finish), ("bcd", Some(FinishReason::Stop)));
    assert_eq!(c.ids.last(), Some(&(A + 4)));
}

#[test]
fn eos_and_stop_ids_end_with_stop_and_no_text() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake, opts());
    let c = collect(h.submit(greedy(vec![EOS - 3], 10)).expect("submit"));
    assert_eq!(c.ids, vec![EOS - 2, EOS - 1, EOS]);
    assert_eq!(c.finish, Some(FinishReason::Stop));
    assert_eq!(c.text, decode(&[EOS - 2, EOS - 1]));
    let req = GenerateRequest { stop_token_ids: vec![A + 3], ..greedy(vec![A], 10) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!((c.text.as_str(), c.completion_tokens), ("bc", 3));
}

#[test]
fn same_seed_same_text_even_when_batched() {
    let (fake, _probe) = Fake::new(Mode::Hash);
    let h = start(fake, opts());
    let sampled = |seed| GenerateRequest {
        sampling: SamplingParams { temperature: 1.0, top_p: 0.9, seed: Some(seed), ..SamplingParams::default() },
        ..GenerateRequest::new(pseudo_prompt(20, 3), 40)
    };
    let alone = collect(h.submit(sampled(42)).expect("submit"));
    let again = collect(h.submit(sampled(42)).expect("submit"));
    assert_eq!(alone.ids, again.ids);
    let other = collect(h.submit(sampled(43)).expect("submit"));
    assert_ne!(alone.ids, other.ids);
    // Batched with other requests, the same seed still gives the same ids.
    let s1 = h.submit(sampled(42)).expect("submit");
    let s2 = h.submit(sampled(7)).expect("submit");
    let s3 = h.submit(sampled(42)).expect("submit");
    let (c1, _c2, c3) = (collect(s1), collect(s2), collect(s3));
    assert_eq!(c1.ids, alone.ids);
    assert_eq!(c3.ids, alone.ids);
}

#[test]
fn first_tokens_of_prompts_prefilled_together_equal_each_alone() {
    // Prompts admitted in the same step are prefilled in one batch, and
    // their first tokens drawn on threads at once: each request's tokens
    // (penalties and logprobs included) must equal its run alone.
    let (fake, _probe) = Fake::new(Mode::Hash);
    let h = start(fake, opts());
    let req = |seed: u64| GenerateRequest {
        sampling: SamplingParams { temperature: 0.9, top_k: 30, repetition_penalty: 1.2, seed: Some(seed), ..SamplingParams::default() },
        logprobs: Some(2),
        ..GenerateRequest::new(pseudo_prompt(12 + seed as usize, seed as u32), 6)
    };
    let alone: Vec<_> = (1..=8).map(|seed| collect(h.submit(req(seed)).expect("submit"))).collect();
    let subs: Vec<_> = (1..=8).map(|seed| h.submit(req(seed)).expect("submit")).collect();
    for (seed, (sub, want)) in subs.into_iter().zip(&alone).enumerate() {
        let got = collect(sub);
        assert_eq!(got.ids, want.ids, "request {} batched", seed + 1);
        let lp = |c: &support::Collected| c.logprobs.iter().map(|l| l.as_ref().map(|l| l.logprob.to_bits())).collect::<Vec<_>>();
        assert_eq!(lp(&got), lp(want), "request {} logprobs", seed + 1);
    }
}

#[test]
fn first_tokens_the_backend_draws_in_the_prefill_equal_the_host_draws() {
    // A backend that draws first tokens in the prefill call (the CUDA
    // backend's device sampler) records them in the states itself: each
    // request's tokens and logprobs (penalties included, which count the
    // first draw) must equal a run where the engine draws every first
    // token from the logits, alone and with prompts prefilled together,
    // with some parts declined (the fake draws only on even sequence ids).
    let req = |seed: u64| GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 30,
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        logprobs: Some(2),
        ..GenerateRequest::new(pseudo_prompt(12 + seed as usize, seed as u32), 6)
    };
    let run = |draws_first: bool, together: bool| {
        let (fake, probe) = Fake::new(Mode::Hash);
        let fake = if draws_first { fake.draws_first() } else { fake };
        let h = start(fake.batched_prefill().pipelined(), opts());
        let outs: Vec<_> = if together {
            let subs: Vec<_> = (1..=8).map(|seed| h.submit(req(seed)).expect("submit")).collect();
            subs.into_iter().map(collect).collect()
        } else {
            (1..=8).map(|seed| collect(h.submit(req(seed)).expect("submit"))).collect()
        };
        no_violations(&probe);
        let drawn = probe.lock().expect("probe").first_draws;
        (outs, drawn)
    };
    let (want, none) = run(false, false);
    assert_eq!(none, 0);
    for together in [false, true] {
        let (got, drawn) = run(true, together);
        assert!(drawn > 0 && drawn < 8, "the fake drew {drawn} of 8 first tokens (together: {together})");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((g.finish, g.completion_tokens), (Some(FinishReason::Length), 6), "request {k}");
            assert_eq!(g.ids, w.ids, "request {k} (together: {together})");
            assert_eq!(g.logprobs, w.logprobs, "request {k} (together: {together})");
        }
    }
}

#[test]
fn logprobs_report_chosen_and_alternatives() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake, opts());
    let req = GenerateRequest { logprobs: Some(3), ..greedy(vec![A], 3) };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!(c.logprobs.len(), 3);
    for (id, lp) in c.ids.iter().zip(&c.logprobs) {
        let lp = lp.as_ref().expect("logprobs asked");
        // log(e^12 / (e^12 + 255))
        let expect = 12.0f32 - (12.0f32.exp() + 255.0).ln();
        assert!((lp.logprob - expect).abs() < 1e-4, "{}", lp.logprob);
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, lp.token);
        assert_eq!(lp.bytes, decode(&[*id]).into_bytes());
    }
    let c = collect(h.submit(greedy(vec![A], 2)).expect("submit"));
    assert!(c.logprobs.iter().all(Option::is_none));
}

#[test]
fn decode_steps_sample_in_the_backend_within_the_tokenizer_vocabulary() {
    let (fake, probe) = Fake::new(Mode::Hash);
    let h = start(fake, opts());
    let req = GenerateRequest {
        sampling: SamplingParams { temperature: 0.8, top_k: 50, seed: Some(11), ..SamplingParams::default() },
        logprobs: Some(2),
        ..GenerateRequest::new(pseudo_prompt(5, 1), 6)
    };
    let c = collect(h.submit(req).expect("submit"));
    assert_eq!(c.completion_tokens, 6);
    assert!(c.logprobs.iter().all(|l| l.as_ref().is_some_and(|l| l.top.len() == 2)));
    let p = probe.lock().expect("probe");
    // Every decode step sampled in the backend: no logits came back.
    assert_eq!(p.logits_decodes, 0);
    let params = p.last_params.first().expect("a decode_sample call");
    assert_eq!((params.vocab_limit as usize, params.top_logprobs, params.seed, params.top_k), (tokenizer().vocab_size(), 2, 11, 50));
}

fn cache_opts(interval: usize, budget: usize) -> EngineOptions {
    EngineOptions { prefix_cache_tokens: budget, snapshot_interval: interval, ..EngineOptions::default() }
}

#[test]
fn prefix_cache_hit_reports_cached_tokens_and_matches_uncached_output() {
    let prompt = pseudo_prompt(50, 9);
    let (fake, probe) = Fake::new(Mode::Hash);
    let cached = start(fake, cache_opts(16, 10_000));
    let first = collect(cached.submit(greedy(prompt.clone(), 20)).expect("submit"));
    assert_eq!(first.started, Some((50, 0)));
    let second = collect(cached.submit(greedy(prompt.clone(), 20)).expect("submit"));
    assert_eq!(second.started, Some((50, 48)));
    assert_eq!(second.cached_tokens, 48);
    assert_eq!(second.ids, first.ids);
    let s = cached.stats();
    assert_eq!((s.prefix_cache_hits, s.prefix_cache_tokens), (1, 48));
    // Snapshots at 16, 32, 48 from the prompt and 64 from decoding.
    assert_eq!(s.prefix_cache_entries, 4);
    assert_eq!(probe.lock().expect("probe").live, 4);

    let (fake, _probe) = Fake::new(Mode::Hash);
    let uncached = start(fake, opts());
    let plain = collect(uncached.submit(greedy(prompt.clone(), 20)).expect("submit"));
    assert_eq!(plain.ids, first.ids);

    // A second chat turn: prompt + reply + new text reuses the snapshot
    // taken while the reply was decoded.
    let mut turn2 = prompt.clone();
    turn2.extend(&first.ids);
    turn2.extend(pseudo_prompt(10, 77));
    let t2 = collect(cached.submit(greedy(turn2.clone(), 8)).expect("submit"));
    assert_eq!(t2.cached_tokens, 64);
    let t2_plain = collect(uncached.submit(greedy(turn2, 8)).expect("submit"));
    assert_eq!(t2.ids, t2_plain.ids);

    // A prompt that diverges after the first block reuses only that block.
    let mut diverged = prompt.clone();
    diverged[20] = (diverged[20] + 1) % 250;
    let d = collect(cached.submit(greedy(diverged.clone(), 5)).expect("submit"));
    assert_eq!(d.cached_tokens, 16);
    assert_eq!(d.ids, collect(uncached.submit(greedy(diverged, 5)).expect("submit")).ids);
}

#[test]
fn prefix_cache_evicts_least_recently_used_within_budget() {
    let (fake, probe) = Fake::new(Mode::Hash);
    let h = start(fake, cache_opts(16, 64));
    let a = pseudo_prompt(40, 1);
    let b = pseudo_prompt(40, 2);
    collect(h.submit(greedy(a.clone(), 4)).expect("submit"));
    assert_eq!(h.stats().prefix_cache_held_tokens, 48);
    collect(h.submit(greedy(b.clone(), 4)).expect("submit"));
    let s = h.stats();
    assert!(s.prefix_cache_held_tokens <= 64, "{s:?}");
    assert_eq!(s.prefix_cache_evictions, 2);
    assert_eq!(collect(h.submit(greedy(b, 4)).expect("submit")).cached_tokens, 32);
    assert_eq!(collect(h.submit(greedy(a, 4)).expect("submit")).cached_tokens, 0);
    // Only snapshots hold sequences once everything finished.
    assert_only_snapshots_hold_sequences(&probe, &h);
}

#[test]
fn snapshots_give_way_to_requests_when_sequences_are_scarce() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.max_seqs(2), EngineOptions { max_batch: 8, ..cache_opts(4, 10_000) });
    let streams: Vec<_> = (0..4u32).map(|i| h.submit(greedy(pseudo_prompt(30, i), 10)).expect("submit")).collect();
    for s in streams {
        let c = collect(s);
        assert_eq!(c.finish, Some(FinishReason::Length), "{c:?}");
    }
    assert!(probe.lock().expect("probe").live <= 2);
}

#[test]
fn a_backend_fault_fails_only_its_request() {
    let (fake, probe) = Fake::new(Mode::Count);
    // Feeding 'f' (A + 5) fails; the other request never touches it.
    let h = start(fake.poison(A + 5).delay(Duration::from_millis(1)), opts());
    let bad = h.submit(greedy(vec![A], 10)).expect("submit");
    let good = h.submit(greedy(vec![A + 10], 10)).expect("submit");
    let (bad, good) = (std::thread::spawn(move || collect(bad)), std::thread::spawn(move || collect(good)));
    let (bad, good) = (bad.join().expect("bad"), good.join().expect("good"));
    assert!(matches!(bad.failed, Some(EngineError::Backend(_))), "{bad:?}");
    assert_eq!(good.finish, Some(FinishReason::Length));
    assert_eq!(good.completion_tokens, 10);
    // A prompt with the poison fails at prefill; the engine keeps serving.
    let c = collect(h.submit(greedy(vec![A + 5, A], 3)).expect("submit"));
    assert!(c.failed.is_some());
    assert_eq!(collect(h.submit(greedy(vec![A + 20], 3)).expect("submit")).finish, Some(FinishReason::Length));
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
    assert_eq!(h.stats().requests_failed, 2);
}

#[test]
fn shutdown_drains_in_flight_requests_then_refuses() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.delay(Duration::from_millis(1)), EngineOptions { max_batch: 2, ..cache_opts(4, 1000) });
    let streams: Vec<_> = (0..4u32).map(|i| h.submit(greedy(vec![A + i], 20)).expect("submit")).collect();
    h.shutdown();
    assert!(matches!(h.submit(greedy(vec![A], 1)), Err(SubmitError::ShuttingDown)));
    for s in streams {
        let c = collect(s);
        assert_eq!((c.finish, c.completion_tokens), (Some(FinishReason::Length), 20));
    }
    assert!(h.wait_stopped(Duration::from_secs(5)));
    assert!(h.is_stopped());
    // The cache's snapshots were freed too.
    assert_eq!(probe.lock().expect("probe").live, 0);
}

#[test]
fn async_consumers_and_stopped_future() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake, opts());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut s = h.submit(greedy(vec![A], 4)).expect("submit");
        let mut text = String::new();
        while let Some(ev) = s.recv().await {
            if let lily_engine::Event::Token { text: t, .. } = ev {
                text.push_str(&t);
            }
        }
        assert_eq!(text, "bcde");
        h.shutdown();
        tokio::time::timeout(Duration::from_secs(5), h.stopped()).await.expect("engine stopped");
    });
}

#[test]
fn long_prompts_snapshot_sparsely_without_cutting_every_chunk() {
    let prompt = pseudo_prompt(400, 5);
    let (fake, probe) = Fake::new(Mode::Hash);
    let h = start(fake, EngineOptions { prefill_chunk: 128, ..cache_opts(16, 100_000) });
    let first = collect(h.submit(greedy(prompt.clone(), 4)).expect("submit"));
    // Blocks 1-8, 16, and the last four (22-25) of 25.
    assert_eq!(h.stats().prefix_cache_entries, 13);
    let chunks: Vec<usize> = probe
        .lock()
        .expect("probe")
        .calls
        .iter()
        .filter_map(|c| match c {
            Call::Prefill { tokens, .. } => Some(*tokens),
            _ => None,
        })
        .collect();
    assert!(chunks.iter().any(|&n| n > 16), "every chunk was cut at a boundary: {chunks:?}");
    assert_eq!(chunks.iter().sum::<usize>(), 400);

    let (fake, _probe) = Fake::new(Mode::Hash);
    let plain = collect(start(fake, opts()).submit(greedy(prompt.clone(), 4)).expect("submit"));
    assert_eq!(first.ids, plain.ids);

    let mut next = prompt.clone();
    next.extend(pseudo_prompt(30, 6));
    assert_eq!(collect(h.submit(greedy(next, 4)).expect("submit")).cached_tokens, 400);
    let mut mid = prompt[..300].to_vec();
    mid.extend(pseudo_prompt(30, 7));
    // 300 tokens in common: the best sparse snapshot below is block 16 (256).
    assert_eq!(collect(h.submit(greedy(mid, 4)).expect("submit")).cached_tokens, 256);
}

/// The `EngineError::Capacity` message of a request that ran out of KV
/// memory, or a panic naming what the request got instead.
fn out_of_memory_message(c: &support::Collected) -> &str {
    match &c.failed {
        Some(EngineError::Capacity(m)) => m,
        _ => panic!("expected a capacity failure: {c:?}"),
    }
}

#[test]
fn snapshots_give_back_kv_memory_before_a_request_fails() {
    // A 64-token pool. The first request leaves a 16-token snapshot; the
    // second needs 53 tokens plus room for its own snapshots, so its
    // prefill runs out unless snapshots are evicted for it.
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.kv_pool(64), cache_opts(16, 10_000));
    let first = collect(h.submit(greedy(vec![A; 32], 2)).expect("submit"));
    assert_eq!(first.finish, Some(FinishReason::Length), "{first:?}");
    assert!(h.stats().prefix_cache_held_tokens > 0);
    let refusals_before = probe.lock().expect("probe").pool_refusals;

    let second = collect(h.submit(greedy(vec![A + 100; 50], 4)).expect("submit"));
    assert_eq!((second.finish, second.completion_tokens), (Some(FinishReason::Length), 4), "{second:?}");
    assert_eq!(second.ids, vec![A + 101, A + 102, A + 103, A + 104]);
    // The pool really ran out, and snapshots were what gave way.
    assert!(probe.lock().expect("probe").pool_refusals > refusals_before);
    let s = h.stats();
    assert!(s.prefix_cache_evictions > 0, "{s:?}");
    assert_eq!(s.requests_failed, 0);
    assert_only_snapshots_hold_sequences(&probe, &h);
}

#[test]
fn kv_memory_running_out_mid_generation_preempts_the_youngest_which_resumes() {
    // Each request grows to 10 + 19 fed tokens; two of them outgrow a
    // 40-token pool while both generate.
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.kv_pool(40).gate(gate.clone()), opts());
    let held = gate.lock().expect("gate");
    let mut blocker = h.submit(greedy(vec![A + 50], 1)).expect("submit");
    let started = wait_started(&mut blocker);
    // The engine now waits at the gate in the blocker's prefill, so both
    // requests below are admitted in the same step (each fits then) and
    // grow in step: the pool is exactly full (40) when both need a token
    // more, and the older one gets memory only if the younger gives its
    // own back.
    let older = h.submit(greedy(vec![A; 10], 20)).expect("submit");
    let younger = h.submit(greedy(vec![A + 100; 10], 20)).expect("submit");
    drop(held);
    let blocker = collect_rest(blocker, started);
    assert_eq!(blocker.finish, Some(FinishReason::Length), "{blocker:?}");
    let (older, younger) = (std::thread::spawn(move || collect(older)), std::thread::spawn(move || collect(younger)));
    let (older, younger) = (older.join().expect("older"), younger.join().expect("younger"));

    // Both run to their end with every token right: the younger paused
    // (its sequence freed), was recomputed once the older had finished,
    // and went on where it stopped.
    assert_eq!((older.finish, older.completion_tokens), (Some(FinishReason::Length), 20), "{older:?}");
    assert_eq!(older.ids, (1..=20).map(|k| A + k).collect::<Vec<_>>());
    assert_eq!((younger.finish, younger.completion_tokens), (Some(FinishReason::Length), 20), "{younger:?}");
    assert_eq!(younger.ids, (1..=20).map(|k| A + 100 + k).collect::<Vec<_>>());
    assert!(probe.lock().expect("probe").pool_refusals > 0);
    let s = h.stats();
    assert!(s.preemptions >= 1, "{s:?}");
    assert_eq!((s.requests_failed, s.requests_finished), (0, 3));
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0), "a sequence was not freed");
}

#[test]
fn preempted_requests_are_recomputed_to_the_same_tokens() {
    // Eight seeded, sampled requests (Hash logits: any error in the
    // recomputed state changes what follows) on a pool that holds about
    // two of them at full length, against the same requests with room.
    let requests: Vec<GenerateRequest> = (0..8u32)
        .map(|k| GenerateRequest {
            sampling: SamplingParams { temperature: 1.0, seed: Some(u64::from(k) + 7), ..SamplingParams::default() },
            ..GenerateRequest::new(pseudo_prompt(20 + 3 * k as usize, 40 + k), 30)
        })
        .collect();
    let run = |pool: Option<usize>, batched: bool, mixed: bool| {
        let (fake, probe) = Fake::new(Mode::Hash);
        let fake = if mixed { fake.mixed(MixedSteps::Pays) } else { fake };
        // The tight pool also runs on a pipelining fake that checks the
        // engine never frees or prefills a sequence a step computes on.
        let fake = match pool {
            Some(n) => fake.kv_pool(n).pipelined(),
            None => fake,
        };
        let fake = if batched { fake.batched_prefill() } else { fake };
        // Every request arrives while the engine waits at the gate in a
        // blocker's prefill, so the runs do not depend on arrival timing.
        let gate = Arc::new(Mutex::new(()));
        let h = start(fake.delay(Duration::from_micros(200)).gate(gate.clone()), cache_opts(16, 10_000));
        let held = gate.lock().expect("gate");
        let mut blocker = h.submit(greedy(vec![A + 50], 1)).expect("submit");
        let started = wait_started(&mut blocker);
        let streams: Vec<_> = requests.iter().map(|r| h.submit(r.clone()).expect("submit")).collect();
        drop(held);
        assert_eq!(collect_rest(blocker, started).finish, Some(FinishReason::Length));
        let outs: Vec<_> =
            streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect::<Vec<_>>().into_iter().map(|t| t.join().expect("collect")).collect();
        assert_only_snapshots_hold_sequences(&probe, &h);
        assert_eq!(probe.lock().expect("probe").violations, Vec::<String>::new());
        let calls = probe.lock().expect("probe").calls.clone();
        (outs, h.stats(), calls)
    };
    let (roomy, _, _) = run(None, false, false);
    // The tight pool with prefill one call per request, then with the
    // chunks of several requests in one call (a batch refused for memory
    // falls back to one request at a time, where preemption settles it).
    for batched in [false, true] {
        let (tight, stats, calls) = run(Some(120), batched, false);
        assert!(stats.preemptions > 0, "the pool never ran short: {stats:?}");
        assert_eq!(stats.requests_failed, 0, "{stats:?}");
        for (k, (t, r)) in tight.iter().zip(&roomy).enumerate() {
            assert_eq!((t.finish, t.completion_tokens), (Some(FinishReason::Length), 30), "batched {batched}, request {k}: {t:?}");
            assert_eq!(t.ids, r.ids, "batched {batched}, request {k}: tokens differ after preemption");
            assert_eq!(t.text, r.text, "batched {batched}, request {k}");
        }
        let batches = calls.iter().filter(|c| matches!(c, Call::PrefillBatch { parts } if parts.len() > 1)).count();
        assert_eq!(batches > 0, batched, "prefill batches of several requests: {calls:?}");
        let refused = calls.contains(&Call::Refused("prefill_batch"));
        assert_eq!(refused, batched, "a batch refused for memory, then run one request at a time: {calls:?}");
    }
    // Mixed steps on the tight pool: a mixed call refused for memory runs
    // its decode step and prefill apart, where preemption settles it.
    let (tight, stats, _) = run(Some(120), true, true);
    assert!(stats.preemptions > 0 && stats.mixed_steps > 0, "{stats:?}");
    assert_eq!(stats.requests_failed, 0, "{stats:?}");
    for (k, (t, r)) in tight.iter().zip(&roomy).enumerate() {
        assert_eq!((t.finish, &t.ids, &t.text), (r.finish, &r.ids, &r.text), "mixed, request {k}");
    }
}

#[test]
fn a_request_larger_than_the_kv_pool_fails_while_others_are_served() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.kv_pool(64).delay(Duration::from_millis(1)), cache_opts(16, 10_000));
    // A 100-token prompt can never fit; a small request runs meanwhile
    // (it grows to 33 tokens) and must not be the one that pays.
    let small = h.submit(greedy(vec![A; 4], 30)).expect("submit");
    let huge = h.submit(greedy(pseudo_prompt(100, 3), 4)).expect("submit");
    let (small, huge) = (std::thread::spawn(move || collect(small)), std::thread::spawn(move || collect(huge)));
    let (small, huge) = (small.join().expect("small"), huge.join().expect("huge"));
    assert_eq!((small.finish, small.completion_tokens), (Some(FinishReason::Length), 30), "{small:?}");
    assert!(out_of_memory_message(&huge).contains("KV cache full"));
    assert!(huge.ids.is_empty(), "{huge:?}");

    // Alone, a request that fits at first but outgrows the pool keeps every
    // token the pool has room for (every snapshot evicted for it), then
    // fails: 40 prompt + 24 fed generated tokens = 64, and the 25th token
    // was sampled from the last logits it got.
    let grows = collect(h.submit(greedy(vec![A; 40], 40)).expect("submit"));
    assert!(out_of_memory_message(&grows).contains("KV cache full"));
    assert_eq!(grows.ids.len(), 25, "{grows:?}");
    assert_eq!(h.stats().prefix_cache_entries, 0);

    // The engine keeps serving.
    let c = collect(h.submit(greedy(vec![A; 4], 8)).expect("submit"));
    assert_eq!((c.finish, c.completion_tokens), (Some(FinishReason::Length), 8));
    assert_eq!(h.stats().requests_failed, 2);
    assert_only_snapshots_hold_sequences(&probe, &h);
}

#[test]
fn a_request_that_does_not_fit_beside_running_ones_waits_for_memory() {
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.kv_pool(44).gate(gate.clone()), EngineOptions { prefill_chunk: 8, ..opts() });
    let held = gate.lock().expect("gate");
    // `older` grows to 8 + 29 = 37 tokens. `younger` needs 40 + 3: alone it
    // fits the 44-token pool, beside `older` it does not, so it is not
    // admitted until `older` has ended (rather than started and failed).
    let mut older = h.submit(greedy(vec![A; 8], 30)).expect("submit");
    let started = wait_started(&mut older);
    let younger = h.submit(greedy(vec![A + 100; 40], 4)).expect("submit");
    drop(held);
    let older = std::thread::spawn(move || collect_rest(older, started));
    let younger = collect(younger);
    let older = older.join().expect("older");

    assert_eq!((older.finish, older.completion_tokens), (Some(FinishReason::Length), 30), "{older:?}");
    assert_eq!((younger.finish, younger.completion_tokens), (Some(FinishReason::Length), 4), "{younger:?}");
    assert_eq!(younger.ids, (1..=4).map(|k| A + 100 + k).collect::<Vec<_>>());
    let s = h.stats();
    assert_eq!((s.requests_failed, s.preemptions), (0, 0), "{s:?}");
    // It never touched the pool before `older` was done.
    assert_eq!(probe.lock().expect("probe").pool_refusals, 0);
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}

// ----- running ahead ---------------------------------------------------------

/// Seeded, penalised sampling with stop ids, a stop string and logprobs,
/// one request per prompt length (with Hash logits a token fed twice or
/// skipped changes everything after it).
fn penalised_requests(prompt_lens: &[usize], max_tokens: usize) -> Vec<GenerateRequest> {
    (0u32..)
        .zip(prompt_lens)
        .map(|(k, &len)| GenerateRequest {
            sampling: SamplingParams {
                temperature: 0.9,
                top_k: 40,
                presence_penalty: 0.4,
                frequency_penalty: 0.3,
                repetition_penalty: 1.2,
                seed: Some(100 + u64::from(k)),
                ..SamplingParams::default()
            },
            stop_token_ids: (0..12).map(|j| 20 + 17 * j + k).collect(),
            stop_strings: vec!["q".into()],
            logprobs: Some(2),
            ..GenerateRequest::new(pseudo_prompt(len, 60 + k), max_tokens)
        })
        .collect()
}

fn no_violations(probe: &Mutex<Probe>) {
    assert_eq!(probe.lock().expect("probe").violations, Vec::<String>::new());
}

#[test]
fn running_ahead_gives_the_same_tokens_as_not() {
    // Some requests stop at a step the run-ahead already fed the next one.
    let requests = penalised_requests(&[12, 13, 14, 15, 16, 17], 40);
    let run = |run_ahead: bool, pipelined: bool| {
        let (fake, probe) = Fake::new(Mode::Hash);
        let fake = if pipelined { fake.pipelined() } else { fake };
        let h = start(fake.delay(Duration::from_micros(300)), EngineOptions { run_ahead, ..cache_opts(8, 10_000) });
        let streams: Vec<_> = requests.iter().map(|r| h.submit(r.clone()).expect("submit")).collect();
        let outs: Vec<_> =
            streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect::<Vec<_>>().into_iter().map(|t| t.join().expect("collect")).collect();
        assert_only_snapshots_hold_sequences(&probe, &h);
        no_violations(&probe);
        outs
    };
    let plain = run(false, false);
    let stopped = plain.iter().filter(|c| c.finish == Some(FinishReason::Stop) && c.completion_tokens < 40).count();
    assert!(stopped >= 2, "too few early stops to test: {plain:?}");
    for (label, ahead) in [("run ahead", run(true, false)), ("pipelined", run(true, true))] {
        for (k, (a, p)) in ahead.iter().zip(&plain).enumerate() {
            assert_eq!(a.ids, p.ids, "{label}, request {k}");
            assert_eq!((&a.text, a.finish), (&p.text, p.finish), "{label}, request {k}");
            assert_eq!(a.logprobs, p.logprobs, "{label}, request {k}");
        }
    }
}

#[test]
fn a_stop_at_step_t_discards_step_t_plus_one_and_never_snapshots_it() {
    // Prompt of 5 ending in 'a': greedy gives b, c, then d (a stop id).
    // Running ahead, d is fed by one more step (the sequence then holds 8
    // tokens, a snapshot boundary) whose draw is discarded.
    let prompt = vec![A + 20, A + 21, A + 22, A + 23, A];
    let req = GenerateRequest { stop_token_ids: vec![A + 3], ..greedy(prompt.clone(), 10) };
    for run_ahead in [false, true] {
        let (fake, probe) = Fake::new(Mode::Count);
        let h = start(fake.pipelined(), EngineOptions { run_ahead, ..cache_opts(8, 10_000) });
        let c = collect(h.submit(req.clone()).expect("submit"));
        assert_eq!(c.ids, vec![A + 1, A + 2, A + 3], "run ahead {run_ahead}");
        assert_eq!((c.text.as_str(), c.finish), ("bc", Some(FinishReason::Stop)));
        let fed_stop = probe.lock().expect("probe").fed.iter().any(|f| f.1 == A + 3);
        assert_eq!(fed_stop, run_ahead, "the stop token fed to a step");
        assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
        no_violations(&probe);
        assert_eq!(h.stats().prefix_cache_entries, 0, "run ahead {run_ahead}");
        // The next turn finds no snapshot holding the stop token.
        let mut next = prompt.clone();
        next.extend([A + 1, A + 2, A + 3, A + 40]);
        let c = collect(h.submit(greedy(next, 2)).expect("submit"));
        assert_eq!((c.cached_tokens, c.ids[0]), (0, A + 41));
    }
}

#[test]
fn cancelling_mid_run_ahead_frees_the_sequence_once_its_step_is_collected() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.pipelined().delay(Duration::from_millis(2)), opts());
    let mut s = h.submit(greedy(vec![A], 1000)).expect("submit");
    let mut tokens = 0;
    while tokens < 3 {
        if let Some(lily_engine::Event::Token { .. }) = s.blocking_recv() {
            tokens += 1;
        }
    }
    s.cancel();
    let mut finish = None;
    while let Some(ev) = s.blocking_recv() {
        if let lily_engine::Event::Finished { reason, .. } = ev {
            finish = Some(reason);
        }
    }
    assert_eq!(finish, Some(FinishReason::Cancelled));
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0), "sequence not freed");
    no_violations(&probe);
    // Every step submitted was collected.
    let calls = probe.lock().expect("probe").calls.clone();
    let submitted = calls.iter().filter(|c| matches!(c, Call::Decode { .. })).count();
    let collected = calls.iter().filter(|c| matches!(c, Call::Collect { .. })).count();
    assert_eq!(submitted, collected);
    assert_eq!(collect(h.submit(greedy(vec![A], 2)).expect("submit")).text, "bc");
}

#[test]
fn preemption_while_a_step_is_in_flight_collects_it_first() {
    // `older` has a long prompt prefilled in chunks of 16 (no prefix
    // cache, so no snapshot takes the memory that runs short); `younger`,
    // admitted in the same step, fits in the 2 tokens of budget a chunk
    // leaves and generates (a step always in flight) while `older` still
    // prefills. The 44-token pool runs out in one of `older`'s
    // chunks: the youngest holder, `younger`, must give its memory back,
    // but a step computes on its sequence, so that step is collected
    // first, then it is preempted; it resumes once `older` is done.
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.kv_pool(44).pipelined().gate(gate.clone()), EngineOptions { prefill_chunk: 18, ..cache_opts(8, 0) });
    let held = gate.lock().expect("gate");
    let mut blocker = h.submit(greedy(vec![A + 50], 1)).expect("submit");
    let started = wait_started(&mut blocker);
    let older = h.submit(greedy(vec![A; 40], 3)).expect("submit");
    let younger = h.submit(greedy(vec![A + 100, A + 100], 12)).expect("submit");
    drop(held);
    let blocker = collect_rest(blocker, started);
    assert_eq!(blocker.finish, Some(FinishReason::Length));
    let (older, younger) = (std::thread::spawn(move || collect(older)), std::thread::spawn(move || collect(younger)));
    let (older, younger) = (older.join().expect("older"), younger.join().expect("younger"));
    assert_eq!(older.ids, vec![A + 1, A + 2, A + 3], "{older:?}");
    assert_eq!(younger.ids, (1..=12).map(|k| A + 100 + k).collect::<Vec<_>>(), "{younger:?}");
    let s = h.stats();
    assert!(s.preemptions >= 1, "{s:?}");
    assert_eq!(s.requests_failed, 0, "{s:?}");
    no_violations(&probe);
    // A call refused for memory (older's prefill, or the next step once
    // older decodes too) was followed by collecting the step in flight
    // (before anything was freed).
    let calls = probe.lock().expect("probe").calls.clone();
    assert!(calls.windows(2).any(|w| matches!(w[0], Call::Refused("prefill" | "decode")) && matches!(w[1], Call::Collect { .. })), "{calls:?}");
    assert_only_snapshots_hold_sequences(&probe, &h);
}

/// Each prefill call's part count, in order.
fn prefill_parts(calls: &[Call]) -> Vec<usize> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::PrefillBatch { parts } => Some(parts.len()),
            Call::Prefill { .. } => Some(1),
            _ => None,
        })
        .collect()
}

/// Requests that a front end announced (`EngineHandle::arrival`) and is
/// still preparing when the first one reaches an idle engine start in one
/// prefill pass with it, however far apart they are submitted, while any
/// is still announced; without the wait the first is prefilled alone.
#[test]
fn requests_arriving_together_share_the_first_prefill_pass() {
    for wait in [Duration::from_secs(30), Duration::ZERO] {
        let (fake, probe) = Fake::new(Mode::Count);
        let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: wait, ..opts() });
        let arrivals: Vec<_> = (0..4).map(|_| h.arrival()).collect();
        let mut streams = Vec::new();
        for (i, a) in arrivals.into_iter().enumerate() {
            // Handed over with the request, as the server does.
            streams.push(h.submit_announced(greedy(vec![A + i as u32; 3 + i], 4), Some(Box::new(a))).expect("submit"));
            // Far longer than the engine's quiet gap (GATHER_QUIET).
            std::thread::sleep(Duration::from_millis(20));
        }
        for (i, s) in streams.into_iter().enumerate() {
            let c = collect(s);
            assert_eq!((c.finish, c.completion_tokens), (Some(FinishReason::Length), 4), "wait {wait:?}, request {i}: {c:?}");
        }
        let calls = probe.lock().expect("probe").calls.clone();
        let s = h.stats();
        if wait.is_zero() {
            assert_eq!(prefill_parts(&calls).first(), Some(&1), "{calls:?}");
            assert_eq!((s.arrival_waits, s.arrival_gathered), (0, 0));
        } else {
            assert_eq!(prefill_parts(&calls).first(), Some(&4), "{calls:?}");
            assert_eq!((s.arrival_waits, s.arrival_gathered), (1, 3));
        }
    }
}

/// An announced request that never comes holds an idle engine's first
/// prefill back for the limit and no longer.
#[test]
fn an_arrival_that_never_comes_holds_the_first_prefill_only_for_the_limit() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: Duration::from_millis(50), ..opts() });
    let held = h.arrival();
    let c = collect(h.submit(greedy(vec![A], 3)).expect("submit"));
    assert_eq!((c.finish, c.completion_tokens), (Some(FinishReason::Length), 3), "{c:?}");
    let s = h.stats();
    assert_eq!((s.arrival_waits, s.arrival_gathered), (1, 0));
    assert!(s.time.arrival_wait_s >= 0.05, "waited {} s", s.time.arrival_wait_s);
    drop(held);
}

/// The engine waits for nothing when no request is announced, nor while a
/// stream is generating (it would stall it): with a limit of an hour,
/// both requests here start at once.
#[test]
fn no_arrival_wait_for_a_lone_request_or_beside_a_running_stream() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill().delay(Duration::from_millis(2)), EngineOptions { arrival_wait: Duration::from_secs(3600), ..opts() });
    let prefills = || probe.lock().expect("probe").calls.iter().filter(|c| matches!(c, Call::PrefillBatch { .. } | Call::Prefill { .. })).count();
    // Announced, as the server does: its own announcement ends as it is queued.
    let mut first = h.submit_announced(greedy(vec![A], 200), Some(Box::new(h.arrival()))).expect("submit");
    assert!(eventually(Duration::from_secs(20), || prefills() == 1), "a lone request waited");
    wait_started(&mut first);
    let held = h.arrival();
    let second = h.submit(greedy(vec![A + 1], 3)).expect("submit");
    assert!(eventually(Duration::from_secs(20), || prefills() == 2), "a request beside a running stream waited");
    assert_eq!(h.stats().arrival_waits, 0);
    let c = collect(second);
    assert_eq!(c.finish, Some(FinishReason::Length));
    drop(held);
    first.cancel();
}

/// Four requests announced together (so that, with an arrival wait, they
/// share a pass and end in the same step), run to their end.
fn four_end_together(h: &EngineHandle, first: u32) {
    let arrivals: Vec<_> = (0..4).map(|_| h.arrival()).collect();
    let streams: Vec<_> =
        arrivals.into_iter().enumerate().map(|(i, a)| h.submit_announced(greedy(vec![first + i as u32; 3], 2), Some(Box::new(a))).expect("submit")).collect();
    for s in streams {
        assert_eq!(collect(s).finish, Some(FinishReason::Length));
    }
}

/// `n` follow-ups of `len` tokens submitted 20 ms apart, not announced: far
/// apart for the engine, well inside the gap it keeps for expected ones (a
/// quarter of the tests' limits), each run to its end.
fn follow_ups(h: &EngineHandle, n: u32, len: usize) {
    let mut streams = Vec::new();
    for i in 0..n {
        streams.push(h.submit(greedy(vec![A + 10 + i; len], 2)).expect("submit"));
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in streams {
        assert_eq!(collect(s).finish, Some(FinishReason::Length));
    }
}

/// Arrival waits and gathered requests since `before`.
fn gathers_since(h: &EngineHandle, before: &EngineStats) -> (u64, u64) {
    let s = h.stats();
    (s.arrival_waits - before.arrival_waits, s.arrival_gathered - before.arrival_gathered)
}

/// When several requests end together, the next one to reach the idle
/// engine brings the others' follow-ups with it (a benchmark round, agents
/// in step): the engine waits for them even though none is announced yet,
/// and they start in one prefill pass. Without the wait the first starts
/// alone.
#[test]
fn follow_ups_of_requests_that_ended_together_share_one_pass() {
    for wait in [Duration::from_secs(30), Duration::ZERO] {
        let (fake, probe) = Fake::new(Mode::Count);
        let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: wait, ..opts() });
        four_end_together(&h, A);
        let before = h.stats();
        follow_ups(&h, 4, 4);
        let parts = prefill_parts(&probe.lock().expect("probe").calls);
        if wait.is_zero() {
            assert_eq!(parts.last(), Some(&1), "wait {wait:?}: {parts:?}");
            assert_eq!(h.stats().arrival_waits, 0);
        } else {
            // The first four shared a pass too (announced).
            assert_eq!(parts.first(), Some(&4), "{parts:?}");
            assert_eq!(parts.last(), Some(&4), "{parts:?}");
            assert_eq!(gathers_since(&h, &before), (1, 3));
        }
    }
}

/// Expected follow-ups that do not come hold the first prefill for the
/// limit when none of them comes, and for a quarter of it after the last
/// one that came.
#[test]
fn expected_follow_ups_that_do_not_come_cost_the_limit_then_a_quarter_of_it() {
    let limit = Duration::from_millis(800);
    for came in [0u32, 1] {
        let (fake, _probe) = Fake::new(Mode::Count);
        let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: limit, ..opts() });
        four_end_together(&h, A);
        let before = h.stats();
        follow_ups(&h, 1 + came, 3);
        assert_eq!(gathers_since(&h, &before), (1, came as u64));
        let waited = h.stats().time.arrival_wait_s - before.time.arrival_wait_s;
        let (least, most) = if came == 0 { (limit.as_secs_f64(), 1.5 * limit.as_secs_f64()) } else { ((limit / 4).as_secs_f64(), 0.75 * limit.as_secs_f64()) };
        assert!(waited >= least && waited < most, "{came} came: waited {waited} s");
    }
}

/// A follow-up later than a quarter of the limit after the first one (its
/// predecessor was a step ahead of the others: a benchmark round whose
/// first request had started in a lone pass) still joins the first pass:
/// until one expected follow-up has come, only the limit bounds the wait.
/// Measured on the H100 host with a quarter of the limit as the gap: every
/// 8-client round after the first began with a lone pass (~19 ms).
#[test]
fn a_late_first_follow_up_still_joins_the_first_pass() {
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: Duration::from_millis(1200), ..opts() });
    four_end_together(&h, A);
    let before = h.stats();
    let first = h.submit(greedy(vec![A + 10; 4], 2)).expect("submit");
    // Past a quarter of the limit (300 ms), well inside it.
    std::thread::sleep(Duration::from_millis(450));
    let rest: Vec<_> = (1..4).map(|i| h.submit(greedy(vec![A + 10 + i; 4], 2)).expect("submit")).collect();
    for s in std::iter::once(first).chain(rest) {
        assert_eq!(collect(s).finish, Some(FinishReason::Length));
    }
    let parts = prefill_parts(&probe.lock().expect("probe").calls);
    assert_eq!(parts.last(), Some(&4), "{parts:?}");
    assert_eq!(gathers_since(&h, &before), (1, 3));
}

/// The gather stops once the waiting prompts fill a prefill pass: the
/// follow-ups past it would wait for a later pass anyway.
#[test]
fn the_gather_stops_once_a_pass_is_full() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: Duration::from_secs(30), prefill_chunk: 16, ..opts() });
    four_end_together(&h, A);
    let before = h.stats();
    // Two of the three expected, 10 tokens each: the second fills the
    // pass (16 tokens and a tail of up to 4), so the third is not waited
    // for (a quarter of the limit after the second, 7.5 s).
    follow_ups(&h, 2, 10);
    assert_eq!(gathers_since(&h, &before), (1, 1));
    let waited = h.stats().time.arrival_wait_s - before.time.arrival_wait_s;
    assert!(waited < 5.0, "waited {waited} s");
}

/// A request after a lone request's end expects nobody: it starts at once.
#[test]
fn a_request_after_a_lone_request_never_waits() {
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill(), EngineOptions { arrival_wait: Duration::from_secs(3600), ..opts() });
    for i in 0..3 {
        let c = collect(h.submit(greedy(vec![A + i; 3], 2)).expect("submit"));
        assert_eq!(c.finish, Some(FinishReason::Length));
    }
    assert_eq!(h.stats().arrival_waits, 0);
}

/// A greedy request from client `client` (`GenerateRequest::client`).
fn from_client(client: u64, prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest { client: Some(client), ..greedy(prompt, max_tokens) }
}

/// A burst of clients starting together (a benchmark phase, agents woken
/// at once): the first request reaches the idle engine before the others
/// are announced, and the request that ended last was another client's.
/// The engine waits a quiet gap (`arrival_wait / 12`) after each arrival
/// and the four start in one prefill pass; without client ids (or without
/// the wait) the first starts alone.
#[test]
fn other_clients_right_behind_a_newcomer_share_its_first_pass() {
    let wait = Duration::from_millis(2400);
    for (with_clients, arrival_wait) in [(true, wait), (false, wait), (true, Duration::ZERO)] {
        let (fake, probe) = Fake::new(Mode::Count);
        let h = start(fake.batched_prefill(), EngineOptions { arrival_wait, ..opts() });
        // A request of client 1 runs to its end first (the calibration
        // request before a benchmark phase).
        assert_eq!(collect(h.submit(from_client(1, vec![A; 3], 2)).expect("submit")).finish, Some(FinishReason::Length));
        let before = h.stats();
        let mut streams = Vec::new();
        for i in 0..4u32 {
            let req = if with_clients { from_client(10 + u64::from(i), vec![A + 1 + i; 4], 2) } else { greedy(vec![A + 1 + i; 4], 2) };
            streams.push(h.submit(req).expect("submit"));
            // Far apart for the engine's thread, well inside the gap (200 ms).
            std::thread::sleep(Duration::from_millis(20));
        }
        for s in streams {
            assert_eq!(collect(s).finish, Some(FinishReason::Length));
        }
        let parts = prefill_parts(&probe.lock().expect("probe").calls);
        let label = format!("clients {with_clients}, wait {arrival_wait:?}: {parts:?}");
        if with_clients && !arrival_wait.is_zero() {
            assert_eq!(parts.last(), Some(&4), "{label}");
            assert_eq!(gathers_since(&h, &before), (1, 3), "{label}");
        } else {
            assert_eq!(parts[parts.len() - 4..], [1, 1, 1, 1][..].to_vec()[..], "{label}");
            assert_eq!(gathers_since(&h, &before), (0, 0), "{label}");
        }
    }
}

/// One client's next request starts at once (a chat user, a one-client
/// benchmark: its previous request was the last to end); another client's,
/// reaching the idle engine after it, waits the quiet gap and no longer.
#[test]
fn one_clients_next_request_never_waits_and_another_clients_waits_the_quiet_gap() {
    let arrival_wait = Duration::from_millis(1200);
    let (fake, _probe) = Fake::new(Mode::Count);
    let h = start(fake.batched_prefill(), EngineOptions { arrival_wait, ..opts() });
    for i in 0..3 {
        assert_eq!(collect(h.submit(from_client(7, vec![A + i; 3], 2)).expect("submit")).finish, Some(FinishReason::Length));
    }
    // The first request of client 7 was a newcomer (no request had ended).
    let first = h.stats();
    assert_eq!((first.arrival_waits, first.arrival_gathered), (1, 0));
    assert!(first.time.arrival_wait_s >= (arrival_wait / 12).as_secs_f64(), "waited {} s", first.time.arrival_wait_s);
    assert!(first.time.arrival_wait_s < (arrival_wait / 2).as_secs_f64(), "waited {} s", first.time.arrival_wait_s);
    assert_eq!(collect(h.submit(from_client(8, vec![A + 5; 3], 2)).expect("submit")).finish, Some(FinishReason::Length));
    let waited = h.stats().time.arrival_wait_s - first.time.arrival_wait_s;
    assert_eq!(gathers_since(&h, &first), (1, 0));
    assert!(waited >= (arrival_wait / 12).as_secs_f64() && waited < (arrival_wait / 2).as_secs_f64(), "client 8 waited {waited} s");
}

/// A fake that runs a step's decode rows inside its prefill call
/// (`Backend::mixed_steps` says `said`), its prefill batches one call each.
fn mixing(fake: Fake, said: MixedSteps) -> Fake {
    fake.batched_prefill().mixed(said)
}

#[test]
fn a_mixed_step_runs_the_decode_rows_inside_the_prefill_call() {
    // As `prefill_per_step_is_bounded_while_prompts_arrive_together`, on a
    // backend whose prefill takes decode rows: while the three prompts are
    // prefilled, the running stream's token rides in each prefill call as
    // a one-token part and no decode step runs apart; the budget per call
    // is the same.
    let (fake, probe) = Fake::new(Mode::Count);
    let (calls, s) = three_prompts_beside_a_stream(mixing(fake, MixedSteps::Pays), &probe);
    let stream_seq = calls
        .iter()
        .find_map(|c| match c {
            Call::Prefill { seq, tokens: 1 } => Some(*seq),
            _ => None,
        })
        .expect("the stream's prompt prefill");
    // The calls that prefilled the long prompts, in order.
    let passes: Vec<(usize, &Vec<(SeqId, usize)>)> = calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Call::PrefillBatch { parts } if parts.iter().any(|p| p.0 != stream_seq && p.1 > 1) => Some((i, parts)),
            _ => None,
        })
        .collect();
    // Prompt chunks here are longer than a token; a one-token part is a
    // decode row (the stream's, or a long prompt's second token).
    let chunk_tokens = |parts: &[(SeqId, usize)]| parts.iter().filter(|p| p.1 > 1).map(|p| p.1).sum::<usize>();
    let prompt_tokens: usize = passes.iter().map(|(_, parts)| chunk_tokens(parts)).sum();
    assert_eq!(prompt_tokens, 300, "{calls:?}");
    assert!(passes.len() >= 300usize.div_ceil(40), "{calls:?}");
    for (_, parts) in &passes {
        assert!(parts.contains(&(stream_seq, 1)), "a prefill call without the stream's decode row: {parts:?}");
        assert!(chunk_tokens(parts) <= 32 + 32 / 4, "{parts:?}");
    }
    let (first, last) = (passes[0].0, passes[passes.len() - 1].0);
    let apart = calls[first..last].iter().filter(|c| matches!(c, Call::Decode { .. } | Call::Collect { .. })).count();
    assert_eq!(apart, 0, "a decode step apart while prompts were prefilled: {calls:?}");
    assert!(s.mixed_steps >= passes.len() as u64, "{s:?}");
    // Counted as decode steps of the stream (the long prompts' second
    // tokens may ride too).
    assert!(s.decode_steps >= s.mixed_steps, "{s:?}");
}

#[test]
fn mixed_steps_give_the_same_tokens_as_steps_apart() {
    // Penalised sampling with stops; prompts cut into 8-token chunks so
    // that prompts are prefilled beside generating requests for many
    // steps; the backend draws the rows of even sequences itself and hands
    // the others' logits back.
    let requests = penalised_requests(&[12, 17, 22, 27, 32, 37], 30);
    let run = |fake: Fake, mix: MixPolicy| {
        let h = start(fake.delay(Duration::from_micros(200)), EngineOptions { prefill_chunk: 8, mixed_steps: mix, ..opts() });
        let outs: Vec<_> = requests
            .iter()
            .map(|r| {
                // One at a time, so every prompt after the first arrives
                // beside generating requests.
                let s = h.submit(r.clone()).expect("submit");
                std::thread::sleep(Duration::from_millis(2));
                std::thread::spawn(move || collect(s))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("collect"))
            .collect();
        (outs, h.stats())
    };
    let (fake, _) = Fake::new(Mode::Hash);
    let (apart, s) = run(fake, MixPolicy::Off);
    assert_eq!(s.mixed_steps, 0);
    let stopped = apart.iter().filter(|c| c.finish == Some(FinishReason::Stop)).count();
    assert!(stopped >= 1, "no early stop to test: {apart:?}");
    // Auto mixes where the backend says it pays, On also where it is only
    // possible; Auto leaves a merely possible backend alone.
    for (label, said, mix, mixes) in [
        ("pays, auto", MixedSteps::Pays, MixPolicy::Auto, true),
        ("possible, on", MixedSteps::Possible, MixPolicy::On, true),
        ("possible, auto", MixedSteps::Possible, MixPolicy::Auto, false),
        ("never, on", MixedSteps::Never, MixPolicy::On, false),
    ] {
        let (fake, probe) = Fake::new(Mode::Hash);
        let (mixed, s) = run(mixing(fake, said).pipelined().draws_first(), mix);
        no_violations(&probe);
        assert_eq!(s.mixed_steps > 0, mixes, "{label}: {s:?}");
        assert_eq!(s.requests_failed, 0, "{label}: {s:?}");
        for (k, (m, a)) in mixed.iter().zip(&apart).enumerate() {
            assert_eq!(m.ids, a.ids, "{label}, request {k}");
            assert_eq!((&m.text, m.finish), (&a.text, a.finish), "{label}, request {k}");
            assert_eq!(m.logprobs, a.logprobs, "{label}, request {k}");
        }
        assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0), "{label}");
    }
}

#[test]
fn a_fault_in_a_mixed_step_fails_only_its_request() {
    // The stream feeds the poison (A + 10) at its sixth decode, while a
    // long prompt is still being prefilled beside it: the mixed call is
    // refused whole (changing no sequence), the step runs apart, where the
    // decode fault is isolated to the stream, and the prompt goes on.
    let gate = Arc::new(Mutex::new(()));
    let (fake, probe) = Fake::new(Mode::Count);
    let h = start(mixing(fake, MixedSteps::Pays).poison(A + 10).gate(gate.clone()), EngineOptions { prefill_chunk: 16, ..opts() });
    let held = gate.lock().expect("gate");
    let mut stream = h.submit(greedy(vec![A + 4], 20)).expect("submit");
    let started = wait_started(&mut stream);
    let prompt: Vec<u32> = (0..200).map(|i| 100 + i % 100).collect();
    let long = h.submit(greedy(prompt.clone(), 3)).expect("submit");
    let other = h.submit(greedy(vec![A + 20], 30)).expect("submit");
    drop(held);
    let (long, other) = (collect(long), collect(other));
    let stream = collect_rest(stream, started);
    assert!(matches!(stream.failed, Some(EngineError::Backend(_))), "{stream:?}");
    assert_eq!(stream.ids, (5..=10).map(|k| A + k).collect::<Vec<_>>(), "the stream's tokens before the fault");
    assert_eq!((long.finish, long.ids), (Some(FinishReason::Length), vec![200, 201, 202]));
    assert_eq!((other.finish, other.ids), (Some(FinishReason::Length), (21..=50).map(|k| A + k).collect::<Vec<_>>()));
    let s = h.stats();
    assert_eq!(s.requests_failed, 1, "{s:?}");
    assert!(s.mixed_steps > 0, "{s:?}");
    assert!(eventually(Duration::from_secs(2), || probe.lock().expect("probe").live == 0));
}
