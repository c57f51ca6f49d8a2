//! Tests of the host sampling math: the truncations against a naive
//! full-sort reference, the distributions drawn, penalties, logprobs and
//! their alternatives, the vocabulary limit, and the seeded random stream.

use super::*;

fn params(f: impl FnOnce(&mut SampleParams)) -> SampleParams {
    let mut p = SampleParams { seed: 7, ..Default::default() };
    f(&mut p);
    p
}

fn state(f: impl FnOnce(&mut SampleParams)) -> SampleState {
    SampleState::new(params(f), &[])
}

fn kept(logits: &[f32], s: &SampleState) -> Vec<u32> {
    Distribution::new(logits, s).candidates.unwrap_or_default().iter().map(|c| c.0).collect()
}

/// Empirical distribution of `n` draws from the same logits.
fn histogram(p: SampleParams, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = SampleState::new(p, &[]);
    let mut h = vec![0; logits.len()];
    for _ in 0..n {
        h[sample_host(logits, &mut s).token as usize] += 1;
    }
    h
}

/// Deterministic pseudo-random logits in [-4, 4) with some exact ties.
fn noise(n: usize, salt: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = ((i / 3) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            let x = x ^ (x >> 29);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

/// The candidate set by the definition, with full sorts only.
fn naive_candidates(penalised: &[f32], p: &SampleParams) -> Vec<u32> {
    let m = penalised.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut c: Vec<(u32, f32)> =
        penalised.iter().enumerate().map(|(i, &l)| (i as u32, ((l - m) * (1.0 / p.temperature)).exp())).filter(|&(_, w)| w > 0.0 && w >= p.min_p).collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        c.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let total: f64 = c.iter().map(|x| x.1 as f64).sum();
        let mut acc = 0.0;
        if let Some(n) = c.iter().position(|x| {
            acc += x.1 as f64;
            acc >= p.top_p as f64 * total
        }) {
            c.truncate(n + 1);
        }
    }
    let mut ids: Vec<u32> = c.iter().map(|x| x.0).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn philox_matches_the_published_known_answer() {
    // Random123's kat_vectors: philox4x32-10 with counter and key all
    // zero gives 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
    let u = philox_uniform(0, 0);
    let want = ((0x6627_e8d5u64 << 32 | 0xe169_c58d) >> 11) as f64 / 9_007_199_254_740_992.0;
    assert_eq!(u, want);
    assert_ne!(philox_uniform(1, 0), philox_uniform(1, 1));
}

#[test]
fn greedy_is_first_argmax_and_logprob_is_log_softmax() {
    let mut s = SampleState::new(SampleParams::greedy(), &[]);
    let out = sample_host(&[1.0, 3.0, 3.0, 0.0], &mut s);
    assert_eq!(out.token, 1);
    let lse = (1f64.exp() + 2.0 * 3f64.exp() + 1.0).ln();
    assert!((out.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
    assert_eq!(s.step, 1);
    assert_eq!(sample_host(&[0.1, 3.0, -1.0, 2.9], &mut s).token, 1);
    // NaN never wins.
    assert_eq!(sample_host(&[f32::NAN, 1.0, 2.0], &mut s).token, 2);
}

#[test]
fn truncations_keep_the_documented_sets() {
    // Probabilities 0.5, 0.3, 0.15, 0.05.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
    assert_eq!(kept(&logits, &state(|p| p.top_p = 0.75)), vec![0, 1]);
    assert_eq!(kept(&logits, &state(|p| p.top_p = 0.85)), vec![0, 1, 2]);
    assert_eq!(kept(&logits, &state(|p| p.top_k = 3)), vec![0, 1, 2]);
    assert_eq!(kept(&logits, &state(|p| p.min_p = 0.5)), vec![0, 1]);
    // min-p first, then top-k, then top-p on what is left. Weights 1, 0.6,
    // 0.3, 0.1: min-p keeps {0, 1, 2}, top-k 2 keeps {0, 1} (mass 1.6), and
    // top-p 0.6 of that (0.96) keeps {0}; top-p on the whole row (0.6 of 2.0)
    // would have kept {0, 1}.
    assert_eq!(
        kept(
            &logits,
            &state(|p| {
                p.min_p = 0.2;
                p.top_k = 2;
                p.top_p = 0.6
            })
        ),
        vec![0]
    );
    // Ties at the top-k boundary go to the lower id.
    assert_eq!(kept(&[1.0f32; 6], &state(|p| p.top_k = 2)), vec![0, 1]);
}

#[test]
fn selection_matches_a_full_sort_reference() {
    // Random rows with ties; sizes on both sides of the top-p head.
    let cases: Vec<SampleParams> = vec![
        params(|p| p.top_k = 40),
        params(|p| p.top_p = 0.9),
        params(|p| {
            p.temperature = 0.7;
            p.top_p = 0.95
        }),
        params(|p| {
            p.temperature = 50.0;
            p.top_p = 0.99
        }),
        params(|p| {
            p.min_p = 0.05;
            p.top_k = 300;
            p.top_p = 0.8
        }),
        params(|p| {
            p.temperature = 1.3;
            p.min_p = 0.01
        }),
        // The one-pass top-k (k <= ONE_PASS_TOP_K), whose blocks of
        // SKIP_BLOCK entries are skipped whole below its threshold.
        params(|p| {
            p.temperature = 0.6;
            p.top_k = 20;
            p.top_p = 0.95
        }),
        params(|p| p.top_k = 1),
        params(|p| {
            p.temperature = 5.0;
            p.top_k = ONE_PASS_TOP_K as u32;
            p.min_p = 0.001
        }),
    ];
    for (n, salt) in [(50usize, 1u64), (3000, 2), (20_000, 3), (SKIP_BLOCK * 7 + 5, 4)] {
        let logits = noise(n, salt);
        for p in &cases {
            let s = SampleState::new(*p, &[]);
            let want = naive_candidates(&logits, p);
            assert_eq!(kept(&logits, &s), want, "vocab {n}, {p:?}");
        }
    }
}

#[test]
fn temperature_one_follows_softmax() {
    // softmax([ln 1, ln 2, ln 7]) = [0.1, 0.2, 0.7]
    let h = histogram(params(|_| {}), &[1f32.ln(), 2f32.ln(), 7f32.ln()], 20_000);
    let f: Vec<f64> = h.iter().map(|&c| c as f64 / 20_000.0).collect();
    assert!((f[0] - 0.1).abs() < 0.015 && (f[1] - 0.2).abs() < 0.015 && (f[2] - 0.7).abs() < 0.015, "{f:?}");
}

#[test]
fn low_temperature_sharpens_high_flattens() {
    let logits = [0.0f32, 1.0];
    let cold = histogram(params(|p| p.temperature = 0.1), &logits, 5_000);
    let hot = histogram(params(|p| p.temperature = 100.0), &logits, 5_000);
    // exp(10) : 1 -> token 0 almost never at T=0.1; near 50/50 at T=100.
    assert!(cold[0] < 10, "{cold:?}");
    assert!((hot[0] as f64 / 5_000.0 - 0.5).abs() < 0.04, "{hot:?}");
}

#[test]
fn top_k_keeps_only_k_best() {
    let h = histogram(params(|p| p.top_k = 2), &[3.0f32, 2.9, 2.8, -1.0, 2.7], 3_000);
    assert!(h[0] > 0 && h[1] > 0);
    assert_eq!(h[2] + h[3] + h[4], 0, "{h:?}");
}

#[test]
fn top_p_keeps_smallest_set_reaching_mass_renormalised() {
    // Probabilities 0.5, 0.3, 0.15, 0.05.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
    let h = histogram(params(|p| p.top_p = 0.85), &logits, 4_000);
    assert!(h[2] > 0 && h[3] == 0, "{h:?}");
    // Kept tokens are renormalised: 0.5/0.8 of the mass for token 0.
    let h = histogram(params(|p| p.top_p = 0.75), &logits, 20_000);
    assert!(h[2] == 0 && h[3] == 0, "{h:?}");
    assert!((h[0] as f64 / 20_000.0 - 0.625).abs() < 0.015, "{h:?}");
}

#[test]
fn top_p_beyond_the_sorted_head_falls_back_to_a_full_sort() {
    // A flat distribution over 3000 tokens: top_p 0.9 needs 2700 of them,
    // more than the sorted head; equal weights tie-break by id, so the last
    // 300 ids are the ones cut.
    let logits = vec![0.0f32; 3000];
    let s = state(|p| p.top_p = 0.9);
    assert_eq!(kept(&logits, &s), (0..2700).collect::<Vec<u32>>());
    let h = histogram(s.params, &logits, 20_000);
    assert!(h[..2700].iter().filter(|&&c| c > 0).count() > 2000);
    assert_eq!(h[2700..].iter().sum::<usize>(), 0);
}

#[test]
fn min_p_drops_tokens_below_fraction_of_top() {
    // Probabilities 0.6, 0.3, 0.1: min_p 0.4 keeps tokens with p >= 0.24.
    let h = histogram(params(|p| p.min_p = 0.4), &[0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()], 4_000);
    assert!(h[0] > 0 && h[1] > 0 && h[2] == 0, "{h:?}");
}

#[test]
fn truncation_never_picks_a_removed_token_with_extreme_logits() {
    let logits = [f32::NEG_INFINITY, 10.0, f32::NEG_INFINITY, 9.0];
    let h = histogram(params(|p| p.top_k = 3), &logits, 1_000);
    assert_eq!(h[0] + h[2], 0);
    let h = histogram(params(|_| {}), &logits, 1_000);
    assert_eq!(h[0] + h[2], 0);
}

#[test]
fn penalties_follow_the_documented_order() {
    let p = SampleParams { repetition_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
    let mut s = SampleState::new(p, &[0, 1]);
    s.accept(3);
    s.accept(3);
    let d = Distribution::new(&[4.0, -1.0, 3.0, 2.5], &s);
    assert_eq!(d.penalised, vec![2.0, -2.0, 3.0, 1.25 - 0.5 - 0.5]);
    assert_eq!(s.count_of(0), SEEN_IN_PROMPT);
    assert_eq!(s.count_of(3), 2);
    assert_eq!(s.dense_counts(5), vec![SEEN_IN_PROMPT, SEEN_IN_PROMPT, 0, 2, 0]);
}

#[test]
fn presence_and_frequency_penalise_generated_tokens_only() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25;
    });
    // Token 2 is in the prompt: OpenAI penalties ignore the prompt.
    let mut s = SampleState::new(p, &[2]);
    assert_eq!(Distribution::new(&[1.0, 2.0, 3.0], &s).penalised, vec![1.0, 2.0, 3.0]);
    // Drawn tokens count: 2 twice, then 1 once.
    s.record_draw(2);
    s.record_draw(2);
    s.record_draw(1);
    let d = Distribution::new(&[1.0, 2.0, 3.0], &s);
    assert_eq!(d.penalised, vec![1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.5]);
    assert_eq!(sample_host(&[1.0, 2.0, 3.0], &mut s).token, 2);
}

#[test]
fn repetition_penalty_divides_positive_multiplies_negative() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.repetition_penalty = 2.0;
    });
    let mut s = SampleState::new(p, &[0, 1]);
    s.accept(3);
    let logits = [4.0f32, -1.0, 3.0, 2.5];
    assert_eq!(Distribution::new(&logits, &s).penalised, vec![2.0, -2.0, 3.0, 1.25]);
    assert_eq!(sample_host(&logits, &mut s).token, 2);
}

#[test]
fn same_seed_same_tokens_different_seed_differs() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let run = |seed| {
        let mut s = state(|p| p.seed = seed);
        (0..64).map(|_| sample_host(&logits, &mut s).token).collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
    // Draw `step` uses the uniform of (seed, step) and nothing else.
    let mut s = state(|p| p.seed = 9);
    s.step = 5;
    let d = Distribution::new(&logits, &s);
    assert_eq!(sample_host(&logits, &mut s).token, d.draw(philox_uniform(9, 5)).token);
}

#[test]
fn logprobs_are_log_softmax_of_penalised_logits_before_temperature() {
    let mut s = state(|p| {
        p.temperature = 0.5;
        p.top_logprobs = 2;
    });
    let logits = [0.25f32.ln(), 0.25f32.ln(), 0.5f32.ln()];
    let out = sample_host(&logits, &mut s);
    assert!((out.logprob - logits[out.token as usize]).abs() < 1e-5);
    assert_eq!(out.top.len(), 2);
    assert_eq!(out.top[0].0, 2);
    assert!((out.top[0].1 - 0.5f32.ln()).abs() < 1e-5);
    // Tie between 0 and 1: the lower id first.
    assert_eq!(out.top[1].0, 0);
    assert!((out.top[1].1 - 0.25f32.ln()).abs() < 1e-5);
    // None asked, none reported; more than the limit, the limit.
    assert!(sample_host(&logits, &mut state(|_| {})).top.is_empty());
    let wide = noise(100, 4);
    let out = sample_host(&wide, &mut state(|p| p.top_logprobs = 50));
    assert_eq!(out.top.len(), MAX_TOP_LOGPROBS as usize);
    assert!(out.top.windows(2).all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0)), "{:?}", out.top);
}

#[test]
fn ids_past_the_vocab_limit_are_never_drawn_reported_or_normalised() {
    // Ids 3 and 4 dominate the row, but the vocabulary ends at 3.
    let logits = [0.0f32, 1.0, 0.5, 20.0, 30.0];
    let limited = |f: fn(&mut SampleParams)| {
        state(|p| {
            p.vocab_limit = 3;
            p.top_logprobs = 5;
            f(p)
        })
    };
    let mut g = limited(|p| p.temperature = 0.0);
    let out = sample_host(&logits, &mut g);
    assert_eq!(out.token, 1);
    let lse = (1f64 + 1f64.exp() + 0.5f64.exp()).ln();
    assert!((out.logprob as f64 - (1.0 - lse)).abs() < 1e-6, "{}", out.logprob);
    assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
    let h = histogram(limited(|p| p.temperature = 1.0).params, &logits, 3_000);
    assert_eq!(h[3] + h[4], 0, "{h:?}");
    assert!(h[0] > 0 && h[1] > 0 && h[2] > 0, "{h:?}");
    // 0 means the whole row; a limit past the row is the whole row.
    assert_eq!(sample_host(&logits, &mut state(|p| p.temperature = 0.0)).token, 4);
    assert_eq!(
        sample_host(
            &logits,
            &mut state(|p| {
                p.temperature = 0.0;
                p.vocab_limit = 99
            })
        )
        .token,
        4
    );
}

/// The one-pass top-k (`heaviest_k`, which skips the exponential of logits
/// that cannot enter) keeps exactly the ids and weights a full sort by
/// (weight descending, id ascending) keeps, on rows built to break it:
/// exact ties at the boundary, near ties a few ulps apart, peaked rows
/// whose k-th weight is subnormal or zero, NaN and -inf logits, min-p, k
/// from 1 to more than the survivors, low and high temperatures.
#[test]
fn one_pass_top_k_keeps_what_a_full_sort_keeps() {
    let full_sort = |row: &[f32], m: f32, inv_t: f32, min_p: f32, k: usize| {
        let mut c = weighed(row, m, inv_t, min_p);
        c.sort_by(heavier_first);
        c.truncate(k);
        c.sort_unstable_by_key(|x| x.0);
        c
    };
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for (n, salt) in [(40usize, 11u64), (1000, 12), (5000, 13)] {
        rows.push(noise(n, salt));
        // Quantised: many exact ties.
        rows.push(noise(n, salt + 100).iter().map(|x| (x * 2.0).round() / 2.0).collect());
        // Near ties: neighbours a few ulps apart.
        rows.push(noise(n, salt + 200).iter().enumerate().map(|(i, x)| f32::from_bits(x.to_bits().wrapping_add((i % 5) as u32))).collect());
        // Peaked: one huge logit, the rest 60-200 below (weights subnormal or 0 at T = 0.6).
        let mut peaked: Vec<f32> = noise(n, salt + 300).iter().map(|x| -130.0 + 35.0 * x).collect();
        peaked[n / 3] = 10.0;
        rows.push(peaked);
        // NaN and -inf sprinkled in.
        rows.push(
            noise(n, salt + 400)
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    if i % 7 == 3 {
                        f32::NAN
                    } else if i % 11 == 5 {
                        f32::NEG_INFINITY
                    } else {
                        x
                    }
                })
                .collect(),
        );
    }
    let mut checked = 0;
    for row in &rows {
        let m = row[first_max(row) as usize];
        for t in [0.05f32, 0.6, 1.0, 7.0] {
            for min_p in [0.0f32, 0.01, 0.3] {
                for k in [1usize, 2, 5, 20, 64, ONE_PASS_TOP_K.min(row.len() - 1)] {
                    let got = heaviest_k(row, m, 1.0 / t, min_p, k);
                    let want = full_sort(row, m, 1.0 / t, min_p, k);
                    let same = got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits());
                    assert!(same, "row of {}, T {t}, min_p {min_p}, k {k}: {got:?} vs {want:?}", row.len());
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, rows.len() * 4 * 3 * 6);
}

#[test]
fn a_draw_without_a_logprob_draws_the_same_and_skips_the_log_sum_exp() {
    let rows: Vec<Vec<f32>> = [(50usize, 21u64), (3000, 22)].iter().map(|&(n, salt)| noise(n, salt).iter().map(|x| 8.0 * x).collect()).collect();
    for row in &rows {
        for (top_k, top_p, top_logprobs, presence) in [(20u32, 0.95f32, 0u32, 0.0f32), (0, 0.9, 0, 0.5), (5, 1.0, 3, 0.0), (0, 1.0, 0, 0.0)] {
            for temperature in [0.0f32, 0.6] {
                let with = params(|p| {
                    p.temperature = temperature;
                    p.top_k = top_k;
                    p.top_p = top_p;
                    p.top_logprobs = top_logprobs;
                    p.presence_penalty = presence;
                    p.seed = 77;
                });
                let without = SampleParams { logprob: false, ..with };
                let (mut a, mut b) = (SampleState::new(with, &[]), SampleState::new(without, &[]));
                for step in 0..8 {
                    let (x, y) = (sample_host(row, &mut a), sample_host(row, &mut b));
                    let what = format!("n {} top_k {top_k} top_p {top_p} tops {top_logprobs} T {temperature} step {step}", row.len());
                    assert_eq!(x.token, y.token, "{what}: the same draw");
                    assert!(x.logprob.is_finite(), "{what}: logprob reported when asked for");
                    if top_logprobs == 0 {
                        assert!(y.logprob.is_nan(), "{what}: no logprob computed when nothing reads it");
                    } else {
                        // The alternatives need the log-sum-exp anyway: all reported as before.
                        assert_eq!(x.logprob.to_bits(), y.logprob.to_bits(), "{what}");
                        assert_eq!(x.top, y.top, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn draw_host_then_record_draw_is_sample_host() {
    // Penalties, a seed stream several draws in: the pure draw plus
    // record_draw must leave the same token, logprob and state as
    // sample_host, and the draw alone must not move the state.
    let logits = noise(5_000, 3);
    let p = params(|p| {
        p.temperature = 0.7;
        p.top_p = 0.9;
        p.top_k = 40;
        p.repetition_penalty = 1.3;
        p.logprob = true;
    });
    let mut a = SampleState::new(p, &[1, 2, 3, 1000]);
    let mut b = SampleState::new(p, &[1, 2, 3, 1000]);
    for _ in 0..5 {
        let want = sample_host(&logits, &mut a);
        let got = draw_host(&logits, &b);
        assert_eq!(draw_host(&logits, &b).token, got.token, "a pure draw repeats");
        b.record_draw(got.token);
        assert_eq!((got.token, got.logprob.to_bits()), (want.token, want.logprob.to_bits()));
        assert_eq!((a.step, a.last_draw()), (b.step, b.last_draw()));
        assert_eq!(Distribution::new(&logits, &a).logprob(7).to_bits(), Distribution::new(&logits, &b).logprob(7).to_bits(), "the same counts");
    }
}

#[test]
fn first_max_is_the_first_largest_non_nan_entry() {
    let naive = |v: &[f32]| {
        let mut best: Option<usize> = None;
        for (i, &x) in v.iter().enumerate() {
            if !x.is_nan() && best.is_none_or(|b| x > v[b]) {
                best = Some(i);
            }
        }
        best.unwrap_or(0) as u32
    };
    let mut rows: Vec<Vec<f32>> = vec![
        vec![],
        vec![f32::NAN; 40],
        vec![f32::NEG_INFINITY; 33],
        vec![f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY],
        vec![-0.0, 0.0, -0.0],
        vec![0.0, -0.0],
    ];
    for (n, salt) in [(17usize, 5u64), (1000, 6), (SKIP_BLOCK * 3 + 1, 7)] {
        let mut v = noise(n, salt);
        rows.push(v.clone());
        // NaN at the front and at the maximum's place, the maximum tied later.
        let m = naive(&v) as usize;
        v[0] = f32::NAN;
        let top = v[m];
        v[n - 1] = top;
        rows.push(v.clone());
        v[m] = f32::NAN;
        rows.push(v);
    }
    for v in &rows {
        assert_eq!(first_max(v), naive(v), "{} entries", v.len());
    }
}
