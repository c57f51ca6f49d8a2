//! Time of turning one chat request into prompt tokens (`render_tokens`:
//! the template rendered with and without markers, then the encode), the
//! host work before a request reaches the engine.
//!
//!   cargo run -p lily-core --release --example render_bench -- CHECKPOINT_DIR [TEXT_FILE]
//!
//! With TEXT_FILE it also times `encode` of that file's text (e.g. source
//! code or prose whose words are mostly not in the BPE model's cache yet).
use std::path::Path;
use std::time::Instant;

use lily_core::chat::{ChatMessage, ChatRenderRequest, ChatTemplate};
use lily_core::tokenizer::Tokenizer;

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| {
        eprintln!("usage: render_bench CHECKPOINT_DIR");
        std::process::exit(2)
    });
    let dir = Path::new(&dir);
    let tok = Tokenizer::from_dir(dir).expect("tokenizer");
    let tmpl = ChatTemplate::from_dir(dir).expect("chat template");
    // ~256 prompt tokens of common words, as scripts/serve_bench.py sends.
    const WORDS: &[&str] =
        &["the", "of", "and", "to", "in", "is", "was", "for", "on", "as", "with", "by", "at", "from", "that", "this", "people", "years", "world", "city"];
    let body: Vec<&str> = (0..238).map(|i| WORDS[(i * 7 + i / 3) % WORDS.len()]).collect();
    let req = ChatRenderRequest { messages: vec![ChatMessage::user(format!("Request 1.\n{}", body.join(" ")))], ..Default::default() };
    let n = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let mut phases = [0f64; 3];
    let mut len = 0;
    for _ in 0..n {
        let t0 = Instant::now();
        let text = tmpl.render(&req).expect("render");
        let t1 = Instant::now();
        let ids = tok.encode_with_specials(&text).expect("encode");
        let t2 = Instant::now();
        let ids2 = tmpl.render_tokens(&req, &tok).expect("render_tokens");
        let t3 = Instant::now();
        assert_eq!(ids, ids2);
        len = ids.len();
        phases[0] += (t1 - t0).as_secs_f64();
        phases[1] += (t2 - t1).as_secs_f64();
        phases[2] += (t3 - t2).as_secs_f64();
    }
    let us = |s: f64| s / n as f64 * 1e6;
    println!(
        "{len} prompt tokens: render {:.0} us, encode {:.0} us; render_tokens (two renders + encode) {:.0} us",
        us(phases[0]),
        us(phases[1]),
        us(phases[2])
    );
    if let Some(file) = std::env::args().nth(2) {
        let text = std::fs::read_to_string(&file).expect("text file");
        for pass in ["first", "second"] {
            let t0 = Instant::now();
            let ids = tok.encode(&text).expect("encode");
            let took = t0.elapsed();
            println!(
                "{file}: {} bytes, {} tokens, {pass} encode {:.1} ms ({:.0} ns a byte)",
                text.len(),
                ids.len(),
                took.as_secs_f64() * 1e3,
                took.as_secs_f64() * 1e9 / text.len() as f64
            );
        }
    }
}
