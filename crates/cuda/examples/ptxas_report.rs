//! The compiler's resource report of the kernels, without a GPU: registers,
//! shared memory, stack frame and spills of every entry point of the named
//! families (all families if none), compiled with NVRTC for sm_90a at the
//! production shape. Read this before and after a kernel change.
//!
//!   cargo run -p lily-cuda --release --example ptxas_report [--cubin DIR] [family ...]
//!
//! `--cubin DIR` also writes each family's cubin to DIR/NAME.cubin, for
//! `nvdisasm -c` (instruction counts of an inner loop without a GPU).
//! ptxas's performance advisories are printed too (e.g. C7513: wgmma groups
//! serialised because registers they read are written while one is in
//! flight), so a kernel change that costs the overlap shows here.

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
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cubin_dir = match args.iter().position(|a| a == "--cubin") {
        Some(i) if i + 1 < args.len() => {
            let dir = args.remove(i + 1);
            args.remove(i);
            Some(std::path::PathBuf::from(dir))
        }
        Some(_) => {
            eprintln!("--cubin needs a directory");
            std::process::exit(1);
        }
        None => None,
    };
    let wanted = args;
    for f in FAMILIES.iter().filter(|f| wanted.is_empty() || wanted.iter().any(|w| w == f.name)) {
        match compile_family(f, &dims, &["--ptxas-options=-v".to_string()]) {
            Ok(c) => {
                for line in c
                    .log
                    .lines()
                    .filter(|l| l.contains("Compiling entry") || l.contains("Used") || l.contains("spill") || l.contains("Performance") || l.contains("wgmma"))
                {
                    println!("{}.cu {}", f.name, line.trim());
                }
                if let Some(dir) = &cubin_dir {
                    let path = dir.join(format!("{}.cubin", f.name));
                    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, &c.cubin)) {
                        eprintln!("{}: {e}", path.display());
                        std::process::exit(1);
                    }
                }
            }
            Err(e) => println!("{}.cu: {e}", f.name),
        }
    }
}
