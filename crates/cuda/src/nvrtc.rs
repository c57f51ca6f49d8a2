//! NVRTC: finding the library and compiling one kernel family to a cubin.
//!
//! On a GPU machine libnvrtc is found by the loader like libcuda. Elsewhere
//! (CI, development machines) the pip wheel `nvidia-cuda-nvrtc` provides it
//! under `site-packages/nvidia/cu13/lib`; it is located through the
//! `LILY_NVRTC_LIB` environment variable (the library file or its folder) or
//! by asking `python3` where the `nvidia` package lives, and preloaded, so
//! that cudarc's own lookup by soname finds it. Kernels need no CUDA header
//! (see kernels/common.cuh), so no include directory is required.
//!
//! This module does not know the kernel families or the model; kernels.rs
//! does.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{CudaError, CudaResult};

/// The target every kernel is compiled for: Hopper with its
/// architecture-specific features.
pub const ARCH: &str = "sm_90a";

static PRELOADED: OnceLock<Result<(), String>> = OnceLock::new();

const INSTALL_HINT: &str = "install the pip wheels: python3 -m pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
     (or set LILY_NVRTC_LIB to the folder holding libnvrtc.so.13)";

/// Folders that may hold libnvrtc.so.13 besides the loader's own path.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(v) = std::env::var("LILY_NVRTC_LIB") {
        let p = PathBuf::from(v);
        if p.is_file() {
            if let Some(d) = p.parent() {
                dirs.push(d.to_path_buf());
            }
        } else {
            dirs.push(p);
        }
    }
    if let Some(nvidia) = python_nvidia_dir() {
        dirs.push(nvidia.join("cu13").join("lib"));
        dirs.push(nvidia.join("cuda_nvrtc").join("lib"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// `site-packages/nvidia` of the first python3 on PATH, if it has one.
pub fn python_nvidia_dir() -> Option<PathBuf> {
    let out = std::process::Command::new("python3").args(["-c", "import nvidia, sys; sys.stdout.write(list(nvidia.__path__)[0])"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    let p = PathBuf::from(s.trim());
    p.is_dir().then_some(p)
}

/// A CUDA include folder (only used for diagnostics and for kernels that
/// might include headers; ours do not).
pub fn cuda_include_dir() -> Option<PathBuf> {
    if let Ok(v) = std::env::var("LILY_CUDA_INCLUDE") {
        let p = PathBuf::from(v);
        if p.is_dir() {
            return Some(p);
        }
    }
    let sys_inc = PathBuf::from("/usr/local/cuda/include");
    if sys_inc.join("cuda_bf16.h").is_file() {
        return Some(sys_inc);
    }
    let inc = python_nvidia_dir()?.join("cu13").join("include");
    inc.join("cuda_bf16.h").is_file().then_some(inc)
}

fn preload_from(dir: &Path) -> Result<(), String> {
    let builtins = dir.join("libnvrtc-builtins.so.13.0");
    let main = dir.join("libnvrtc.so.13");
    if !main.is_file() {
        return Err(format!("{} not found", main.display()));
    }
    for lib in [&builtins, &main] {
        if !lib.is_file() {
            continue;
        }
        // SAFETY: loading NVRTC runs its initialisers, which have no
        // preconditions; the handle is leaked on purpose so the library stays
        // loaded for the life of the process (cudarc resolves symbols later).
        let handle = unsafe { libloading::os::unix::Library::open(Some(lib), libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL) }
            .map_err(|e| format!("{}: {e}", lib.display()))?;
        std::mem::forget(handle);
    }
    Ok(())
}

/// Makes sure NVRTC can be loaded; returns a clear error naming how to
/// install it otherwise. Safe to call many times.
pub fn ensure_nvrtc() -> CudaResult<()> {
    let r = PRELOADED.get_or_init(|| {
        // SAFETY: probing dlopen of candidate names; no symbol is used.
        if unsafe { sys::is_culib_present() } {
            return Ok(());
        }
        let mut tried = Vec::new();
        for dir in candidate_dirs() {
            match preload_from(&dir) {
                Ok(()) => {
                    // SAFETY: as above.
                    if unsafe { sys::is_culib_present() } {
                        return Ok(());
                    }
                    tried.push(format!("{} (loaded, but not found by soname)", dir.display()));
                }
                Err(e) => tried.push(e),
            }
        }
        Err(format!("libnvrtc.so.13 not found (tried: {}); {INSTALL_HINT}", tried.join("; ")))
    });
    r.clone().map_err(CudaError::NvrtcMissing)
}

/// NVRTC's version (major, minor).
pub fn version() -> CudaResult<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (ensure_nvrtc); the out-pointers are valid.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, what: &str) -> CudaResult<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::NvrtcMissing(format!("{what} returned {r:?}")))
    }
}

/// What one compilation produced.
pub struct Compiled {
    /// The sm_90a cubin, loadable with cuModuleLoadData.
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings; ptxas resource usage when asked for).
    pub log: String,
}

/// Compiles `source` (named `name` in messages) for sm_90a with `options`
/// (defines etc.; the architecture is added here).
pub fn compile(name: &str, source: &str, options: &[String]) -> CudaResult<Compiled> {
    ensure_nvrtc()?;
    let src = CString::new(source).map_err(|_| CudaError::Compile { file: name.into(), log: "source contains a NUL byte".into() })?;
    let cname = CString::new(name).map_err(|_| CudaError::Compile { file: name.into(), log: "name contains a NUL byte".into() })?;
    let mut opts: Vec<CString> = Vec::with_capacity(options.len() + 2);
    opts.push(CString::new(format!("--gpu-architecture={ARCH}")).unwrap_or_default());
    opts.push(CString::new("-std=c++17").unwrap_or_default());
    for o in options {
        opts.push(CString::new(o.as_str()).map_err(|_| CudaError::Compile { file: name.into(), log: format!("option {o:?} contains a NUL byte") })?);
    }
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the source and name strings outlive the program (dropped at the
    // end of this function, after nvrtcDestroyProgram); no headers passed.
    let r = unsafe { sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()) };
    check(r, "nvrtcCreateProgram")?;
    let result = (|| {
        // SAFETY: prog was created above; option pointers point into `opts`,
        // alive for the call.
        let rc = unsafe { sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
        let log = program_log(prog);
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(CudaError::Compile { file: name.into(), log: if log.is_empty() { format!("{rc:?}") } else { log } });
        }
        let mut size = 0usize;
        // SAFETY: prog compiled successfully; size is a valid out-pointer.
        check(unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }, "nvrtcGetCUBINSize")?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds exactly the size NVRTC reported.
        check(unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }, "nvrtcGetCUBIN")?;
        Ok(Compiled { cubin, log })
    })();
    // SAFETY: prog is a valid program created above and destroyed once.
    let _ = unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: prog is a valid program; size is a valid out-pointer.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS || size <= 1 {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer has the size NVRTC reported.
    if unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) } != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    while buf.last() == Some(&0) {
        buf.pop();
    }
    String::from_utf8_lossy(&buf).into_owned()
}
