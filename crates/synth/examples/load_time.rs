//! Times `Weights::load` of a checkpoint directory (the number the issue-2
//! note reports for `lily synth --preset full`), and with `--touch` also a
//! full read of every mapped tensor byte, which is what a backend's upload
//! costs on top when the files are not yet in the page cache.
//!
//! `cargo run --release -p lily-synth --example load_time -- DIR [--touch]`

use std::time::Instant;

use lily_core::weights::Weights;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: load_time DIR [--touch]")?;
    let touch = args.next().as_deref() == Some("--touch");
    let start = Instant::now();
    let w = Weights::load(std::path::Path::new(&dir))?;
    let load = start.elapsed().as_secs_f64();
    let bytes = w.store.data_bytes();
    println!("Weights::load {dir}: {load:.3} s ({} layers, {} tensor bytes in {} files)", w.layers.len(), bytes, w.store.files().len());
    if touch {
        let start = Instant::now();
        let mut sum = 0u64;
        for name in w.store.names() {
            if let Some(t) = w.store.peek(name) {
                // One byte per 4 KiB page is enough to fault every page in.
                sum += t.bytes().iter().step_by(4096).map(|b| *b as u64).sum::<u64>();
            }
        }
        let secs = start.elapsed().as_secs_f64();
        println!("read every page: {secs:.2} s ({:.2} GB/s; checksum {sum})", bytes as f64 / secs / 1e9);
    }
    Ok(())
}
