//! `agree` on real backends: a tiny BF16 checkpoint written by lily-synth,
//! its MLX 4-bit conversion, both on the CPU backend.

use std::path::Path;

use lily_core::config::Format;
use lily_cpu::CpuBackend;
use lily_engine::agree::{agree, AgreeError};
use lily_synth::{preset_config, quantize_checkpoint, write_synthetic, Plan, Preset};

const VOCAB: usize = 1024;

/// The tiny preset's architecture, 4 layers, a 1,024-token vocabulary.
fn write_bf16(dir: &Path) {
    let mut cfg = preset_config(Preset::Tiny, Some(4), Format::HfBf16).expect("tiny config");
    cfg.vocab_size = VOCAB;
    let cfg = cfg.validated().expect("small config");
    let plan = Plan::new(&cfg, 64 << 20).expect("plan");
    write_synthetic(&plan, 11, dir, &|_| {}).expect("synth");
}

fn text_tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761) >> 9) % VOCAB as u32).collect()
}

#[test]
fn quantised_model_against_its_reference() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (bf16, q4) = (tmp.path().join("bf16"), tmp.path().join("q4"));
    write_bf16(&bf16);
    quantize_checkpoint(&bf16, &q4, None).expect("quantize");
    let mut reference = CpuBackend::open(&bf16, None).expect("open bf16");
    let mut model = CpuBackend::open(&q4, None).expect("open q4");
    let tokens = text_tokens(100);

    // Against itself: exact agreement, no difference (100 positions span two
    // chunks of the comparison loop).
    let mut same = CpuBackend::open(&bf16, None).expect("open bf16 again");
    let r = agree(&mut same, &mut reference, &tokens, 100).expect("agree");
    assert_eq!((r.positions, r.top1_matches), (100, 100));
    assert_eq!(r.mean_abs_dlogprob, 0.0);

    let r = agree(&mut model, &mut reference, &tokens, 100).expect("agree");
    eprintln!("{}", r.to_text());
    assert_eq!(r.positions, 100);
    assert!(r.mean_abs_dlogprob > 0.0 && r.mean_abs_dlogprob.is_finite(), "{r:?}");
    assert!(r.max_abs_dlogprob >= r.p99_abs_dlogprob && r.p99_abs_dlogprob >= 0.0);
    assert!(r.top1_agreement_pct > 50.0, "4-bit and BF16 barely agree: {r:?}");
    assert!((r.top1_agreement_pct - 100.0 * r.top1_matches as f64 / 100.0).abs() < 1e-9);

    // Sequences are freed: the backends can run the check again.
    let again = agree(&mut model, &mut reference, &tokens, 100).expect("agree again");
    assert_eq!(again, r);

    // Refusals.
    assert!(matches!(agree(&mut model, &mut reference, &tokens, 101), Err(AgreeError::Input(_))));
    assert!(matches!(agree(&mut model, &mut reference, &[5, VOCAB as u32], 2), Err(AgreeError::Input(_))));
    assert!(matches!(agree(&mut model, &mut reference, &tokens, 0), Err(AgreeError::Input(_))));
}
