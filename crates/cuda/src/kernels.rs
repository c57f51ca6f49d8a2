//! The kernel families, compiled by NVRTC and loaded into a context.
//!
//! Each family is one `kernels/<family>.cu` (beside its launcher
//! `<family>.rs`), compiled with `kernels/common.cuh` in front and the
//! model's dimensions as defines (dims.rs). Compiled cubins are cached per
//! process by (family, defines), so a second backend of the same shape (or a
//! test) does not compile again. `Kernels` holds the loaded functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{result, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::device::Gpu;
use crate::dims::Dims;
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::nvrtc;
use crate::qmm::QmmShape;

/// One kernel source file and the entry points it defines.
pub struct Family {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

pub const COMMON: &str = include_str!("kernels/common.cuh");

pub const FAMILIES: &[Family] = &[
    Family { name: "embed", source: include_str!("kernels/embed.cu"), kernels: &["embed_q4"] },
    Family { name: "qmm", source: include_str!("kernels/qmm.cu"), kernels: crate::qmm::KERNELS },
    Family { name: "moe", source: include_str!("kernels/moe.cu"), kernels: &["moe_route_plan", "moe_scatter", "moe_combine"] },
    Family {
        name: "gdn",
        source: include_str!("kernels/gdn.cu"),
        kernels: &[
            "gdn_decode",
            "gdn_decode_split",
            "gdn_prefill_prep",
            "gdn_conv_store",
            "gdn_chunk_wu",
            "gdn_chunk_state",
            "gdn_chunk_out",
            "gdn_gated_norm",
        ],
    },
    Family {
        name: "attention",
        source: include_str!("kernels/attention.cu"),
        kernels: &["attn_prep", "attn_decode", "attn_combine", "attn_combine_rows", "attn_prefill"],
    },
    Family { name: "gemm", source: include_str!("kernels/gemm.cu"), kernels: crate::gemm::KERNELS },
    Family { name: "hgemm", source: include_str!("kernels/hgemm.cu"), kernels: crate::hgemm::KERNELS },
    Family {
        name: "sampling",
        source: include_str!("kernels/sampling.cu"),
        kernels: &["argmax_finish", "argmax_rows", "sample_rows", "sample_fast_chunks", "sample_fast_finish", "sample_fast_probe"],
    },
    Family { name: "feed", source: include_str!("kernels/feed.cu"), kernels: &["feed_stage"] },
    Family { name: "synth", source: include_str!("kernels/synth.cu"), kernels: &["fill_random"] },
];

/// The full text NVRTC compiles for a family: common header, then the
/// family, with a #line so that errors name the family's own lines.
pub fn full_source(f: &Family) -> String {
    format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", f.name, f.source)
}

/// Compiles one family for `dims` and the default decode-matrix shape;
/// `extra` adds options (e.g. ptxas -v).
pub fn compile_family(f: &Family, dims: &Dims, extra: &[String]) -> CudaResult<nvrtc::Compiled> {
    compile_family_shaped(f, dims, &QmmShape::default(), extra)
}

/// Compiles one family for `dims` and the decode-matrix shape `qmm`.
pub fn compile_family_shaped(f: &Family, dims: &Dims, qmm: &QmmShape, extra: &[String]) -> CudaResult<nvrtc::Compiled> {
    let mut opts = dims.defines();
    opts.extend(qmm.defines());
    opts.extend(crate::moe::defines());
    opts.extend(extra.iter().cloned());
    nvrtc::compile(&format!("{}.cu", f.name), &full_source(f), &opts)
}

type Cubins = Arc<Vec<(&'static str, Vec<u8>)>>;

fn cache() -> &'static Mutex<HashMap<Vec<String>, Cubins>> {
    static CACHE: OnceLock<Mutex<HashMap<Vec<String>, Cubins>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles every family for `dims`, the decode-matrix shape `qmm` and
/// `extra` defines (in parallel threads; NVRTC programs are independent), or
/// returns the cached cubins.
pub fn compile_all(dims: &Dims, qmm: &QmmShape, extra: &[String]) -> CudaResult<Cubins> {
    let mut key = dims.defines();
    key.extend(qmm.defines());
    key.extend(extra.iter().cloned());
    // Held while compiling, so concurrent callers of one shape compile once.
    let mut guard = cache().lock().map_err(|_| CudaError::NvrtcMissing("kernel cache lock poisoned".into()))?;
    if let Some(v) = guard.get(&key) {
        return Ok(v.clone());
    }
    nvrtc::ensure_nvrtc()?;
    let results: Vec<CudaResult<(&'static str, Vec<u8>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = FAMILIES.iter().map(|f| s.spawn(move || compile_family_shaped(f, dims, qmm, extra).map(|c| (f.name, c.cubin)))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(CudaError::NvrtcMissing("a compile thread panicked".into())))).collect()
    });
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        out.push(r?);
    }
    let out = Arc::new(out);
    guard.insert(key, out.clone());
    Ok(out)
}

/// Every entry point, loaded into one context, and the shape the decode
/// matrix kernels were compiled with (their launchers size blocks from it).
pub struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
    pub qmm: QmmShape,
}

impl Kernels {
    pub fn load(gpu: &Arc<Gpu>, dims: &Dims) -> CudaResult<Self> {
        Self::load_tuned(gpu, dims, QmmShape::default(), &[])
    }

    /// Loads with a non-default shape of the decode matrix kernels and any
    /// extra defines (speed probes compare variants this way).
    pub fn load_tuned(gpu: &Arc<Gpu>, dims: &Dims, qmm: QmmShape, extra: &[String]) -> CudaResult<Self> {
        let cubins = compile_all(dims, &qmm, extra)?;
        gpu.bind()?;
        let mut functions = HashMap::new();
        let mut modules = Vec::new();
        for (name, cubin) in cubins.iter() {
            let module = gpu.ctx.load_module(Ptx::from_binary(cubin.clone())).ctx(&format!("cuModuleLoadData({name}.cu)"))?;
            let family = FAMILIES.iter().find(|f| f.name == *name).ok_or_else(|| CudaError::Unsupported(format!("unknown family {name}")))?;
            for k in family.kernels {
                let f = module.load_function(k).ctx(&format!("cuModuleGetFunction({k})"))?;
                // Every kernel may take up to the opt-in shared memory limit;
                // launchers size what they actually ask for.
                // SAFETY: f is a valid function of a loaded module.
                let static_smem =
                    unsafe { result::function::get_function_attribute(f.cu_function(), CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }
                        .ctx(&format!("cuFuncGetAttribute({k})"))?;
                // SAFETY: as above; the value respects the opt-in limit minus
                // the kernel's static shared memory.
                unsafe {
                    result::function::set_function_attribute(
                        f.cu_function(),
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        gpu.max_smem_optin as i32 - static_smem,
                    )
                }
                .ctx(&format!("cuFuncSetAttribute({k})"))?;
                functions.insert(*k, f);
            }
            modules.push(module);
        }
        Ok(Kernels { functions, _modules: modules, qmm })
    }

    pub fn get(&self, name: &'static str) -> CudaResult<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| CudaError::Unsupported(format!("kernel {name} is not loaded")))
    }
}
