//! The engine on the real CPU backend (a tiny MLX 4-bit checkpoint written
//! by lily-synth): what the fake backend cannot show, that restoring a
//! prefix from a forked DeltaNet + KV snapshot, chunked prefill and batched
//! decode all give the same greedy tokens as one plain request.

mod support;

use std::path::Path;

use lily_core::config::Format;
use lily_cpu::CpuBackend;
use lily_engine::{Engine, EngineHandle, EngineOptions, GenerateRequest, SamplingParams};
use lily_synth::{preset_config, write_synthetic, Plan, Preset};
use support::{collect, tokenizer};

const VOCAB: usize = 1024;

fn write_q4(dir: &Path) {
    let mut cfg = preset_config(Preset::Tiny, Some(4), Format::MlxQ4).expect("tiny config");
    cfg.vocab_size = VOCAB;
    let cfg = cfg.validated().expect("small config");
    let plan = Plan::new(&cfg, 64 << 20).expect("plan");
    write_synthetic(&plan, 5, dir, &|_| {}).expect("synth");
}

fn engine(dir: &Path, opts: EngineOptions) -> EngineHandle {
    let backend = CpuBackend::open(dir, None).expect("open");
    Engine::start(Box::new(backend), tokenizer(), opts).expect("engine")
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) >> 9).wrapping_add(salt * 101)) % VOCAB as u32).collect()
}

fn greedy(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest { sampling: SamplingParams::greedy(), ..GenerateRequest::new(prompt, 12) }
}

#[test]
fn cache_chunking_and_batching_do_not_change_greedy_tokens() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_q4(tmp.path());
    let prompts: Vec<Vec<u32>> = (0..3).map(|s| prompt(40, s)).collect();

    // One request at a time, whole-prompt prefill, no cache.
    let plain = engine(tmp.path(), EngineOptions { prefix_cache_tokens: 0, prefill_chunk: 4096, max_batch: 1, ..EngineOptions::default() });
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| collect(plain.submit(greedy(p.clone())).expect("submit")).ids).collect();
    assert!(solo.iter().all(|ids| ids.len() == 12));

    // Small chunks, snapshots every 16 tokens, all three at once.
    let fancy = engine(tmp.path(), EngineOptions { prefix_cache_tokens: 10_000, snapshot_interval: 16, prefill_chunk: 8, ..EngineOptions::default() });
    let streams: Vec<_> = prompts.iter().map(|p| fancy.submit(greedy(p.clone())).expect("submit")).collect();
    let batched: Vec<_> = streams.into_iter().map(|s| std::thread::spawn(move || collect(s))).collect();
    for (i, t) in batched.into_iter().enumerate() {
        assert_eq!(t.join().expect("collector").ids, solo[i], "batched request {i}");
    }
    assert!(fancy.stats().decode_batch_sizes.iter().skip(2).sum::<u64>() > 0);

    // Again: restored from the 32-token snapshots.
    for (i, p) in prompts.iter().enumerate() {
        let c = collect(fancy.submit(greedy(p.clone())).expect("submit"));
        assert_eq!(c.cached_tokens, 32);
        assert_eq!(c.ids, solo[i], "cached request {i}");
    }

    // A second turn reuses the snapshot taken while decoding the first.
    let mut turn2 = prompts[0].clone();
    turn2.extend(&solo[0]);
    turn2.extend(prompt(5, 9));
    let expect = collect(plain.submit(greedy(turn2.clone())).expect("submit")).ids;
    let c = collect(fancy.submit(greedy(turn2)).expect("submit"));
    assert_eq!(c.cached_tokens, 48);
    assert_eq!(c.ids, expect);
}
