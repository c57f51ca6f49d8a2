//! The Backend contract on a tiny synthetic model, for both forwards:
//! prefill-then-decode equals one long prefill, forks continue identically,
//! a decode batch equals its sequences decoded alone, the fast path equals
//! the reference, and bad requests are refused without touching state.

mod common;

use std::sync::Arc;

use lily_core::weights::Weights;
use lily_core::Format;
use lily_cpu::CpuBackend;
use lily_model::{Backend, LogitsWanted, MixedSteps, ModelError};

fn backends(w: &Arc<Weights>) -> Vec<(&'static str, CpuBackend)> {
    vec![("reference", CpuBackend::reference(w.clone())), ("fast", CpuBackend::new(w.clone()).unwrap())]
}

/// Differences allowed between two computations of the same logits that
/// differ only in f32 summation order: 1e-4 of the logits' scale.
fn assert_close(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    let diff = common::max_abs_diff(a, b);
    let scale = common::max_abs(a).max(1.0);
    assert!(diff <= 1e-4 * scale, "{what}: logits differ by {diff} (scale {scale})");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(common::argmax(x), common::argmax(y), "{what}: top-1 differs at position {i}");
    }
}

#[test]
fn prefill_then_decode_equals_one_long_prefill() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 3);
    let all = common::tokens(90, w.config.vocab_size, 4);
    for (name, mut be) in backends(&w) {
        let long = be.alloc().unwrap();
        let want = be.prefill(long, &all, LogitsWanted::All).unwrap();
        assert_eq!(want.len(), all.len());

        let s = be.alloc().unwrap();
        let split = 70;
        let mut got = be.prefill(s, &all[..split], LogitsWanted::All).unwrap();
        for &t in &all[split..] {
            got.extend(be.decode(&[(s, t)]).unwrap());
        }
        assert_eq!(be.seq_len(s).unwrap(), all.len());
        assert_close(&format!("{name}: prefill+decode vs prefill"), &want, &got);

        // `Last` returns exactly the last row of `All`.
        let s2 = be.alloc().unwrap();
        let last = be.prefill(s2, &all, LogitsWanted::Last).unwrap();
        assert_eq!(last.len(), 1);
        assert_close(&format!("{name}: Last vs All"), &want[want.len() - 1..], &last);
    }
}

#[test]
fn fast_prefill_across_its_chunk_boundary_equals_the_reference() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 5);
    let n = lily_cpu::PREFILL_CHUNK + 30;
    let prompt = common::tokens(n, w.config.vocab_size, 6);
    let mut reference = CpuBackend::reference(w.clone());
    let mut fast = CpuBackend::new(w.clone()).unwrap();
    let (a, b) = (reference.alloc().unwrap(), fast.alloc().unwrap());
    let la = reference.prefill(a, &prompt, LogitsWanted::All).unwrap();
    let lb = fast.prefill(b, &prompt, LogitsWanted::All).unwrap();
    assert_eq!(lb.len(), n);
    assert_close("fast vs reference over a long prompt", &la, &lb);
}

#[test]
fn fast_equals_reference_in_both_formats() {
    for format in [Format::MlxQ4, Format::HfBf16] {
        let (_dir, w) = common::tiny(format, 8, 7);
        let prompt = common::tokens(40, w.config.vocab_size, 8);
        let mut reference = CpuBackend::reference(w.clone());
        let mut fast = CpuBackend::new(w.clone()).unwrap();
        let (a, b) = (reference.alloc().unwrap(), fast.alloc().unwrap());
        let la = reference.prefill(a, &prompt, LogitsWanted::All).unwrap();
        let lb = fast.prefill(b, &prompt, LogitsWanted::All).unwrap();
        assert_close(&format!("{format:?} prefill"), &la, &lb);
        // Greedy continuation: both pick the same tokens and logits agree.
        let mut token = common::argmax(la.last().unwrap()) as u32;
        for step in 0..6 {
            let da = reference.decode(&[(a, token)]).unwrap();
            let db = fast.decode(&[(b, token)]).unwrap();
            assert_close(&format!("{format:?} decode step {step}"), &da, &db);
            token = common::argmax(&da[0]) as u32;
        }
    }
}

#[test]
fn forks_continue_identically_and_batches_equal_single_decodes() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 9);
    let prompt = common::tokens(20, w.config.vocab_size, 10);
    let cont = common::tokens(5, w.config.vocab_size, 11);
    for (name, mut be) in backends(&w) {
        let s = be.alloc().unwrap();
        be.prefill(s, &prompt, LogitsWanted::Last).unwrap();
        let f = be.fork(s).unwrap();
        let f2 = be.fork(s).unwrap();
        assert_eq!(be.seq_len(f).unwrap(), prompt.len());
        let other = be.alloc().unwrap();
        be.prefill(other, &prompt[..7], LogitsWanted::Last).unwrap();
        let mut probe = CpuBackend::reference(w.clone());
        let p = probe.alloc().unwrap();
        probe.prefill(p, &prompt[..7], LogitsWanted::Last).unwrap();
        for &t in &cont {
            // Same call shape: a fork reproduces its parent bit for bit.
            let a = be.decode(&[(s, t)]).unwrap();
            let b = be.decode(&[(f, t)]).unwrap();
            assert_eq!(a, b, "{name}: fork diverged from its parent");
            // In a batch with an unrelated sequence: each row equals that
            // sequence decoded alone (up to summation order).
            let batch = be.decode(&[(other, t), (f2, t)]).unwrap();
            assert_close(&format!("{name}: batched fork vs parent"), &a, &batch[1..]);
            let alone = probe.decode(&[(p, t)]).unwrap();
            assert_close(&format!("{name}: batched sequence vs alone"), &alone, &batch[..1]);
        }
        // Freeing the parent leaves the fork intact.
        be.free(s);
        assert!(be.seq_len(s).is_err());
        assert_eq!(be.seq_len(f).unwrap(), prompt.len() + cont.len());
    }
}

#[test]
fn prefill_batch_equals_prefilling_each_sequence_alone() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 14);
    let vocab = w.config.vocab_size;
    // A fresh sequence, one continuing 20 tokens it already holds, and a
    // short one; lengths cross the DeltaNet chunk of 64.
    let head = common::tokens(20, vocab, 15);
    let parts: Vec<Vec<u32>> = [70usize, 90, 5].iter().enumerate().map(|(k, &n)| common::tokens(n, vocab, 16 + k as u64)).collect();
    for (name, mut be) in backends(&w) {
        let batch: Vec<_> = (0..3).map(|_| be.alloc().unwrap()).collect();
        let alone: Vec<_> = (0..3).map(|_| be.alloc().unwrap()).collect();
        be.prefill(batch[1], &head, LogitsWanted::Last).unwrap();
        be.prefill(alone[1], &head, LogitsWanted::Last).unwrap();
        let work: Vec<(lily_model::SeqId, &[u32])> = batch.iter().zip(&parts).map(|(s, p)| (*s, &p[..])).collect();
        let got = be.prefill_batch(&work).unwrap();
        let want: Vec<Vec<f32>> = alone.iter().zip(&parts).map(|(s, p)| be.prefill(*s, p, LogitsWanted::Last).unwrap().remove(0)).collect();
        assert_close(&format!("{name}: prefill_batch vs alone"), &got, &want);
        let lens: Vec<usize> = batch.iter().map(|s| be.seq_len(*s).unwrap()).collect();
        assert_eq!(lens, vec![70, 110, 5], "{name}");
        // The states match too: the next decode step agrees.
        let next: Vec<_> = batch.iter().map(|s| (*s, 7)).collect();
        let solo: Vec<_> = alone.iter().map(|s| (*s, 7)).collect();
        assert_close(&format!("{name}: decode after prefill_batch"), &be.decode(&next).unwrap(), &be.decode(&solo).unwrap());

        // A refusal in any part changes no sequence.
        let mut small = backends(&w).into_iter().find(|b| b.0 == name).unwrap().1.with_max_seq_len(50);
        let (a, b) = (small.alloc().unwrap(), small.alloc().unwrap());
        let err = small.prefill_batch(&[(a, &parts[2]), (b, &parts[0])]).unwrap_err();
        assert!(matches!(err, ModelError::Capacity(_)), "{name}: {err}");
        let err = small.prefill_batch(&[(a, &parts[2]), (b, &[1, vocab as u32])]).unwrap_err();
        assert!(matches!(err, ModelError::Invalid(_)), "{name}: {err}");
        let err = small.prefill_batch(&[(a, &parts[2]), (a, &parts[2])]).unwrap_err();
        assert!(matches!(err, ModelError::Invalid(_)), "{name}: {err}");
        assert_eq!((small.seq_len(a).unwrap(), small.seq_len(b).unwrap()), (0, 0), "{name}");
    }
}

#[test]
fn decode_rows_in_a_prefill_batch_equal_decode_steps() {
    // A mixed step's call: a prompt longer than one forward's piece (so
    // it spans several forwards) beside one-token parts of sequences that
    // hold a context. Each part equals its own prefill or decode step, and
    // the sequences go on alike.
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 21);
    let vocab = w.config.vocab_size;
    let ctx = common::tokens(40, vocab, 22);
    let long = common::tokens(lily_cpu::PREFILL_CHUNK + 50, vocab, 23);
    for (name, mut be) in backends(&w) {
        let mixed: Vec<_> = (0..3).map(|_| be.alloc().unwrap()).collect();
        let apart: Vec<_> = (0..3).map(|_| be.alloc().unwrap()).collect();
        for s in [mixed[1], apart[1]] {
            be.prefill(s, &ctx, LogitsWanted::Last).unwrap();
        }
        for s in [mixed[2], apart[2]] {
            be.prefill(s, &ctx[..13], LogitsWanted::Last).unwrap();
        }
        let got = be.prefill_batch(&[(mixed[1], &[5]), (mixed[0], &long), (mixed[2], &[9])]).unwrap();
        let want = vec![
            be.decode(&[(apart[1], 5)]).unwrap().remove(0),
            be.prefill(apart[0], &long, LogitsWanted::Last).unwrap().remove(0),
            be.decode(&[(apart[2], 9)]).unwrap().remove(0),
        ];
        assert_close(&format!("{name}: decode rows and a long prompt in one prefill_batch"), &got, &want);
        let lens: Vec<usize> = mixed.iter().map(|s| be.seq_len(*s).unwrap()).collect();
        assert_eq!(lens, vec![long.len(), 41, 14], "{name}");
        let next: Vec<_> = mixed.iter().map(|s| (*s, 7)).collect();
        let solo: Vec<_> = apart.iter().map(|s| (*s, 7)).collect();
        assert_close(&format!("{name}: decode after the mixed call"), &be.decode(&next).unwrap(), &be.decode(&solo).unwrap());
        // Only the fast path says mixing pays: the reference runs part by
        // part.
        let said = be.mixed_steps(2);
        assert_eq!(said == MixedSteps::Pays, name == "fast", "{name}: {said:?}");
        assert_eq!(said == MixedSteps::Never, name == "reference", "{name}: {said:?}");
    }
}

#[test]
fn bad_requests_are_refused_and_leave_state_alone() {
    let (_dir, w) = common::tiny(Format::MlxQ4, 4, 12);
    let vocab = w.config.vocab_size as u32;
    for (name, be) in backends(&w) {
        let mut be = be.with_max_seq_len(10).with_max_sequences(2);
        assert_eq!(be.max_seq_len(), 10);
        let s = be.alloc().unwrap();
        be.prefill(s, &[1, 2, 3], LogitsWanted::Last).unwrap();

        let err = be.prefill(s, &[1; 8], LogitsWanted::Last).unwrap_err();
        assert!(matches!(err, ModelError::Capacity(_)), "{name}: {err}");
        assert_eq!(be.seq_len(s).unwrap(), 3);

        let err = be.prefill(s, &[1, vocab], LogitsWanted::Last).unwrap_err();
        assert!(matches!(err, ModelError::Invalid(_)), "{name}: {err}");
        let err = be.decode(&[(s, vocab + 5)]).unwrap_err();
        assert!(matches!(err, ModelError::Invalid(_)), "{name}: {err}");
        let err = be.decode(&[(s, 1), (s, 2)]).unwrap_err();
        assert!(matches!(err, ModelError::Invalid(_)), "{name}: {err}");
        assert_eq!(be.seq_len(s).unwrap(), 3);

        let err = be.decode(&[(s, 1), (lily_model::SeqId(999), 2)]).unwrap_err();
        assert!(matches!(err, ModelError::UnknownSequence(_)), "{name}: {err}");
        assert_eq!(be.seq_len(s).unwrap(), 3, "{name}: a failed batch advanced a sequence");

        let _second = be.fork(s).unwrap();
        assert!(matches!(be.alloc().unwrap_err(), ModelError::Capacity(_)), "{name}");
        assert!(matches!(be.fork(s).unwrap_err(), ModelError::Capacity(_)), "{name}");

        // Up to the limit exactly is fine.
        be.prefill(s, &[4; 7], LogitsWanted::Last).unwrap();
        assert!(matches!(be.decode(&[(s, 1)]).unwrap_err(), ModelError::Capacity(_)), "{name}");
    }
}
