//! The GPU: probing for a driver without panicking, the context and the one
//! stream every kernel runs on, and raw device allocations.
//!
//! cudarc panics when libcuda is absent, so `Gpu::open` first checks that the
//! library can be loaded and only then touches the driver (inside
//! `catch_unwind` as a second guard). Buffers are plain `cuMemAlloc`
//! allocations addressed by raw device pointers: kernels get `u64` pointers in
//! their parameter structs, and the memory plan (state.rs) decides once what
//! lives where. Event tracking of cudarc's typed slices is switched off, as
//! there is one stream and ordering is the stream's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{result, CudaContext, CudaStream, PinnedHostSlice};

use crate::error::{CudaError, CudaResult, DriverContext};

/// One GPU with its context and stream.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub sm_count: u32,
    pub max_smem_optin: u32,
    pub total_mem: usize,
    allocated: AtomicU64,
    peak: AtomicU64,
}

/// True when a CUDA driver library can be loaded on this machine (it may
/// still have no device).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens device `ordinal`, or returns `CudaError::NoDevice` on machines
    /// without a driver or device; refuses GPUs other than Hopper (the
    /// kernels are compiled for sm_90a).
    pub fn open(ordinal: usize) -> CudaResult<Arc<Gpu>> {
        if !driver_present() {
            return Err(CudaError::NoDevice("libcuda.so could not be loaded".into()));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| CudaError::NoDevice("the CUDA driver panicked during initialisation".into()))?
            .map_err(|e| CudaError::NoDevice(format!("device {ordinal}: {e}")))?;
        // SAFETY: the context was created above; event tracking only affects
        // cudarc's typed slices, which this crate does not use for kernels.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().ctx("cuDeviceGetAttribute(compute capability)")?;
        let name = ctx.name().ctx("cuDeviceGetName")?;
        if (major, minor) != (9, 0) {
            return Err(CudaError::Unsupported(format!("{name} has compute capability {major}.{minor}; the kernels are built for sm_90a (Hopper: H100/H200)")));
        }
        let sm_count = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).ctx("SM count")? as u32;
        let max_smem_optin = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).ctx("smem limit")? as u32;
        let total_mem = ctx.total_mem().ctx("cuDeviceTotalMem")?;
        let stream = ctx.new_stream().ctx("cuStreamCreate")?;
        Ok(Arc::new(Gpu { ctx, stream, name, sm_count, max_smem_optin, total_mem, allocated: AtomicU64::new(0), peak: AtomicU64::new(0) }))
    }

    /// Makes this GPU's context current on the calling thread (the backend
    /// may move between threads).
    pub fn bind(&self) -> CudaResult<()> {
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")
    }

    pub fn synchronize(&self) -> CudaResult<()> {
        self.stream.synchronize().ctx("cuStreamSynchronize")
    }

    /// Bytes currently allocated through `DeviceBuffer`.
    pub fn allocated(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }
    pub fn peak_allocated(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    /// Free and total device memory as the driver reports them.
    pub fn mem_info(&self) -> CudaResult<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().ctx("cuMemGetInfo")
    }

    pub fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.stream.cu_stream()
    }

    /// The same device on a second stream, for work that overlaps the main
    /// stream's (the prefill's shared expert): launchers take it like this
    /// Gpu. Ordering with the main stream is the caller's (events); it
    /// allocates nothing (device memory comes from the main Gpu).
    pub fn side_stream(&self) -> CudaResult<Gpu> {
        let stream = self.ctx.new_stream().ctx("cuStreamCreate (side stream)")?;
        Ok(Gpu {
            ctx: self.ctx.clone(),
            stream,
            name: self.name.clone(),
            sm_count: self.sm_count,
            max_smem_optin: self.max_smem_optin,
            total_mem: self.total_mem,
            allocated: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }
}

/// A device allocation freed on drop. Zeroed at creation, so that memory no
/// kernel has written yet never holds NaN bit patterns.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
    gpu: Arc<Gpu>,
}

impl DeviceBuffer {
    pub fn zeroed(gpu: &Arc<Gpu>, bytes: usize, what: &str) -> CudaResult<Self> {
        gpu.bind()?;
        let bytes = bytes.max(256);
        // SAFETY: the context is current; the size is non-zero.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| CudaError::Capacity(format!("allocating {what} ({:.2} GiB) on {}: {e}", bytes as f64 / (1u64 << 30) as f64, gpu.name)))?;
        // On the backend's own (non-blocking) stream and waited for: a memset
        // on the legacy stream is not ordered with that stream's copies and
        // could land after them.
        // SAFETY: ptr is a fresh allocation of `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0, bytes, gpu.cu_stream()) }.ctx("cuMemsetD8Async")?;
        gpu.synchronize()?;
        let now = gpu.allocated.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        gpu.peak.fetch_max(now, Ordering::Relaxed);
        Ok(DeviceBuffer { ptr, bytes, gpu: gpu.clone() })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Device address `offset` bytes into the buffer (checked).
    pub fn at(&self, offset: usize) -> CudaResult<u64> {
        if offset > self.bytes {
            return Err(CudaError::Capacity(format!("offset {offset} past the end of a {}-byte buffer", self.bytes)));
        }
        Ok(self.ptr + offset as u64)
    }

    /// Copies host data to `offset` bytes into the buffer, asynchronously on
    /// the GPU's stream. The caller keeps `data` alive and unchanged until the
    /// stream is synchronised.
    pub fn upload_at<T: Copy>(&self, offset: usize, data: &[T]) -> CudaResult<()> {
        let n = std::mem::size_of_val(data);
        if offset + n > self.bytes {
            return Err(CudaError::Capacity(format!("upload of {n} bytes at {offset} past a {}-byte buffer", self.bytes)));
        }
        self.gpu.bind()?;
        // SAFETY: the destination range is inside this allocation (checked);
        // the caller keeps `data` alive until the stream is synchronised.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, data, self.gpu.cu_stream()) }.ctx("cuMemcpyHtoDAsync")
    }

    /// Copy of host data that has landed when this returns (the slice may be
    /// dropped right after).
    pub fn upload_sync_at<T: Copy>(&self, offset: usize, data: &[T]) -> CudaResult<()> {
        self.upload_at(offset, data)?;
        self.gpu.synchronize()
    }

    /// Copies `out.len()` elements from `offset` bytes into the buffer, waiting
    /// for the stream first.
    pub fn download_at<T: Copy>(&self, offset: usize, out: &mut [T]) -> CudaResult<()> {
        let n = std::mem::size_of_val(out);
        if offset + n > self.bytes {
            return Err(CudaError::Capacity(format!("download of {n} bytes at {offset} past a {}-byte buffer", self.bytes)));
        }
        read_into(&self.gpu, self.ptr + offset as u64, out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            let _ = self.gpu.synchronize();
            // SAFETY: ptr came from cuMemAlloc and is freed once, after the
            // stream finished every use of it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
        self.gpu.allocated.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

// Every copy goes through the backend's own stream and is waited for there:
// the synchronous cuMemcpy* calls use the legacy stream, which is not ordered
// with a non-blocking stream, and a host-to-device one may return before its
// data has landed.

fn read_into<T: Copy>(gpu: &Gpu, ptr: u64, out: &mut [T]) -> CudaResult<()> {
    gpu.bind()?;
    // SAFETY: the caller names a device range of out.len() elements that it
    // owns; `out` outlives the copy because the stream is synchronised before
    // returning.
    unsafe { result::memcpy_dtoh_async(out, ptr, gpu.cu_stream()) }.ctx("cuMemcpyDtoHAsync")?;
    gpu.synchronize()
}

/// Page-locked host memory through which rows of f32 results are read
/// back in chunks: a pageable destination makes the driver stage every
/// copy through its own small pinned buffers, several times slower for
/// the megabytes of logits a prefill pass hands back.
pub struct HostStage {
    buf: PinnedHostSlice<f32>,
}

impl HostStage {
    /// A stage of `floats` f32 (at least one).
    pub fn new(gpu: &Gpu, floats: usize) -> CudaResult<Self> {
        gpu.bind()?;
        // SAFETY: every float is written by a copy before it is read
        // (`read_rows` reads only what its copy filled).
        let buf = unsafe { gpu.ctx.alloc_pinned::<f32>(floats.max(1)) }
            .map_err(|e| CudaError::Capacity(format!("allocating {floats} floats of page-locked host memory: {e}")))?;
        Ok(HostStage { buf })
    }

    /// Reads `rows` rows of `row_len` f32 at device address `ptr` (row
    /// after row) after the work queued on `gpu`'s stream, as many rows a
    /// copy as the stage holds.
    pub fn read_rows(&mut self, gpu: &Gpu, ptr: u64, rows: usize, row_len: usize) -> CudaResult<Vec<Vec<f32>>> {
        gpu.bind()?;
        let stage = self.buf.as_mut_slice().ctx("pinned host buffer")?;
        if row_len == 0 || row_len > stage.len() {
            return Err(CudaError::Invalid(format!("rows of {row_len} floats through a stage of {}", stage.len())));
        }
        let per = stage.len() / row_len;
        let mut out = Vec::with_capacity(rows);
        let mut r = 0;
        while r < rows {
            let n = per.min(rows - r);
            let dst = &mut stage[..n * row_len];
            // SAFETY: the caller names `rows` rows of `row_len` f32 at `ptr`
            // that it owns; the destination is this stage's page-locked
            // memory, read only after the stream is synchronised below.
            unsafe { result::memcpy_dtoh_async(dst, ptr + (r * row_len * 4) as u64, gpu.cu_stream()) }.ctx("cuMemcpyDtoHAsync (staged)")?;
            gpu.synchronize()?;
            out.extend(dst.chunks_exact(row_len).map(|c| c.to_vec()));
            r += n;
        }
        Ok(out)
    }
}

/// Reads `n` elements of type `T` at device address `ptr` after the work
/// queued on the stream.
pub fn read_device<T: Copy + Default>(gpu: &Gpu, ptr: u64, n: usize) -> CudaResult<Vec<T>> {
    let mut out = vec![T::default(); n];
    read_into(gpu, ptr, &mut out)?;
    Ok(out)
}

/// Writes host data to device address `ptr`, ordered after the work queued
/// on the stream; the data has landed when this returns.
pub fn write_device<T: Copy>(gpu: &Gpu, ptr: u64, data: &[T]) -> CudaResult<()> {
    gpu.bind()?;
    // SAFETY: the caller names a device range it owns of data.len()
    // elements; `data` outlives the copy (synchronised below).
    unsafe { result::memcpy_htod_async(ptr, data, gpu.cu_stream()) }.ctx("cuMemcpyHtoDAsync")?;
    gpu.synchronize()
}

/// Asynchronous device-to-device copy on the GPU's stream.
pub fn copy_device(gpu: &Gpu, dst: u64, src: u64, bytes: usize) -> CudaResult<()> {
    // SAFETY: the caller names two device ranges of `bytes` bytes it owns.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, gpu.cu_stream()) }.ctx("cuMemcpyDtoDAsync")
}

/// Asynchronous memset on the GPU's stream.
pub fn zero_device(gpu: &Gpu, dst: u64, bytes: usize) -> CudaResult<()> {
    // SAFETY: the caller names a device range of `bytes` bytes it owns.
    unsafe { result::memset_d8_async(dst, 0, bytes, gpu.cu_stream()) }.ctx("cuMemsetD8Async")
}

/// A typed view of `len` elements of device memory (a piece of the memory
/// plan): launchers take these instead of bare addresses and check that each
/// holds what the launch will touch.
#[derive(Debug)]
pub struct DevSlice<T> {
    ptr: u64,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T> Clone for DevSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevSlice<T> {}

impl<T> DevSlice<T> {
    /// A view of `len` elements at `ptr` (the caller owns that range).
    pub fn new(ptr: u64, len: usize) -> Self {
        DevSlice { ptr, len, _t: std::marker::PhantomData }
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The address, after checking that the view holds `n` elements;
    /// `kernel` and `what` name the launch and the buffer in the error.
    pub fn need(&self, kernel: &'static str, what: &str, n: usize) -> CudaResult<u64> {
        if n > self.len {
            return Err(CudaError::shape(kernel, format!("{what}: {n} elements needed, the buffer holds {}", self.len)));
        }
        Ok(self.ptr)
    }
    /// The view from element `start` on (checked).
    pub fn from(&self, start: usize) -> CudaResult<DevSlice<T>> {
        if start > self.len {
            return Err(CudaError::Capacity(format!("element {start} past a view of {}", self.len)));
        }
        Ok(DevSlice::new(self.ptr + (start * std::mem::size_of::<T>()) as u64, self.len - start))
    }
}
