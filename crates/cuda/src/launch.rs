//! The one way kernels are launched: a loaded function, a grid, a block, the
//! dynamic shared memory and one `#[repr(C)]` parameter struct whose layout
//! mirrors the kernel's (every launcher's struct is next to its family's
//! `.cu`). Launch-configuration errors come back as values naming the kernel;
//! faults inside a kernel surface at the next synchronisation.

use cudarc::driver::sys::{self, CUlaunchAttributeID};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use crate::device::Gpu;
use crate::error::{CudaError, CudaResult, DriverContext};
use crate::kernels::Kernels;

/// Launches `name` with a single by-value parameter struct.
pub fn launch<P: DeviceRepr>(gpu: &Gpu, kernels: &Kernels, name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, params: &P) -> CudaResult<()> {
    check_config(gpu, name, grid, block, smem)?;
    let f = kernels.get(name)?;
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem as u32 };
    let mut b = gpu.stream.launch_builder(f);
    b.arg(params);
    // SAFETY: `P` mirrors the kernel's parameter struct field by field (see the
    // family's launcher), and every pointer in it is a live device address
    // of the memory plan.
    unsafe { b.launch(cfg) }.ctx(name)?;
    Ok(())
}

/// Launches `name` like `launch`, with programmatic dependent launch: the
/// kernel may start while the previous kernel on the stream is still
/// running, and must call `pdl_wait()` (common.cuh) before it touches
/// anything an earlier kernel writes or reads. Captured into a graph, this
/// becomes a programmatic edge, so one kernel's prologue (weight prefetch)
/// overlaps the previous kernel's tail.
pub fn launch_pdl<P: DeviceRepr>(
    gpu: &Gpu,
    kernels: &Kernels,
    name: &'static str,
    grid: (u32, u32, u32),
    block: u32,
    smem: usize,
    params: &P,
) -> CudaResult<()> {
    check_config(gpu, name, grid, block, smem)?;
    let f = kernels.get(name)?;
    // SAFETY: a zeroed attribute is a valid "ignored" value; id and the one
    // union field used are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem as u32,
        hStream: gpu.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut arg = params as *const P as *mut std::ffi::c_void;
    // SAFETY: `P` mirrors the kernel's single by-value parameter struct (see
    // `launch`); `arg` points at it for the duration of the call, which
    // copies the parameters; `cfg` and `attr` outlive the call.
    let r = unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), &mut arg, std::ptr::null_mut()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver { what: name.into(), message: format!("{r:?}") });
    }
    Ok(())
}

/// `launch_pdl` when `pdl`, else `launch`: for a family whose launcher
/// decides per launch (gemm.rs `pdl_launch`).
#[allow(clippy::too_many_arguments)]
pub fn launch_maybe_pdl<P: DeviceRepr>(
    pdl: bool,
    gpu: &Gpu,
    kernels: &Kernels,
    name: &'static str,
    grid: (u32, u32, u32),
    block: u32,
    smem: usize,
    params: &P,
) -> CudaResult<()> {
    if pdl {
        launch_pdl(gpu, kernels, name, grid, block, smem, params)
    } else {
        launch(gpu, kernels, name, grid, block, smem, params)
    }
}

pub fn check_config(gpu: &Gpu, name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize) -> CudaResult<()> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || grid.1 > 65535 || grid.2 > 65535 || grid.0 > i32::MAX as u32 {
        return Err(CudaError::shape(name, format!("grid {grid:?} is empty or too large")));
    }
    if block == 0 || block > 1024 {
        return Err(CudaError::shape(name, format!("block of {block} threads")));
    }
    if smem > gpu.max_smem_optin as usize {
        return Err(CudaError::shape(name, format!("{smem} bytes of shared memory, the device allows {}", gpu.max_smem_optin)));
    }
    Ok(())
}
