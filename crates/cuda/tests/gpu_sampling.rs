//! The device sampler (`sample_rows` in kernels/sampling.cu, and
//! `CudaBackend::decode_sample`) against the host math of
//! `lily_model::sample` (`Distribution`), on random logits at the real
//! vocabulary (248,320) and at small ones.
//!
//! Runs on the H200 (`LILY_REQUIRE_GPU=1` there); without a GPU each test
//! prints "skipped: no CUDA device" and returns.
//!
//! What is exact and what is statistical: greedy tokens equal the host's
//! first argmax; every sampled token lies in the host's allowed set (min-p,
//! top-k, top-p); for the same uniform (Philox of seed and step, the same
//! function on both sides) the device picks the host's token except where
//! f32 `expf` against Rust's `exp` (1 ulp) or f64 summation order moves an
//! inverse-CDF boundary, so at most 1% of draws may differ (none expected);
//! histograms of 20,000 draws pass a chi-square bound of df + 6·sqrt(2·df)
//! and a max |frequency - probability| of 0.012 (sigma <= 0.0036). Top
//! logprobs: the ids (and their order, ties by id) equal the host's
//! exactly; their logprobs within 1e-4 (the log-sum-exp differs only by
//! f32 `expf` and f64 summation order, ~1e-6 measured on the host side).
//! `vocab_limit`: no id at or beyond it is ever drawn or reported.
//! The fast path (greedy and small top_k rows) equals the one-block kernel
//! on random rows (`fast_path_equals_the_one_block_kernel`).

mod common;

use std::sync::Arc;

use common::{check, download, finish, gpu, upload, zeros, Rng};
use lily_core::config::production;
use lily_core::weights::Weights;
use lily_cuda::device::{DeviceBuffer, Gpu};
use lily_cuda::dims::Dims;
use lily_cuda::kernels::Kernels;
use lily_cuda::sampling::{self, SampleOut, SamplePath, SampleRow, SAMPLE_FAST_TOP_K, SAMPLE_TOP_MAX, SAMPLE_UNDECIDED};
use lily_cuda::{CudaBackend, Options};
use lily_model::sample::{philox_uniform, Distribution};
use lily_model::{Backend, LogitsWanted, SampleParams, SampleState};

const BIG: usize = 248_320;

fn kernels(gpu: &Arc<Gpu>) -> Kernels {
    // The sampler takes the vocabulary at run time; any shape's build has it.
    Kernels::load(gpu, &Dims::from_config(&production()).expect("dims")).expect("kernels")
}

/// Logits with a peaked head: uniform(-4, 4) plus `hot` tokens in (4, 10).
fn logits(rng: &mut Rng, vocab: usize, hot: usize) -> Vec<f32> {
    let mut l = rng.vec(vocab, -4.0, 4.0);
    for _ in 0..hot {
        let i = rng.below(vocab);
        l[i] = rng.uniform(4.0, 10.0);
    }
    l
}

/// What one `sample_rows` launch wrote: tokens, logprobs, and the top
/// arrays [n][SAMPLE_TOP_MAX] (slots it did not write keep u32::MAX - 1 and
/// NaN).
struct Out {
    tok: Vec<u32>,
    lp: Vec<f32>,
    top_ids: Vec<u32>,
    top_lps: Vec<f32>,
}

/// Marks a top slot the kernel did not write.
const UNTOUCHED: u32 = u32::MAX - 1;

/// Runs `sample_rows` on `rows` over logits at `logits` (row stride
/// `stride` floats, 0 = shared) with the top outputs attached.
fn run_out(gpu: &Arc<Gpu>, k: &Kernels, logits: &DeviceBuffer, stride: usize, rows: &[SampleRow], vocab: usize) -> Out {
    let n = rows.len();
    let rb = upload(gpu, rows);
    let tok = upload(gpu, &vec![u32::MAX; n]);
    let lp = upload(gpu, &vec![f32::NAN; n]);
    let top_ids = upload(gpu, &vec![UNTOUCHED; n * SAMPLE_TOP_MAX]);
    let top_lps = upload(gpu, &vec![f32::NAN; n * SAMPLE_TOP_MAX]);
    let out = SampleOut { tokens: tok.ptr(), logprobs: lp.ptr(), top_ids: top_ids.ptr(), top_logprobs: top_lps.ptr() };
    sampling::sample_rows_strided(gpu, k, logits.ptr(), stride, rb.ptr(), &out, n, vocab).expect("launch");
    Out {
        tok: download(gpu, tok.ptr(), n),
        lp: download(gpu, lp.ptr(), n),
        top_ids: download(gpu, top_ids.ptr(), n * SAMPLE_TOP_MAX),
        top_lps: download(gpu, top_lps.ptr(), n * SAMPLE_TOP_MAX),
    }
}

/// `run_out` with no top outputs (the kernel must not need them);
/// returns (tokens, logprobs).
fn run(gpu: &Arc<Gpu>, k: &Kernels, logits: &DeviceBuffer, stride: usize, rows: &[SampleRow], vocab: usize) -> (Vec<u32>, Vec<f32>) {
    let n = rows.len();
    let rb = upload(gpu, rows);
    let tok = upload(gpu, &vec![u32::MAX; n]);
    let lp = upload(gpu, &vec![f32::NAN; n]);
    let out = SampleOut { tokens: tok.ptr(), logprobs: lp.ptr(), top_ids: 0, top_logprobs: 0 };
    sampling::sample_rows_strided(gpu, k, logits.ptr(), stride, rb.ptr(), &out, n, vocab).expect("launch");
    (download(gpu, tok.ptr(), n), download(gpu, lp.ptr(), n))
}

/// Row `r`'s top report against the host's `want` (ids exact, in order;
/// logprobs within 1e-4); slots past the ask untouched; a row asking more
/// than its vocabulary holds gets u32::MAX / -inf in the extra slots.
fn check_top(label: &str, out: &Out, r: usize, asked: usize, want: &[(u32, f32)]) {
    let ids = &out.top_ids[r * SAMPLE_TOP_MAX..(r + 1) * SAMPLE_TOP_MAX];
    let lps = &out.top_lps[r * SAMPLE_TOP_MAX..(r + 1) * SAMPLE_TOP_MAX];
    let got: Vec<u32> = ids[..want.len()].to_vec();
    let want_ids: Vec<u32> = want.iter().map(|w| w.0).collect();
    check(got == want_ids, format!("{label} row {r}: top ids {got:?}, host {want_ids:?}"));
    for (j, &(_, wl)) in want.iter().enumerate() {
        let ok = if wl == f32::NEG_INFINITY { lps[j] == wl } else { (lps[j] - wl).abs() < 1e-4 };
        check(ok, format!("{label} row {r} slot {j}: top logprob {} host {wl}", lps[j]));
    }
    for j in want.len()..asked {
        check(
            ids[j] == u32::MAX && lps[j] == f32::NEG_INFINITY,
            format!("{label} row {r} slot {j}: ({}, {}) beyond the row, want (u32::MAX, -inf)", ids[j], lps[j]),
        );
    }
    for j in asked..SAMPLE_TOP_MAX {
        check(ids[j] == UNTOUCHED && lps[j].is_nan(), format!("{label} row {r} slot {j}: written, but only {asked} were asked"));
    }
}

fn allowed(d: &Distribution, vocab: usize) -> Vec<bool> {
    let mut a = vec![false; vocab];
    match &d.candidates {
        Some(c) if !c.is_empty() => c.iter().for_each(|x| a[x.0 as usize] = true),
        _ => a[d.argmax as usize] = true,
    }
    a
}

#[test]
fn greedy_is_the_first_argmax_with_the_host_logprob() {
    let Some(gpu) = gpu("greedy_is_the_first_argmax_with_the_host_logprob") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(1);
    for vocab in [BIG, 1000] {
        let n = 6;
        let mut host = Vec::with_capacity(n * vocab);
        let mut states = Vec::new();
        for r in 0..n {
            let mut l = logits(&mut rng, vocab, 20);
            let top = lily_model::argmax(&l) as usize;
            let mut params = SampleParams::greedy();
            let mut prompt = Vec::new();
            if r == 2 {
                // A tie with a lower id: the lower id wins.
                l[top / 2] = l[top];
            }
            if r >= 4 {
                // Penalties that move the argmax away from the raw top.
                params.repetition_penalty = 1.5;
                params.presence_penalty = 2.0;
                params.frequency_penalty = 1.0;
                prompt.push(top as u32);
            }
            let mut st = SampleState::new(params, &prompt);
            if r == 5 {
                st.accept(top as u32);
                st.accept(top as u32);
            }
            host.extend_from_slice(&l);
            states.push(st);
        }
        let lb = upload(&gpu, &host);
        let tables: Vec<DeviceBuffer> = states.iter().map(|s| upload(&gpu, &s.dense_counts(vocab))).collect();
        let rows: Vec<SampleRow> =
            states.iter().zip(&tables).map(|(s, t)| SampleRow::new(&s.params, 0, if s.params.has_penalties() { t.ptr() } else { 0 })).collect();
        let (tok, lp) = run(&gpu, &k, &lb, vocab, &rows, vocab);
        for r in 0..n {
            let d = Distribution::new(&host[r * vocab..(r + 1) * vocab], &states[r]);
            let want_lp = d.penalised[d.argmax as usize] as f64 - d.lse;
            check(tok[r] == d.argmax, format!("vocab {vocab} row {r}: token {} want argmax {}", tok[r], d.argmax));
            check((lp[r] as f64 - want_lp).abs() < 2e-4, format!("vocab {vocab} row {r}: logprob {} want {want_lp}", lp[r]));
            if states[r].params.has_penalties() {
                let after: Vec<u32> = download(&gpu, tables[r].ptr(), vocab);
                let before = states[r].dense_counts(vocab);
                let changed: Vec<usize> = (0..vocab).filter(|&i| after[i] != before[i]).collect();
                check(
                    changed == vec![tok[r] as usize] && after[tok[r] as usize] == before[tok[r] as usize] + 1,
                    format!("vocab {vocab} row {r}: count table changed at {changed:?}, want only {}", tok[r]),
                );
            }
        }
    }
    finish();
}

#[test]
fn sampled_tokens_stay_in_the_host_allowed_set() {
    let Some(gpu) = gpu("sampled_tokens_stay_in_the_host_allowed_set") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(2);
    let configs: Vec<(&str, SampleParams)> = vec![
        ("top_k 40", SampleParams { top_k: 40, ..Default::default() }),
        ("top_p 0.9, T 0.8", SampleParams { temperature: 0.8, top_p: 0.9, ..Default::default() }),
        ("min_p 0.05, T 1.2", SampleParams { temperature: 1.2, min_p: 0.05, ..Default::default() }),
        ("top_k 200 + top_p 0.8 + min_p 0.01", SampleParams { top_k: 200, top_p: 0.8, min_p: 0.01, ..Default::default() }),
        ("top_k 1", SampleParams { temperature: 0.7, top_k: 1, ..Default::default() }),
        ("no truncation", SampleParams::default()),
    ];
    for vocab in [BIG, 1000] {
        let l = logits(&mut rng, vocab, 40);
        let lb = upload(&gpu, &l);
        for (ci, (label, base)) in configs.iter().enumerate() {
            let n = 512;
            let rows: Vec<SampleRow> = (0..n).map(|r| SampleRow::new(&SampleParams { seed: (ci * 100_003 + r) as u64, ..*base }, (r % 7) as u64, 0)).collect();
            let (tok, _) = run(&gpu, &k, &lb, 0, &rows, vocab);
            let st = SampleState::new(*base, &[]);
            let d = Distribution::new(&l, &st);
            let ok = allowed(&d, vocab);
            let outside: Vec<u32> = tok.iter().copied().filter(|&t| (t as usize) >= vocab || !ok[t as usize]).collect();
            let size = ok.iter().filter(|&&a| a).count();
            check(
                outside.is_empty(),
                format!("vocab {vocab} {label}: {} of {n} draws outside the host's set of {size}: {:?}", outside.len(), &outside[..outside.len().min(8)]),
            );
            let same = rows.iter().zip(&tok).filter(|(r, &t)| d.draw(philox_uniform(r.seed, r.step)).token == t).count();
            eprintln!("vocab {vocab} {label}: allowed {size}, {same}/{n} draws equal the host's for the same uniform");
            check(same * 100 >= n * 99, format!("vocab {vocab} {label}: only {same}/{n} draws equal the host's"));
        }
    }
    // Exact ties at the cuts go to the lower ids, as on the host.
    let flat = vec![0.0f32; 1000];
    let lb = upload(&gpu, &flat);
    for (label, p, keep) in
        [("flat top_k 5", SampleParams { top_k: 5, ..Default::default() }, 5usize), ("flat top_p 0.5", SampleParams { top_p: 0.5, ..Default::default() }, 500)]
    {
        let rows: Vec<SampleRow> = (0..2000).map(|r| SampleRow::new(&SampleParams { seed: r, ..p }, 0, 0)).collect();
        let (tok, _) = run(&gpu, &k, &lb, 0, &rows, 1000);
        let max = tok.iter().copied().max().unwrap_or(0) as usize;
        check(max < keep, format!("{label}: token {max} drawn, want ids below {keep}"));
        check(max + 10 >= keep, format!("{label}: largest id drawn {max} of 2000 draws, expected near {}", keep - 1));
    }
    finish();
}

/// Draws `n` times (steps 0..n of one seed) from `l` and compares the
/// histogram with the host probabilities.
fn histogram_case(gpu: &Arc<Gpu>, k: &Kernels, label: &str, l: &[f32], params: SampleParams, n: usize) {
    let vocab = l.len();
    let lb = upload(gpu, l);
    let rows: Vec<SampleRow> = (0..n).map(|s| SampleRow::new(&params, s as u64, 0)).collect();
    let (tok, _) = run(gpu, k, &lb, 0, &rows, vocab);
    let d = Distribution::new(l, &SampleState::new(params, &[]));
    let cand = d.candidates.clone().unwrap_or_default();
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    let mut prob = vec![0.0f64; vocab];
    for c in &cand {
        prob[c.0 as usize] = c.1 as f64 / total;
    }
    let mut h = vec![0usize; vocab];
    for &t in &tok {
        if (t as usize) < vocab {
            h[t as usize] += 1;
        }
    }
    let outside: usize = (0..vocab).filter(|&i| prob[i] == 0.0).map(|i| h[i]).sum();
    let mut chi2 = 0.0;
    let mut worst = 0.0f64;
    for i in 0..vocab {
        if prob[i] > 0.0 {
            let e = prob[i] * n as f64;
            chi2 += (h[i] as f64 - e).powi(2) / e;
            worst = worst.max((h[i] as f64 / n as f64 - prob[i]).abs());
        }
    }
    let df = cand.len().saturating_sub(1).max(1) as f64;
    let bound = df + 6.0 * (2.0 * df).sqrt();
    eprintln!("{label}: {} candidates, chi2 {chi2:.1} (bound {bound:.1}), max |f - p| {worst:.4}", cand.len());
    check(outside == 0, format!("{label}: {outside} draws outside the candidates"));
    check(chi2 <= bound, format!("{label}: chi2 {chi2:.1} > {bound:.1}"));
    check(worst <= 0.012, format!("{label}: max |f - p| {worst:.4} > 0.012"));
}

#[test]
fn empirical_distribution_matches_the_host_probabilities() {
    let Some(gpu) = gpu("empirical_distribution_matches_the_host_probabilities") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(3);
    let l = rng.vec(64, -2.0, 2.0);
    histogram_case(&gpu, &k, "vocab 64, T 0.9", &l, SampleParams { temperature: 0.9, seed: 11, ..Default::default() }, 20_000);
    histogram_case(&gpu, &k, "vocab 64, top_p 0.9 + min_p 0.02", &l, SampleParams { top_p: 0.9, min_p: 0.02, seed: 12, ..Default::default() }, 20_000);
    let l = rng.vec(2000, -3.0, 3.0);
    histogram_case(&gpu, &k, "vocab 2000, top_k 20, T 1.5", &l, SampleParams { temperature: 1.5, top_k: 20, seed: 13, ..Default::default() }, 20_000);
    finish();
}

#[test]
fn same_seed_and_step_repeat_the_token() {
    let Some(gpu) = gpu("same_seed_and_step_repeat_the_token") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(4);
    let l = logits(&mut rng, BIG, 200);
    let lb = upload(&gpu, &l);
    let p = SampleParams { temperature: 1.0, top_p: 0.95, seed: 99, ..Default::default() };
    // Rows 0..32: steps 0..32 of one seed; rows 32..64 repeat them.
    let rows: Vec<SampleRow> = (0..64).map(|r| SampleRow::new(&p, (r % 32) as u64, 0)).collect();
    let (a, la) = run(&gpu, &k, &lb, 0, &rows, BIG);
    let (b, lbp) = run(&gpu, &k, &lb, 0, &rows, BIG);
    check(a == b, "two launches with the same seeds and steps differ");
    check(la.iter().map(|x| x.to_bits()).eq(lbp.iter().map(|x| x.to_bits())), "logprobs differ between identical launches");
    check(a[..32] == a[32..], "the same (seed, step) in one launch gave different tokens");
    let distinct: std::collections::HashSet<u32> = a[..32].iter().copied().collect();
    check(distinct.len() > 1, format!("32 steps of one seed gave {} distinct token(s)", distinct.len()));
    finish();
}

#[test]
fn penalties_shift_the_distribution_like_the_host() {
    let Some(gpu) = gpu("penalties_shift_the_distribution_like_the_host") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(5);
    let vocab = 300;
    let l = rng.vec(vocab, -1.0, 3.0);
    let p = SampleParams { repetition_penalty: 1.4, presence_penalty: 0.6, frequency_penalty: 0.4, top_k: 50, seed: 5, ..Default::default() };
    // The most likely raw tokens are in the prompt or generated, so the
    // penalties change the allowed set.
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by(|a, b| l[*b as usize].total_cmp(&l[*a as usize]));
    let mut st = SampleState::new(p, &order[..10]);
    for (i, &t) in order[5..25].iter().enumerate() {
        for _ in 0..=(i % 3) {
            st.accept(t);
        }
    }
    let d = Distribution::new(&l, &st);
    let raw = Distribution::new(&l, &SampleState::new(SampleParams { seed: 5, top_k: 50, ..Default::default() }, &[]));
    check(allowed(&d, vocab) != allowed(&raw, vocab), "test setup: penalties do not change the top-50 set");
    let n = 2000;
    let table = st.dense_counts(vocab);
    let mut flat = Vec::with_capacity(n * vocab);
    for _ in 0..n {
        flat.extend_from_slice(&table);
    }
    let tables = upload(&gpu, &flat);
    let lb = upload(&gpu, &l);
    let rows: Vec<SampleRow> = (0..n).map(|r| SampleRow::new(&p, r as u64, tables.ptr() + (r * vocab * 4) as u64)).collect();
    let (tok, lp) = run(&gpu, &k, &lb, 0, &rows, vocab);
    let ok = allowed(&d, vocab);
    let outside = tok.iter().filter(|&&t| (t as usize) >= vocab || !ok[t as usize]).count();
    check(outside == 0, format!("{outside} of {n} penalised draws outside the host's set"));
    let same = (0..n).filter(|&r| d.draw(philox_uniform(p.seed, r as u64)).token == tok[r]).count();
    eprintln!("penalties: {same}/{n} draws equal the host's for the same uniform");
    check(same * 100 >= n * 99, format!("penalties: only {same}/{n} draws equal the host's"));
    let lp_err =
        (0..n).filter(|&r| (tok[r] as usize) < vocab).map(|r| (lp[r] as f64 - (d.penalised[tok[r] as usize] as f64 - d.lse)).abs()).fold(0.0, f64::max);
    check(lp_err < 1e-4, format!("penalised logprob error {lp_err:.2e}"));
    let after: Vec<u32> = download(&gpu, tables.ptr(), n * vocab);
    let bad = (0..n)
        .filter(|&r| {
            let t = tok[r] as usize;
            (0..vocab).any(|i| after[r * vocab + i] != table[i] + u32::from(i == t))
        })
        .count();
    check(bad == 0, format!("{bad} count tables not incremented at exactly the drawn token"));
    finish();
}

/// `decode_sample` on the tiny fixture: the same token, logprob and top
/// logprobs as `decode` followed by the host sampler on a fork of the
/// sequence, greedy (under a vocab_limit) and sampled, with penalties, for
/// a batch of two; more top logprobs than the device reports is an error.
#[test]
fn backend_decode_sample_equals_decode_then_host_sampling() {
    let Some(gpu) = gpu("backend_decode_sample_equals_decode_then_host_sampling") else { return };
    let w = Weights::load(&common::fixtures_dir().join("mlx-q4")).expect("fixture");
    let mut o = Options::for_context(256);
    o.max_sequences = 8;
    o.kv_tokens = 8 * 256;
    o.prefill_chunk = 128;
    let mut be = CudaBackend::from_weights(&gpu, &w, o, &mut |_, _| {}).expect("cuda backend");
    let vocab = be.config().vocab_size;
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % vocab as u32).collect();
    let limit = vocab - 3;
    let params = [
        SampleParams { top_logprobs: 5, vocab_limit: limit as u32, ..SampleParams::greedy() },
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
    ];
    let mut dev_seqs = Vec::new();
    let mut host_seqs = Vec::new();
    let mut dev_states = Vec::new();
    let mut host_states = Vec::new();
    for p in params {
        let s = be.alloc().expect("alloc");
        be.prefill(s, &prompt, LogitsWanted::Last).expect("prefill");
        host_seqs.push(be.fork(s).expect("fork"));
        dev_seqs.push(s);
        dev_states.push(SampleState::new(p, &prompt));
        host_states.push(SampleState::new(p, &prompt));
    }
    let mut next = [prompt[11], prompt[10]];
    let mut mismatches = 0;
    for step in 0..16 {
        let dev_batch: Vec<_> = dev_seqs.iter().copied().zip(next).collect();
        let host_batch: Vec<_> = host_seqs.iter().copied().zip(next).collect();
        let got = be.decode_sample(&dev_batch, &mut dev_states).expect("decode_sample");
        let logits = be.decode(&host_batch).expect("decode");
        for i in 0..2 {
            let d = Distribution::new(&logits[i], &host_states[i]);
            let want = lily_model::sample::sample_host(&logits[i], &mut host_states[i]);
            if got[i].token != want.token {
                mismatches += 1;
                eprintln!("step {step} seq {i}: device {} host {}", got[i].token, want.token);
            } else {
                check((got[i].logprob - want.logprob).abs() < 1e-4, format!("step {step} seq {i}: logprob {} vs {}", got[i].logprob, want.logprob));
            }
            // The two sides' logits come from two runs of the step, so an id
            // may differ only where the host's own logprobs tie within 1e-5;
            // every reported logprob is the host's for that id and rank.
            check(got[i].top.len() == want.top.len(), format!("step {step} seq {i}: {} top logprobs, host {}", got[i].top.len(), want.top.len()));
            for (j, (g, w)) in got[i].top.iter().zip(&want.top).enumerate() {
                let host_lp = d.penalised.get(g.0 as usize).map_or(f64::NAN, |&l| l as f64 - d.lse);
                check(
                    g.0 == w.0 || (host_lp - w.1 as f64).abs() < 1e-5,
                    format!("step {step} seq {i} slot {j}: top id {} host {} (host logprobs {host_lp} vs {})", g.0, w.0, w.1),
                );
                check(
                    (g.1 as f64 - host_lp).abs() < 1e-4 && (g.1 - w.1).abs() < 1e-4,
                    format!("step {step} seq {i} slot {j}: top logprob {} host {}", g.1, w.1),
                );
            }
            if i == 0 {
                check(got[0].token == lily_model::argmax(&logits[0][..limit]), format!("step {step}: greedy token is not the argmax below the limit"));
            }
            // Both sides continue from the device's token.
            if got[i].token != want.token {
                host_states[i] = dev_states[i].clone();
                host_states[i].set_device_copy(None);
            }
            next[i] = got[i].token;
        }
    }
    check(mismatches == 0, format!("{mismatches} of 32 device draws differ from the host's"));
    check(dev_states[1].step == 16, format!("state step {} after 16 draws", dev_states[1].step));
    let mut too_many = [SampleState::new(SampleParams { top_logprobs: SAMPLE_TOP_MAX as u32 + 1, ..Default::default() }, &prompt)];
    let err = be.decode_sample(&[(dev_seqs[0], next[0])], &mut too_many);
    check(err.is_err(), format!("top_logprobs {} accepted", SAMPLE_TOP_MAX + 1));
    check(too_many[0].step == 0, "a refused draw advanced the state");
    for s in dev_seqs.iter().chain(&host_seqs) {
        be.free(*s);
    }
    finish();
}

#[test]
fn sample_rows_rejects_bad_shapes() {
    let Some(gpu) = gpu("sample_rows_rejects_bad_shapes") else { return };
    let k = kernels(&gpu);
    let z = zeros(&gpu, 64);
    let out = SampleOut { tokens: z.ptr(), logprobs: z.ptr(), top_ids: 0, top_logprobs: 0 };
    check(sampling::sample_rows_strided(&gpu, &k, z.ptr(), 10, z.ptr(), &out, 1, 20).is_err(), "stride below vocab accepted");
    check(sampling::sample_rows(&gpu, &k, z.ptr(), z.ptr(), &out, 1, 0).is_err(), "empty vocab accepted");
    let half = SampleOut { top_ids: z.ptr(), ..out };
    check(sampling::sample_rows(&gpu, &k, z.ptr(), z.ptr(), &half, 1, 16).is_err(), "top ids without top logprobs accepted");
    let no_tokens = SampleOut { tokens: 0, ..out };
    check(sampling::sample_rows(&gpu, &k, z.ptr(), z.ptr(), &no_tokens, 1, 16).is_err(), "null token output accepted");
    finish();
}

#[test]
fn top_logprobs_equal_the_host_reference() {
    let Some(gpu) = gpu("top_logprobs_equal_the_host_reference") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(6);
    for vocab in [BIG, 1000] {
        // Per row: parameters, prompt, generated tokens; the logits get exact
        // ties across the 20th place.
        let n = 8;
        let mut host = Vec::with_capacity(n * vocab);
        let mut states = Vec::new();
        for r in 0..n {
            let mut l = logits(&mut rng, vocab, 30);
            // Five equal maxima and twenty equal runners-up at scattered ids:
            // the top 20 ends inside the tie, which only ids can order.
            for _ in 0..5 {
                l[rng.below(vocab)] = 12.0;
            }
            for _ in 0..20 {
                l[rng.below(vocab)] = 11.0;
            }
            l[rng.below(vocab)] = f32::NEG_INFINITY;
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|a, b| l[*b as usize].total_cmp(&l[*a as usize]));
            let top_logprobs = [1u32, 5, 20, 20, 3, 20, 13, 20][r];
            let mut p = SampleParams { top_logprobs, seed: 100 + r as u64, ..Default::default() };
            let mut prompt = Vec::new();
            let mut generated = Vec::new();
            match r {
                0 => p.temperature = 0.0,
                3 => {
                    // Penalties reorder the head.
                    p.repetition_penalty = 1.3;
                    p.presence_penalty = 0.5;
                    p.frequency_penalty = 0.25;
                    prompt.extend_from_slice(&order[1..8]);
                    generated.extend_from_slice(&order[4..12]);
                }
                4 => {
                    // A penalty that makes a tie at the top: 26 / 2 == 13.
                    let (a, b) = (order[40] as usize, order[41] as usize);
                    l[a] = 26.0;
                    l[b] = 13.0;
                    p.repetition_penalty = 2.0;
                    prompt.push(a as u32);
                }
                5 => p = SampleParams { top_k: 10, top_p: 0.9, min_p: 0.01, ..p },
                6 => p.temperature = 0.3,
                _ => {}
            }
            let mut st = SampleState::new(p, &prompt);
            for &t in &generated {
                st.accept(t);
            }
            host.extend_from_slice(&l);
            states.push(st);
        }
        let lb = upload(&gpu, &host);
        let tables: Vec<DeviceBuffer> = states.iter().map(|s| upload(&gpu, &s.dense_counts(vocab))).collect();
        let rows: Vec<SampleRow> =
            states.iter().zip(&tables).map(|(s, t)| SampleRow::new(&s.params, 0, if s.params.has_penalties() { t.ptr() } else { 0 })).collect();
        let out = run_out(&gpu, &k, &lb, vocab, &rows, vocab);
        for r in 0..n {
            let d = Distribution::new(&host[r * vocab..(r + 1) * vocab], &states[r]);
            let label = format!("vocab {vocab}");
            check(d.top.len() == states[r].params.top_logprobs as usize, format!("{label} row {r}: test setup, host top has {}", d.top.len()));
            check_top(&label, &out, r, states[r].params.top_logprobs as usize, &d.top);
            // The draw and its logprob are unchanged by the report.
            let t = out.tok[r] as usize;
            check(allowed(&d, vocab).get(t).copied().unwrap_or(false), format!("{label} row {r}: token {t} outside the host's set"));
            if states[r].params.temperature == 0.0 {
                check(out.tok[r] == d.argmax, format!("{label} row {r}: greedy token {t} host {}", d.argmax));
            }
            let want_lp = d.penalised.get(t).map_or(f64::NAN, |&l| l as f64 - d.lse);
            check((out.lp[r] as f64 - want_lp).abs() < 1e-4, format!("{label} row {r}: logprob {} host {want_lp}", out.lp[r]));
        }
    }
    // All-equal logits: the top is the lowest ids; a row asking more than its
    // vocab_limit gets the whole vocabulary, then empty slots. Mostly -inf
    // logits: the finite ones, then -inf ones by id with logprob -inf.
    let flat = vec![0.5f32; 4096];
    let mut sparse = vec![f32::NEG_INFINITY; 4096];
    for i in [4000, 17, 2500, 3, 999, 4095] {
        sparse[i] = (i % 7) as f32;
    }
    for (label, l) in [("flat", &flat), ("mostly -inf", &sparse)] {
        let lb = upload(&gpu, l);
        let rows = [
            SampleRow::new(&SampleParams { top_logprobs: 20, ..SampleParams::greedy() }, 0, 0),
            SampleRow::new(&SampleParams { top_logprobs: 20, vocab_limit: 7, ..Default::default() }, 0, 0),
            SampleRow::new(&SampleParams { top_logprobs: 0, ..Default::default() }, 0, 0),
            SampleRow::new(&SampleParams { top_logprobs: 9, top_k: 3, ..Default::default() }, 0, 0),
        ];
        let out = run_out(&gpu, &k, &lb, 0, &rows, 4096);
        for (r, row) in rows.iter().enumerate() {
            let p = SampleParams { top_logprobs: row.top_logprobs, vocab_limit: row.vocab_limit, ..Default::default() };
            let d = Distribution::new(l, &SampleState::new(p, &[]));
            check_top(label, &out, r, row.top_logprobs as usize, &d.top);
        }
    }
    finish();
}

#[test]
fn vocab_limit_is_never_crossed() {
    let Some(gpu) = gpu("vocab_limit_is_never_crossed") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(7);
    for (vocab, limit) in [(BIG, 248_077usize), (1000, 900)] {
        // The tail beyond the limit holds the maximum and most of the mass.
        let mut l = logits(&mut rng, vocab, 20);
        for x in &mut l[limit..] {
            *x = 15.0;
        }
        l[vocab - 1] = 30.0;
        let lb = upload(&gpu, &l);
        let lim = limit as u32;
        let configs: Vec<(&str, SampleParams)> = vec![
            ("greedy", SampleParams { vocab_limit: lim, top_logprobs: 20, ..SampleParams::greedy() }),
            ("plain", SampleParams { vocab_limit: lim, top_logprobs: 5, ..Default::default() }),
            ("top_k 50", SampleParams { vocab_limit: lim, top_k: 50, ..Default::default() }),
            ("top_p 0.95 T 2", SampleParams { vocab_limit: lim, top_p: 0.95, temperature: 2.0, ..Default::default() }),
            ("min_p 0.001", SampleParams { vocab_limit: lim, min_p: 0.001, top_logprobs: 20, ..Default::default() }),
        ];
        for (label, base) in &configs {
            let n = 256;
            let rows: Vec<SampleRow> = (0..n).map(|r| SampleRow::new(&SampleParams { seed: r as u64, ..*base }, r as u64, 0)).collect();
            let out = run_out(&gpu, &k, &lb, 0, &rows, vocab);
            let d = Distribution::new(&l, &SampleState::new(*base, &[]));
            let beyond = out.tok.iter().filter(|&&t| t as usize >= limit).count();
            check(beyond == 0, format!("vocab {vocab} limit {limit} {label}: {beyond} of {n} draws at or beyond the limit"));
            let same = rows.iter().zip(&out.tok).filter(|(r, &t)| d.draw(philox_uniform(r.seed, r.step)).token == t).count();
            check(same * 100 >= n * 99, format!("vocab {vocab} limit {limit} {label}: only {same}/{n} draws equal the host's"));
            if base.temperature == 0.0 {
                check(out.tok.iter().all(|&t| t == d.argmax), format!("vocab {vocab} {label}: greedy {:?} host argmax {}", &out.tok[..4], d.argmax));
            }
            let lp_err = out
                .tok
                .iter()
                .zip(&out.lp)
                .map(|(&t, &lp)| d.penalised.get(t as usize).map_or(f64::INFINITY, |&l| (lp as f64 - (l as f64 - d.lse)).abs()))
                .fold(0.0, f64::max);
            check(lp_err < 1e-4, format!("vocab {vocab} {label}: logprob error {lp_err:.2e} (the log-sum-exp must stop at the limit)"));
            let reported_beyond = (0..n)
                .flat_map(|r| &out.top_ids[r * SAMPLE_TOP_MAX..r * SAMPLE_TOP_MAX + base.top_logprobs as usize])
                .filter(|&&id| id as usize >= limit)
                .count();
            check(reported_beyond == 0, format!("vocab {vocab} {label}: {reported_beyond} reported ids at or beyond the limit"));
            for r in [0, n - 1] {
                check_top(&format!("vocab {vocab} limit {limit} {label}"), &out, r, base.top_logprobs as usize, &d.top);
            }
        }
        // A penalised row: the count update lands inside the limit.
        let p = SampleParams { vocab_limit: lim, repetition_penalty: 1.2, top_logprobs: 3, ..SampleParams::greedy() };
        let st = SampleState::new(p, &[0, (vocab - 1) as u32]);
        let table = upload(&gpu, &st.dense_counts(vocab));
        let out = run_out(&gpu, &k, &lb, 0, &[SampleRow::new(&p, 0, table.ptr())], vocab);
        let d = Distribution::new(&l, &st);
        check(out.tok[0] == d.argmax && (out.tok[0] as usize) < limit, format!("vocab {vocab}: penalised greedy {} host {}", out.tok[0], d.argmax));
        check_top(&format!("vocab {vocab} penalised"), &out, 0, 3, &d.top);
        // 0 and a limit past the row both mean the whole row.
        for whole in [0u32, vocab as u32 + 5] {
            let p = SampleParams { vocab_limit: whole, top_logprobs: 1, ..SampleParams::greedy() };
            let out = run_out(&gpu, &k, &lb, 0, &[SampleRow::new(&p, 0, 0)], vocab);
            check(
                out.tok[0] as usize == vocab - 1 && out.top_ids[0] as usize == vocab - 1,
                format!("vocab {vocab} limit {whole}: token {} want the row's maximum {}", out.tok[0], vocab - 1),
            );
        }
    }
    finish();
}

/// What one launch through `path` wrote, with the count tables after it
/// (tables start from `tables` for every path).
fn run_path(gpu: &Arc<Gpu>, k: &Kernels, lb: &DeviceBuffer, rows: &[SampleRow], tables: &[u32], vocab: usize, path: SamplePath) -> (Out, Vec<u32>) {
    let n = rows.len();
    let tb = upload(gpu, tables);
    // Row r's table lies `counts` bytes into the table buffer (0 = none).
    let rows: Vec<SampleRow> = rows
        .iter()
        .map(|r| {
            let mut row = *r;
            row.counts = if r.counts == 0 { 0 } else { tb.ptr() + r.counts - 1 };
            row
        })
        .collect();
    let rb = upload(gpu, &rows);
    let tok = upload(gpu, &vec![u32::MAX; n]);
    let lp = upload(gpu, &vec![f32::NAN; n]);
    let top_ids = upload(gpu, &vec![UNTOUCHED; n * SAMPLE_TOP_MAX]);
    let top_lps = upload(gpu, &vec![f32::NAN; n * SAMPLE_TOP_MAX]);
    let out = SampleOut { tokens: tok.ptr(), logprobs: lp.ptr(), top_ids: top_ids.ptr(), top_logprobs: top_lps.ptr() };
    sampling::sample_rows_path(gpu, k, lb.ptr(), vocab, rb.ptr(), &out, n, vocab, path).expect("launch");
    let o = Out {
        tok: download(gpu, tok.ptr(), n),
        lp: download(gpu, lp.ptr(), n),
        top_ids: download(gpu, top_ids.ptr(), n * SAMPLE_TOP_MAX),
        top_lps: download(gpu, top_lps.ptr(), n * SAMPLE_TOP_MAX),
    };
    (o, download(gpu, tb.ptr(), tables.len()))
}

/// Logprobs of the two paths agree: the same bits, both NaN, or within
/// 1e-6 relative to max(1, |x|) (the fast log-sum-exp sums per chunk).
fn close(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

/// One random row of kind `kind` (see the match) at `vocab`.
fn fast_case_row(rng: &mut Rng, vocab: usize, kind: usize, variant: usize) -> Vec<f32> {
    match kind {
        0 => logits(rng, vocab, 30),
        1 => logits(rng, vocab, 3),
        // Seven levels: the top level is tied far past the 32 kept keys.
        2 => (0..vocab).map(|_| rng.below(7) as f32 - 3.0).collect(),
        // A peaked head with exact ties around the top-k boundary.
        3 => {
            let mut l = logits(rng, vocab, 30);
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
            for j in [1usize, 5, 18, 19, 22] {
                if j + 1 < vocab {
                    l[order[j + 1]] = l[order[j]];
                }
            }
            l
        }
        // NaN and -inf sprinkled, some of the hot ones NaN.
        4 => {
            let mut l = logits(rng, vocab, 20);
            for x in l.iter_mut() {
                match rng.below(100) {
                    0 => *x = f32::NAN,
                    1 => *x = f32::NEG_INFINITY,
                    _ => {}
                }
            }
            let top = (0..vocab).max_by(|a, b| l[*a].total_cmp(&l[*b])).unwrap_or(0);
            l[top] = f32::NAN;
            l
        }
        // A wide spread: most weights underflow.
        5 => rng.vec(vocab, -4.0, 4.0).into_iter().map(|x| x * 40.0).collect(),
        _ => match variant % 5 {
            // All -inf but three.
            0 => {
                let mut l = vec![f32::NEG_INFINITY; vocab];
                for _ in 0..3 {
                    let i = rng.below(vocab);
                    l[i] = rng.uniform(-2.0, 2.0);
                }
                l
            }
            1 => vec![f32::NAN; vocab],
            // A +inf logit.
            2 => {
                let mut l = logits(rng, vocab, 5);
                let i = rng.below(vocab);
                l[i] = f32::INFINITY;
                l
            }
            // Logits within 1e-6 of 0: distinct logits share weights, so
            // the weight order (ties by id) is not the logit order.
            3 => rng.vec(vocab, -1e-6, 1e-6),
            // Near-ties: the top 40 one ulp apart.
            _ => {
                let mut l = rng.vec(vocab, -4.0, 0.0);
                let mut v = 5.0f32;
                for _ in 0..40.min(vocab) {
                    let i = rng.below(vocab);
                    l[i] = v;
                    v = f32::from_bits(v.to_bits() - 1);
                }
                l
            }
        },
    }
}

/// The fast path (`sample_fast_chunks` + `sample_fast_finish`) against the
/// one-block kernel (`SamplePath::Slow`) on many random rows: peaked, tied,
/// NaN / -inf / +inf, underflowing, near-tied, sharing weights, with
/// penalties (and count tables without them), min_p, top_p 1 and below,
/// top_k 1..24 (and 0 / 50, which must go to the one-block kernel), greedy,
/// top_logprobs 0 / 5 / 20, vocab_limit, at the real vocabulary (more rows
/// than one fast launch group), at 1000 and at 20 (fewer ids than the 32
/// kept). Tokens, top ids and count tables are identical; logprobs within
/// 1e-6 relative. The probe (fast path without its fallback) decides every
/// greedy row, no row off the fast path, at least 90% of the peaked sampled
/// rows, and leaves at least one row at the real vocabulary to the
/// fallback.
#[test]
fn fast_path_equals_the_one_block_kernel() {
    let Some(gpu) = gpu("fast_path_equals_the_one_block_kernel") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(17);
    for (vocab, n) in [(BIG, 270usize), (1000, 1400), (20, 700)] {
        let mut flat = Vec::with_capacity(n * vocab);
        let mut rows = Vec::with_capacity(n);
        let mut tables: Vec<u32> = Vec::new();
        let mut kinds = Vec::with_capacity(n);
        for r in 0..n {
            let kind = r % 7;
            let l = fast_case_row(&mut rng, vocab, kind, r / 7);
            let p = SampleParams {
                temperature: [0.0, 0.6, 1.0, 1.0, 1.7][rng.below(5)],
                top_k: [1, 20, 20, 24, 2, 7, 0, 50][rng.below(8)],
                top_p: [1.0, 0.95, 0.95, 0.5, 0.0][rng.below(5)],
                min_p: [0.0, 0.0, 0.05, 0.3][rng.below(4)],
                top_logprobs: [0, 5, 20][rng.below(3)],
                vocab_limit: [0, 0, (vocab - vocab / 7) as u32, vocab as u32 + 3][rng.below(4)],
                seed: rng.seed(),
                ..Default::default()
            };
            let pen = rng.below(3);
            let p = if pen == 0 { SampleParams { repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.3, ..p } } else { p };
            let counts = if pen < 2 {
                // Marks on some of the row's largest logits (seen in the
                // prompt, generated 0..3 times), so penalties move the head.
                let mut t = vec![0u32; vocab];
                let mut order: Vec<usize> = (0..vocab).collect();
                order.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
                for &i in order.iter().take(40) {
                    if rng.below(3) == 0 {
                        t[i] = if rng.below(2) == 0 { lily_model::sample::SEEN_IN_PROMPT } else { 0 } | rng.below(4) as u32;
                    }
                }
                let at = tables.len() * 4 + 1;
                tables.extend_from_slice(&t);
                at as u64
            } else {
                0
            };
            rows.push(SampleRow::new(&p, r as u64 * 3 + 1, counts));
            kinds.push(kind);
            flat.extend_from_slice(&l);
        }
        let lb = upload(&gpu, &flat);
        let (slow, slow_t) = run_path(&gpu, &k, &lb, &rows, &tables, vocab, SamplePath::Slow);
        let (auto, auto_t) = run_path(&gpu, &k, &lb, &rows, &tables, vocab, SamplePath::Auto);
        let (probe, probe_t) = run_path(&gpu, &k, &lb, &rows, &tables, vocab, SamplePath::FastProbe);
        check(auto_t == slow_t, format!("vocab {vocab}: count tables differ after the fast and the one-block paths"));
        let (mut peaked, mut peaked_fast, mut fell_back) = (0usize, 0usize, 0usize);
        for r in 0..n {
            let p = &rows[r];
            let what = format!("vocab {vocab} row {r} kind {} {p:?}", kinds[r]);
            check(auto.tok[r] == slow.tok[r], format!("{what}: token {} one-block {}", auto.tok[r], slow.tok[r]));
            check(close(auto.lp[r], slow.lp[r]), format!("{what}: logprob {} one-block {}", auto.lp[r], slow.lp[r]));
            let s = r * SAMPLE_TOP_MAX..(r + 1) * SAMPLE_TOP_MAX;
            check(
                auto.top_ids[s.clone()] == slow.top_ids[s.clone()],
                format!("{what}: top ids {:?} one-block {:?}", &auto.top_ids[s.clone()], &slow.top_ids[s.clone()]),
            );
            let lps_ok = s.clone().all(|j| close(auto.top_lps[j], slow.top_lps[j]));
            check(lps_ok, format!("{what}: top logprobs {:?} one-block {:?}", &auto.top_lps[s.clone()], &slow.top_lps[s.clone()]));
            // NaN and non-positive temperatures are greedy, as in the kernel.
            let greedy = p.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater);
            let on_fast = greedy || (1..=SAMPLE_FAST_TOP_K).contains(&p.top_k);
            let decided = probe.tok[r] != SAMPLE_UNDECIDED;
            if decided {
                check(on_fast, format!("{what}: off the fast path, yet the probe decided it"));
                check(probe.tok[r] == slow.tok[r] && close(probe.lp[r], slow.lp[r]), format!("{what}: probe token {} one-block {}", probe.tok[r], slow.tok[r]));
                check(probe.top_ids[s.clone()] == slow.top_ids[s.clone()], format!("{what}: probe top ids differ"));
            } else {
                check(!greedy, format!("{what}: a greedy row left to the fallback"));
                let untouched = probe.lp[r].is_nan() && probe.top_ids[s.clone()].iter().all(|&id| id == UNTOUCHED);
                check(untouched, format!("{what}: an undecided probe row has outputs"));
                if on_fast {
                    fell_back += 1;
                }
            }
            if on_fast && !greedy && kinds[r] <= 1 {
                peaked += 1;
                peaked_fast += usize::from(decided);
            }
        }
        // The probe updated exactly the tables of the rows it decided.
        let mut want_t = tables.clone();
        for r in 0..n {
            if rows[r].counts != 0 && probe.tok[r] != SAMPLE_UNDECIDED {
                want_t[(rows[r].counts as usize - 1) / 4 + probe.tok[r] as usize] += 1;
            }
        }
        check(probe_t == want_t, format!("vocab {vocab}: the probe's count tables"));
        eprintln!("vocab {vocab}: {peaked_fast}/{peaked} peaked sampled rows decided by the fast path, {fell_back} fast-path rows fell back");
        check(peaked_fast * 10 >= peaked * 9, format!("vocab {vocab}: only {peaked_fast}/{peaked} peaked sampled rows went fast"));
        if vocab == BIG {
            check(fell_back > 0, "vocab BIG: no row exercised the fallback (the tied rows should)");
        }
    }
    finish();
}

/// The point of the fast path: the checkpoint's defaults (T 1, top_k 20,
/// top_p 0.95) at the real vocabulary take it for every row (what is
/// asserted), at a small fraction of the one-block kernel's time (printed
/// for the log, not asserted: a timed assertion failed when the suites ran
/// side by side on one GPU; speed is the benchmarks' job).
#[test]
fn checkpoint_defaults_take_the_fast_path_at_the_real_vocabulary() {
    let Some(gpu) = gpu("checkpoint_defaults_take_the_fast_path_at_the_real_vocabulary") else { return };
    let k = kernels(&gpu);
    let mut rng = Rng::new(19);
    for n in [1usize, 8, 64] {
        let flat: Vec<f32> = (0..n).flat_map(|_| logits(&mut rng, BIG, 40)).collect();
        let lb = upload(&gpu, &flat);
        let p = SampleParams { temperature: 1.0, top_k: 20, top_p: 0.95, ..Default::default() };
        let rows: Vec<SampleRow> = (0..n).map(|r| SampleRow::new(&SampleParams { seed: r as u64, ..p }, 0, 0)).collect();
        let rb = upload(&gpu, &rows);
        let tok = zeros(&gpu, n * 4);
        let lp = zeros(&gpu, n * 4);
        let out = SampleOut { tokens: tok.ptr(), logprobs: lp.ptr(), top_ids: 0, top_logprobs: 0 };
        let time = |path: SamplePath| {
            let reps = 20;
            sampling::sample_rows_path(&gpu, &k, lb.ptr(), BIG, rb.ptr(), &out, n, BIG, path).expect("warm-up");
            gpu.synchronize().expect("sync");
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                sampling::sample_rows_path(&gpu, &k, lb.ptr(), BIG, rb.ptr(), &out, n, BIG, path).expect("launch");
            }
            gpu.synchronize().expect("sync");
            t0.elapsed().as_secs_f64() * 1e3 / reps as f64
        };
        let slow = time(SamplePath::Slow);
        let fast = time(SamplePath::Auto);
        eprintln!("{n} rows at vocab {BIG}: one-block {slow:.3} ms, fast path {fast:.3} ms");
        let probe = {
            sampling::sample_rows_path(&gpu, &k, lb.ptr(), BIG, rb.ptr(), &out, n, BIG, SamplePath::FastProbe).expect("probe");
            download::<u32>(&gpu, tok.ptr(), n)
        };
        check(probe.iter().all(|&t| t != SAMPLE_UNDECIDED), format!("{n} rows: the timed rows did not all go fast"));
    }
    finish();
}
