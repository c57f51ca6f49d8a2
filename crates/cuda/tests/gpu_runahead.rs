//! Pipelined decode on the GPU (`CudaBackend::submit_decode` /
//! `collect_decode`): steps run ahead of the host, two in flight, each
//! sequence fed its previous draw on the device (`Feed::Previous`), give
//! exactly the tokens of synchronous `decode_sample` step by step; and a
//! refused step starts nothing.
//!
//! The reference runs in the same backend on forks taken right after the
//! prefill (identical state), with the same batch compositions, so both
//! sides run the same decode graphs on the same inputs: a batch's decode
//! is bit for bit its sequences' decode alone (gpu_model.rs), and
//! `sample_rows` is a function of (logits, seed, step, counts). Tokens and
//! top-logprob ids must therefore be equal exactly; logprobs are compared
//! within 1e-5 (the same arithmetic; a few f32 ulps of room in case a
//! reduction inside the sampler is ordered differently between runs).
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1` there); without a GPU each test
//! prints "skipped: no CUDA device" and returns.

mod common;

use std::collections::VecDeque;

use common::{check, finish, gpu, synth_checkpoint};
use lily_core::weights::Weights;
use lily_cuda::dims::{GDN_CHUNK, KV_BLOCK};
use lily_cuda::sampling::SAMPLE_TOP_MAX;
use lily_cuda::{CudaBackend, Options};
use lily_model::sample::sample_host;
use lily_model::{Backend, Feed, InFlight, LogitsWanted, ModelError, SampleParams, SampleState, Sampled, SeqId, MAX_IN_FLIGHT};

fn fixture() -> Weights {
    Weights::load(&common::fixtures_dir().join("mlx-q4")).expect("fixture")
}

fn opts(kv_tokens: usize) -> Options {
    let mut o = Options::for_context(256);
    o.max_sequences = 8;
    o.kv_tokens = kv_tokens;
    o.prefill_chunk = 128;
    o
}

fn prompt(len: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + 5 + salt * 101) % vocab as u32).collect()
}

/// Greedy under a vocab limit with top logprobs; seeded sampling with every
/// penalty and the most top logprobs; seeded sampling with min-p and top-k,
/// no penalties.
fn params(vocab: usize) -> Vec<SampleParams> {
    vec![
        SampleParams { top_logprobs: 5, vocab_limit: vocab as u32 - 3, ..SampleParams::greedy() },
        SampleParams {
            temperature: 0.9,
            top_k: 30,
            top_p: 0.9,
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.2,
            seed: 42,
            top_logprobs: SAMPLE_TOP_MAX as u32,
            ..Default::default()
        },
        SampleParams { temperature: 1.1, top_k: 50, min_p: 0.02, seed: 7, top_logprobs: 3, ..Default::default() },
    ]
}

/// Sequences prefilled with their prompts, each one's first token drawn on
/// the host from the prefill logits (as the engine does), and a fork of
/// each with a copy of its state: the reference side.
struct Side {
    seqs: Vec<SeqId>,
    states: Vec<SampleState>,
    firsts: Vec<u32>,
}

fn start(be: &mut CudaBackend, prompts: &[Vec<u32>], params: &[SampleParams]) -> (Side, Side) {
    let (mut a, mut b) = (Side { seqs: vec![], states: vec![], firsts: vec![] }, Side { seqs: vec![], states: vec![], firsts: vec![] });
    for (p, &sp) in prompts.iter().zip(params) {
        let s = be.alloc().expect("alloc");
        let logits = be.prefill(s, p, LogitsWanted::Last).expect("prefill");
        let twin = be.fork(s).expect("fork");
        let mut st = SampleState::new(sp, p);
        let first = sample_host(&logits[0], &mut st).token;
        a.seqs.push(s);
        b.seqs.push(twin);
        a.states.push(st.clone());
        b.states.push(st);
        a.firsts.push(first);
        b.firsts.push(first);
    }
    (a, b)
}

type Draws = Vec<Vec<Sampled>>;

/// Collects the oldest step in flight into `draws`.
fn collect_one(be: &mut CudaBackend, side: &mut Side, pending: &mut VecDeque<(InFlight, Vec<usize>)>, draws: &mut Draws) {
    let (step, members) = pending.pop_front().expect("a step in flight");
    let mut st: Vec<SampleState> = members.iter().map(|&i| side.states[i].clone()).collect();
    let got = be.collect_decode(step, &mut st).expect("collect");
    assert_eq!(got.len(), members.len(), "one draw per member");
    for ((&i, s), d) in members.iter().zip(st).zip(got) {
        side.states[i] = s;
        draws[i].push(d);
    }
}

/// Runs `schedule` (per step, indices into the side's sequences in batch
/// order) pipelined as the engine does: each step is submitted, then the
/// oldest is collected once `MAX_IN_FLIGHT` are in flight; a sequence is
/// fed `Token(first)` on its first step and `Previous` after. `between` runs
/// after every submit, while steps are in flight.
fn run_ahead(be: &mut CudaBackend, side: &mut Side, schedule: &[Vec<usize>], between: &mut dyn FnMut(&mut CudaBackend)) -> Draws {
    let mut draws: Draws = vec![Vec::new(); side.seqs.len()];
    let mut started = vec![false; side.seqs.len()];
    let mut pending = VecDeque::new();
    for members in schedule {
        let batch: Vec<(SeqId, Feed)> =
            members.iter().map(|&i| (side.seqs[i], if started[i] { Feed::Previous } else { Feed::Token(side.firsts[i]) })).collect();
        let mut st: Vec<SampleState> = members.iter().map(|&i| side.states[i].clone()).collect();
        let step = be.submit_decode(&batch, &mut st).expect("submit");
        check(
            matches!(step, InFlight::Device { len, .. } if len == members.len()),
            format!("a step of {} was not left in flight on the device: {step:?}", members.len()),
        );
        for (&i, s) in members.iter().zip(st) {
            side.states[i] = s;
            started[i] = true;
        }
        pending.push_back((step, members.clone()));
        check(be.steps_in_flight() == pending.len(), format!("{} steps in flight, the backend counts {}", pending.len(), be.steps_in_flight()));
        between(be);
        if pending.len() == MAX_IN_FLIGHT {
            collect_one(be, side, &mut pending, &mut draws);
        }
    }
    while !pending.is_empty() {
        collect_one(be, side, &mut pending, &mut draws);
    }
    draws
}

/// The same schedule through synchronous `decode_sample`, each sequence
/// fed the token its previous draw chose.
fn step_by_step(be: &mut CudaBackend, side: &mut Side, schedule: &[Vec<usize>]) -> Draws {
    let mut draws: Draws = vec![Vec::new(); side.seqs.len()];
    let mut next = side.firsts.clone();
    for members in schedule {
        let batch: Vec<(SeqId, u32)> = members.iter().map(|&i| (side.seqs[i], next[i])).collect();
        let mut st: Vec<SampleState> = members.iter().map(|&i| side.states[i].clone()).collect();
        let got = be.decode_sample(&batch, &mut st).expect("decode_sample");
        for ((&i, s), d) in members.iter().zip(st).zip(got) {
            side.states[i] = s;
            next[i] = d.token;
            draws[i].push(d);
        }
    }
    draws
}

/// Draws, final states and lengths of the two sides are the same.
fn compare(label: &str, be: &CudaBackend, ahead: (&Side, &Draws), sync: (&Side, &Draws)) {
    for i in 0..ahead.0.seqs.len() {
        let (got, want) = (&ahead.1[i], &sync.1[i]);
        let toks = |d: &Draws| d[i].iter().map(|s| s.token).collect::<Vec<_>>();
        eprintln!("{label} seq {i}: {:?}", toks(ahead.1));
        check(toks(ahead.1) == toks(sync.1), format!("{label} seq {i}: run ahead {:?}, step by step {:?}", toks(ahead.1), toks(sync.1)));
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            check((g.logprob - w.logprob).abs() <= 1e-5, format!("{label} seq {i} draw {k}: logprob {} vs {}", g.logprob, w.logprob));
            let ids = |s: &Sampled| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
            check(ids(g) == ids(w), format!("{label} seq {i} draw {k}: top ids {:?} vs {:?}", ids(g), ids(w)));
            for (a, b) in g.top.iter().zip(&w.top) {
                check((a.1 - b.1).abs() <= 1e-5, format!("{label} seq {i} draw {k}: top logprob {} vs {}", a.1, b.1));
            }
            let asked = ahead.0.states[i].params.top_count();
            check(g.top.len() == asked, format!("{label} seq {i} draw {k}: {} top logprobs, {asked} asked", g.top.len()));
        }
        let (sa, sb) = (&ahead.0.states[i], &sync.0.states[i]);
        check(
            sa.step == sb.step && sa.step as usize == got.len() + 1,
            format!("{label} seq {i}: state step {} vs {} after {} draws", sa.step, sb.step, got.len()),
        );
        check(sa.last_draw() == got.last().map(|d| d.token), format!("{label} seq {i}: last draw {:?}", sa.last_draw()));
        for d in got {
            check(
                sa.count_of(d.token) == sb.count_of(d.token),
                format!("{label} seq {i}: count of {} {} vs {}", d.token, sa.count_of(d.token), sb.count_of(d.token)),
            );
        }
        let (la, lb) = (be.seq_len(ahead.0.seqs[i]).expect("len"), be.seq_len(sync.0.seqs[i]).expect("len"));
        check(la == lb, format!("{label} seq {i}: length {la} run ahead, {lb} step by step"));
    }
}

fn equal_tokens_case(label: &str, be: &mut CudaBackend) {
    let vocab = be.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(12 + 7 * i, vocab, i as u32)).collect();
    let (mut ahead, mut sync) = start(be, &prompts, &params(vocab));
    let schedule = vec![vec![0, 1, 2]; 16];
    // Timed by parts (split_steps): the events change no draw.
    be.split_steps(true);
    let got = run_ahead(be, &mut ahead, &schedule, &mut |_| {});
    let split = be.take_step_split();
    be.split_steps(false);
    check(be.steps_in_flight() == 0, "steps left in flight");
    check(split.len() == schedule.len(), format!("{label}: {} steps split, {} run", split.len(), schedule.len()));
    let sane = split.iter().all(|p| p.iter().all(|&us| us.is_finite() && us >= 0.0) && p[2] > 0.0);
    check(sane, format!("{label}: step parts {split:?}"));
    let want = step_by_step(be, &mut sync, &schedule);
    compare(label, be, (&ahead, &got), (&sync, &want));
    for s in ahead.seqs.iter().chain(&sync.seqs) {
        be.free(*s);
    }
}

/// Two steps in flight, every sequence fed `Previous`: greedy (top
/// logprobs, vocab limit) and seeded sampling (penalties, top logprobs;
/// min-p and top-k) give the tokens of `decode_sample` step by step, on
/// the tiny fixture and on a 4-layer model of the real width (the real
/// 248,320-entry vocabulary), with every step's parts timed
/// (`split_steps`: one split a step, the graph's time positive). The run
/// ahead is timed, so it launches the feed, the step and the sampler
/// separately; the step-by-step reference runs each step as one served
/// graph, on the tiny fixture one captured ahead by `prepare_decode`.
#[test]
fn two_steps_in_flight_equal_decode_sample_step_by_step() {
    let Some(gpu) = gpu("two_steps_in_flight_equal_decode_sample_step_by_step") else { return };
    let w = fixture();
    let mut be = CudaBackend::from_weights(&gpu, &w, opts(8 * 256), &mut |_, _| {}).expect("cuda backend");
    let prepared = be.prepare_decode(6).expect("prepare_decode");
    check(prepared == 6, format!("prepared {prepared} batch sizes, asked for 6"));
    equal_tokens_case("tiny fixture", &mut be);
    drop(be);
    let (_dir, w) = synth_checkpoint(lily_synth::Preset::Full, 4, 11);
    let mut be = CudaBackend::from_weights(&gpu, &w, opts(8 * 256), &mut |_, _| {}).expect("cuda backend (full width)");
    equal_tokens_case("full width, 4 layers", &mut be);
    finish();
}

/// Sequences join a batch while the step before is in flight, leave it,
/// change places in it, and rejoin fed `Previous` after sitting out steps
/// (the draw then comes from a step already collected); meanwhile another
/// sequence is decoded synchronously with `decode_sample` while steps are
/// in flight. Every sequence's tokens equal the step-by-step reference.
#[test]
fn sequences_join_and_leave_between_steps_in_flight() {
    let Some(gpu) = gpu("sequences_join_and_leave_between_steps_in_flight") else { return };
    let w = fixture();
    let mut be = CudaBackend::from_weights(&gpu, &w, opts(8 * 256), &mut |_, _| {}).expect("cuda backend");
    let vocab = be.config().vocab_size;
    let mut ps = params(vocab);
    ps.push(SampleParams { temperature: 0.8, presence_penalty: 0.7, seed: 99, ..Default::default() });
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(9 + 11 * i, vocab, 10 + i as u32)).collect();
    let (mut ahead, mut sync) = start(&mut be, &prompts, &ps);
    let schedule: Vec<Vec<usize>> =
        vec![vec![0], vec![0, 1], vec![1, 0], vec![1, 2], vec![0, 2, 1], vec![2], vec![2, 1], vec![0], vec![0, 1, 2], vec![2, 0, 1]];
    // Sequence 3 is decoded alone, synchronously, after every submit.
    let (d_seq, mut d_state, mut d_next) = (ahead.seqs[3], ahead.states[3].clone(), ahead.firsts[3]);
    let mut d_draws = Vec::new();
    let got = run_ahead(&mut be, &mut ahead, &schedule, &mut |be| {
        let mut st = [d_state.clone()];
        let d = be.decode_sample(&[(d_seq, d_next)], &mut st).expect("decode_sample while steps are in flight");
        [d_state] = st;
        d_next = d[0].token;
        d_draws.extend(d);
    });
    ahead.states[3] = d_state;
    let mut got = got;
    got[3] = d_draws;
    let mut want = step_by_step(&mut be, &mut sync, &schedule);
    want[3] = step_by_step(&mut be, &mut sync, &vec![vec![3]; schedule.len()]).swap_remove(3);
    compare("join and leave", &be, (&ahead, &got), (&sync, &want));
    finish();
}

/// Refused steps start nothing: an unknown sequence, a state count that
/// does not match, `Previous` for a sequence whose last input was a
/// prefill, too many top logprobs, a sequence twice, a third step in flight
/// and a full KV pool (with and without a step in flight) leave every
/// length, state, step in flight and KV block as it was; the steps that
/// follow (fed `Previous` across the refusals) equal a fork decoded
/// synchronously, and a step collected out of order is refused.
#[test]
fn refused_steps_start_nothing() {
    let Some(gpu) = gpu("refused_steps_start_nothing") else { return };
    let w = fixture();
    // Three KV blocks: `a` fills one exactly, `b` and its fork hold one each.
    let mut be = CudaBackend::from_weights(&gpu, &w, opts(3 * KV_BLOCK), &mut |_, _| {}).expect("cuda backend");
    let vocab = be.config().vocab_size;
    let ps = params(vocab);
    let (a, b) = (be.alloc().expect("alloc"), be.alloc().expect("alloc"));
    let (pa, pb) = (prompt(KV_BLOCK, vocab, 1), prompt(10, vocab, 2));
    let la = be.prefill(a, &pa, LogitsWanted::Last).expect("prefill a");
    let lb = be.prefill(b, &pb, LogitsWanted::Last).expect("prefill b");
    let twin = be.fork(b).expect("fork b");
    let mut sa = SampleState::new(ps[0], &pa);
    let fa = sample_host(&la[0], &mut sa).token;
    let mut sb = SampleState::new(ps[1], &pb);
    let fb = sample_host(&lb[0], &mut sb).token;
    let mut s_twin = sb.clone();
    let ghost = be.alloc().expect("alloc");
    be.free(ghost);
    let free0 = be.kv_room().expect("a fixed pool").free_tokens;
    check(free0 == 0, format!("test setup: {free0} KV tokens free, expected a full pool"));

    let unchanged = |be: &CudaBackend, what: &str, in_flight: usize, lens: (usize, usize), steps: (u64, u64), sa: &SampleState, sb: &SampleState| {
        check(be.steps_in_flight() == in_flight, format!("{what}: {} steps in flight, expected {in_flight}", be.steps_in_flight()));
        let got = (be.seq_len(a).expect("len"), be.seq_len(b).expect("len"));
        check(got == lens, format!("{what}: lengths {got:?}, expected {lens:?}"));
        check((sa.step, sb.step) == steps, format!("{what}: state steps {:?}, expected {steps:?}", (sa.step, sb.step)));
        check(be.kv_room().map(|r| r.free_tokens) == Some(free0), format!("{what}: the free KV changed"));
    };
    let lens0 = (KV_BLOCK, 10);
    let steps0 = (sa.step, sb.step);
    let mut two = [sb.clone(), sa.clone()];

    let r = be.submit_decode(&[(b, Feed::Token(fb)), (ghost, Feed::Token(1))], &mut two);
    check(matches!(r, Err(ModelError::UnknownSequence(s)) if s == ghost), format!("an unknown sequence: {r:?}"));
    unchanged(&be, "unknown sequence", 0, lens0, steps0, &two[1], &two[0]);
    let r = be.submit_decode(&[(b, Feed::Token(fb))], &mut two);
    check(matches!(r, Err(ModelError::Invalid(_))), format!("two states for one sequence: {r:?}"));
    let r = be.submit_decode(&[(b, Feed::Previous)], std::slice::from_mut(&mut sb));
    check(matches!(r, Err(ModelError::Invalid(_))), format!("Previous after a prefill: {r:?}"));
    let mut greedy = [SampleState::new(SampleParams { top_logprobs: SAMPLE_TOP_MAX as u32 + 1, ..SampleParams::greedy() }, &pb)];
    let r = be.submit_decode(&[(b, Feed::Token(fb))], &mut greedy);
    check(matches!(r, Err(ModelError::Invalid(_))), format!("top_logprobs {}: {r:?}", SAMPLE_TOP_MAX + 1));
    let mut twice = [sb.clone(), sb.clone()];
    let r = be.submit_decode(&[(b, Feed::Token(fb)), (b, Feed::Token(fb))], &mut twice);
    check(matches!(r, Err(ModelError::Invalid(_))), format!("a sequence twice: {r:?}"));
    let r = be.submit_decode(&[(b, Feed::Token(fb)), (a, Feed::Token(fa))], &mut two);
    check(matches!(r, Err(ModelError::Capacity(_))), format!("a full KV pool: {r:?}"));
    unchanged(&be, "full pool", 0, lens0, steps0, &two[1], &two[0]);
    check(greedy[0].step == 0 && twice[0].step == steps0.1 && sb.step == steps0.1, "a refused step advanced a state");

    // b runs ahead; a refused batch meanwhile leaves the step in flight.
    let mut pending = VecDeque::new();
    pending.push_back(be.submit_decode(&[(b, Feed::Token(fb))], std::slice::from_mut(&mut sb)).expect("b alone"));
    let mut two = [sb.clone(), sa.clone()];
    let r = be.submit_decode(&[(b, Feed::Previous), (a, Feed::Token(fa))], &mut two);
    check(matches!(r, Err(ModelError::Capacity(_))), format!("a full KV pool with a step in flight: {r:?}"));
    unchanged(&be, "full pool, one step in flight", 1, (KV_BLOCK, 11), (steps0.0, steps0.1 + 1), &two[1], &two[0]);
    pending.push_back(be.submit_decode(&[(b, Feed::Previous)], std::slice::from_mut(&mut sb)).expect("b fed Previous after a refusal"));
    let r = be.submit_decode(&[(twin, Feed::Token(fb))], std::slice::from_mut(&mut s_twin.clone()));
    check(matches!(r, Err(ModelError::Invalid(_))), format!("a third step in flight: {r:?}"));
    check(be.seq_len(twin).expect("len") == 10, "a refused third step moved its sequence");
    let bogus = InFlight::Device { ticket: u64::MAX, len: 1 };
    check(be.collect_decode(bogus, std::slice::from_mut(&mut sb.clone())).is_err(), "a step that was never submitted was collected");
    let mut got = Vec::new();
    while let Some(step) = pending.pop_front() {
        got.extend(be.collect_decode(step, std::slice::from_mut(&mut sb)).expect("collect"));
    }
    let mut want = Vec::new();
    let mut next = fb;
    for _ in 0..2 {
        let d = be.decode_sample(&[(twin, next)], std::slice::from_mut(&mut s_twin)).expect("twin");
        next = d[0].token;
        want.extend(d);
    }
    let toks = |v: &[Sampled]| v.iter().map(|s| s.token).collect::<Vec<_>>();
    check(toks(&got) == toks(&want), format!("b across the refusals {:?}, its fork step by step {:?}", toks(&got), toks(&want)));
    check(sb.step == s_twin.step && sb.last_draw() == s_twin.last_draw(), "b's state and its fork's differ");
    check(be.seq_len(b).expect("len") == 12, "b holds its two steps");

    // Room for a once the fork is gone: its step runs.
    be.free(twin);
    let d = be.decode_sample(&[(a, fa)], std::slice::from_mut(&mut sa)).expect("a with room");
    check(d.len() == 1 && be.seq_len(a).expect("len") == KV_BLOCK + 1, "a decoded once room was made");
    finish();
}

/// One `prefill_capture_sampling` call over `prompts` (part 3 captures a
/// snapshot at `GDN_CHUNK`), drawing where `params[i]` is Some, against
/// the same `prefill_capture` on twin sequences with each first token
/// drawn on the host from the logits (`sample_host`, as the engine does
/// when a backend declines). Then both sides decode a few steps with
/// `decode_sample` (the drawn side's penalty tables made on the device by
/// the prefill's draw, the other's uploaded from the host state).
fn first_draws_case(label: &str, be: &mut CudaBackend, params: &[Option<SampleParams>]) {
    let vocab = be.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..params.len()).map(|i| prompt(if i == 3 { GDN_CHUNK + 6 } else { 9 + 3 * i }, vocab, 20 + i as u32)).collect();
    let capture = |i: usize| (i == 3).then_some(GDN_CHUNK);
    let fresh = |be: &mut CudaBackend| -> Vec<SeqId> { prompts.iter().map(|_| be.alloc().expect("alloc")).collect() };
    let (seqs_a, seqs_b) = (fresh(be), fresh(be));
    let init = |i: usize, sp: SampleParams| SampleState::new(sp, &prompts[i]);
    let default_params = SampleParams::greedy();

    let parts_a: Vec<lily_model::CapturePart> = seqs_a.iter().enumerate().map(|(i, &s)| (s, &prompts[i][..], capture(i))).collect();
    let mut lent: Vec<Option<SampleState>> = params.iter().enumerate().map(|(i, p)| p.map(|sp| init(i, sp))).collect();
    let ((rows_a, snaps_a), drawn) = be.prefill_capture_sampling(&parts_a, &mut lent).expect("prefill_capture_sampling");
    let parts_b: Vec<lily_model::CapturePart> = seqs_b.iter().enumerate().map(|(i, &s)| (s, &prompts[i][..], capture(i))).collect();
    let ((rows_b, snaps_b), _) = be.prefill_capture_sampling(&parts_b, &mut vec![None; params.len()]).expect("prefill_capture (reference)");
    check(snaps_a.iter().flatten().count() == 1 && snaps_b.iter().flatten().count() == 1, format!("{label}: snapshots {snaps_a:?} / {snaps_b:?}"));

    let (mut a, mut b) = (Side { seqs: seqs_a.clone(), states: vec![], firsts: vec![] }, Side { seqs: seqs_b.clone(), states: vec![], firsts: vec![] });
    for (i, p) in params.iter().enumerate() {
        let device = p.is_some_and(|sp| sp.top_logprobs as usize <= SAMPLE_TOP_MAX);
        let mut host = init(i, p.unwrap_or(default_params));
        let want = sample_host(&rows_b[i], &mut host);
        check(rows_b[i].len() == vocab, format!("{label} part {i}: reference logits of {} entries", rows_b[i].len()));
        let st = lent[i].take().unwrap_or_else(|| init(i, default_params));
        let got = match (&drawn[i], device) {
            (Some(d), true) => {
                check(rows_a[i].is_empty(), format!("{label} part {i}: drawn, yet {} logits came back", rows_a[i].len()));
                d.clone()
            }
            (None, false) => {
                // Declined (or not asked): the logits equal the reference's
                // bit for bit, the state is untouched, and the host draws.
                check(rows_a[i] == rows_b[i], format!("{label} part {i}: declined, and its logits differ from the reference pass"));
                check(st.step == 0, format!("{label} part {i}: declined, yet its state advanced to step {}", st.step));
                let mut st2 = st.clone();
                let d = sample_host(&rows_a[i], &mut st2);
                a.states.push(st2);
                a.firsts.push(d.token);
                b.states.push(host);
                b.firsts.push(want.token);
                continue;
            }
            (d, _) => {
                check(false, format!("{label} part {i}: device draw {d:?}, expected one: {device}"));
                continue;
            }
        };
        check(got.token == want.token, format!("{label} part {i}: device draw {} vs host {}", got.token, want.token));
        check((got.logprob - want.logprob).abs() <= 1e-5, format!("{label} part {i}: logprob {} vs {}", got.logprob, want.logprob));
        let ids = |s: &Sampled| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
        check(ids(&got) == ids(&want), format!("{label} part {i}: top ids {:?} vs {:?}", ids(&got), ids(&want)));
        for (x, y) in got.top.iter().zip(&want.top) {
            check((x.1 - y.1).abs() <= 1e-5, format!("{label} part {i}: top logprob {} vs {}", x.1, y.1));
        }
        check(
            st.step == host.step && st.last_draw() == Some(want.token) && st.count_of(want.token) == host.count_of(want.token),
            format!("{label} part {i}: state after the device draw: step {} last {:?}, host step {}", st.step, st.last_draw(), host.step),
        );
        a.states.push(st);
        a.firsts.push(got.token);
        b.states.push(host);
        b.firsts.push(want.token);
    }
    // Decode steps refuse more than SAMPLE_TOP_MAX top logprobs.
    let decoded: Vec<usize> = (0..params.len()).filter(|&i| a.states[i].params.top_logprobs as usize <= SAMPLE_TOP_MAX).collect();
    let schedule = vec![decoded.clone(); 4];
    let got = step_by_step(be, &mut a, &schedule);
    let want = step_by_step(be, &mut b, &schedule);
    for &i in &decoded {
        let toks = |d: &Draws| d[i].iter().map(|s| s.token).collect::<Vec<_>>();
        check(toks(&got) == toks(&want), format!("{label} part {i}: decode after the first draw {:?} vs {:?}", toks(&got), toks(&want)));
    }
    for s in seqs_a.iter().chain(&seqs_b).chain(snaps_a.iter().flatten()).chain(snaps_b.iter().flatten()) {
        be.free(*s);
    }
}

/// A new prompt's first token drawn by the device sampler inside the
/// prefill call (`prefill_capture_sampling`: no logits read back, no host
/// draw) equals the host's draw from that prefill's logits: token, logprob,
/// top logprobs and the state after it (step, counts, last draw), and the
/// decode steps that follow. Greedy, penalised and top-k / min-p rows, a
/// part the engine does not ask to draw, and one asking more than
/// `SAMPLE_TOP_MAX` top logprobs (declined: its logits come back); one part
/// takes a snapshot inside the pass; the decode batch of 2 splits the last
/// rows into groups, one holding a drawn and a declined row. On the tiny
/// fixture and on a 4-layer model of the real width.
#[test]
fn first_tokens_drawn_in_the_prefill_equal_host_draws_from_its_logits() {
    let Some(gpu) = gpu("first_tokens_drawn_in_the_prefill_equal_host_draws_from_its_logits") else { return };
    let small_batch = || Options { max_batch: 2, max_sequences: 16, ..opts(16 * 256) };
    let mk = |vocab: usize| {
        let p = params(vocab);
        vec![Some(p[1]), None, Some(p[0]), Some(p[2]), Some(SampleParams { top_logprobs: SAMPLE_TOP_MAX as u32 + 1, ..p[2] })]
    };
    let w = fixture();
    let mut be = CudaBackend::from_weights(&gpu, &w, small_batch(), &mut |_, _| {}).expect("cuda backend");
    let vocab = be.config().vocab_size;
    first_draws_case("tiny fixture", &mut be, &mk(vocab));
    drop(be);
    let (_dir, w) = synth_checkpoint(lily_synth::Preset::Full, 4, 12);
    let mut be = CudaBackend::from_weights(&gpu, &w, small_batch(), &mut |_, _| {}).expect("cuda backend (full width)");
    let vocab = be.config().vocab_size;
    first_draws_case("full width, 4 layers", &mut be, &mk(vocab));
    finish();
}
