//! The compiler's resource report of the kernels, without a GPU: registers,
//! shared memory, stack frame and spills of every entry point of the named
//! families (all families if none), compiled with NVRTC for sm_90a at the
//! production shape. Read this before and after a kernel change.
//!
//!   cargo run -p lily-cuda --release --example ptxas_report [family ...]

use lily_core::config::production;
use lily_cuda::dims::Dims;
use lily_cuda::kernels::{compile_family, FAMILIES};
use lily_cuda::nvrtc;

fn main() {
    if let Err(e) = nvrtc::ensure_nvrtc() {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let dims = match Dims::from_config(&production()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    for f in FAMILIES.iter().filter(|f| wanted.is_empty() || wanted.iter().any(|w| w == f.name)) {
        match compile_family(f, &dims, &["--ptxas-options=-v".to_string()]) {
            Ok(c) => {
                for line in c.log.lines().filter(|l| l.contains("Compiling entry") || l.contains("Used") || l.contains("spill")) {
                    println!("{}.cu {}", f.name, line.trim());
                }
            }
            Err(e) => println!("{}.cu: {e}", f.name),
        }
    }
}
