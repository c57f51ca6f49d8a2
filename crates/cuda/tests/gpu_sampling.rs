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
//! and a max |frequency - probability| of 0.012 (sigma <= 0.0036).

mod common;

use std::sync::Arc;

use common::{check, download, finish, gpu, upload, zeros, Rng};
use lily_core::config::production;
use lily_core::weights::Weights;
use lily_cuda::device::{DeviceBuffer, Gpu};
use lily_cuda::dims::Dims;
use lily_cuda::kernels::Kernels;
use lily_cuda::sampling::{self, SampleRow};
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

/// Runs `sample_rows` on `rows` over logits at `logits` (row stride
/// `stride` floats, 0 = shared) and returns (tokens, logprobs).
fn run(gpu: &Arc<Gpu>, k: &Kernels, logits: &DeviceBuffer, stride: usize, rows: &[SampleRow], vocab: usize) -> (Vec<u32>, Vec<f32>) {
    let n = rows.len();
    let rb = upload(gpu, rows);
    let tok = upload(gpu, &vec![u32::MAX; n]);
    let lp = upload(gpu, &vec![f32::NAN; n]);
    sampling::sample_rows_strided(gpu, k, logits.ptr(), stride, rb.ptr(), tok.ptr(), lp.ptr(), n, vocab).expect("launch");
    (download(gpu, tok.ptr(), n), download(gpu, lp.ptr(), n))
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
        let rows: Vec<SampleRow> = states
            .iter()
            .zip(&tables)
            .map(|(s, t)| SampleRow::new(&s.params, 0, if s.params.has_penalties() { t.ptr() } else { 0 }))
            .collect();
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
            let rows: Vec<SampleRow> = (0..n)
                .map(|r| SampleRow::new(&SampleParams { seed: (ci * 100_003 + r) as u64, ..*base }, (r % 7) as u64, 0))
                .collect();
            let (tok, _) = run(&gpu, &k, &lb, 0, &rows, vocab);
            let st = SampleState::new(*base, &[]);
            let d = Distribution::new(&l, &st);
            let ok = allowed(&d, vocab);
            let outside: Vec<u32> = tok.iter().copied().filter(|&t| (t as usize) >= vocab || !ok[t as usize]).collect();
            let size = ok.iter().filter(|&&a| a).count();
            check(outside.is_empty(), format!("vocab {vocab} {label}: {} of {n} draws outside the host's set of {size}: {:?}", outside.len(), &outside[..outside.len().min(8)]));
            let same = rows.iter().zip(&tok).filter(|(r, &t)| d.draw(philox_uniform(r.seed, r.step)).token == t).count();
            eprintln!("vocab {vocab} {label}: allowed {size}, {same}/{n} draws equal the host's for the same uniform");
            check(same * 100 >= n * 99, format!("vocab {vocab} {label}: only {same}/{n} draws equal the host's"));
        }
    }
    // Exact ties at the cuts go to the lower ids, as on the host.
    let flat = vec![0.0f32; 1000];
    let lb = upload(&gpu, &flat);
    for (label, p, keep) in [
        ("flat top_k 5", SampleParams { top_k: 5, ..Default::default() }, 5usize),
        ("flat top_p 0.5", SampleParams { top_p: 0.5, ..Default::default() }, 500),
    ] {
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
    let lp_err = (0..n)
        .filter(|&r| (tok[r] as usize) < vocab)
        .map(|r| (lp[r] as f64 - (d.penalised[tok[r] as usize] as f64 - d.lse)).abs())
        .fold(0.0, f64::max);
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

/// `decode_sample` on the tiny fixture: the same token and logprob as
/// `decode` followed by the host sampler on a fork of the sequence, greedy
/// and sampled, with penalties, for a batch of two.
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
    let params = [
        SampleParams::greedy(),
        SampleParams { temperature: 0.9, top_k: 30, top_p: 0.9, repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.2, seed: 42, ..Default::default() },
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
            let want = lily_model::sample::sample_host(&logits[i], &mut host_states[i]);
            if got[i].token != want.token {
                mismatches += 1;
                eprintln!("step {step} seq {i}: device {} host {}", got[i].token, want.token);
            } else {
                check((got[i].logprob - want.logprob).abs() < 1e-4, format!("step {step} seq {i}: logprob {} vs {}", got[i].logprob, want.logprob));
            }
            if i == 0 {
                check(got[0].token == lily_model::argmax(&logits[0]), format!("step {step}: greedy token is not the argmax"));
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
    check(sampling::sample_rows_strided(&gpu, &k, z.ptr(), 10, z.ptr(), z.ptr(), z.ptr(), 1, 20).is_err(), "stride below vocab accepted");
    check(sampling::sample_rows(&gpu, &k, z.ptr(), z.ptr(), z.ptr(), z.ptr(), 1, 0).is_err(), "empty vocab accepted");
    finish();
}
