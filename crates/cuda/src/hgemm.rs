//! Launchers of kernels/hgemm.cu: the fp16 tensor-core GEMM that long
//! prefill passes run their dense matrices on, fed by the bulk tensor copy
//! engine (TMA) and warp-specialised (a producer warpgroup, two consumer
//! warpgroups on wgmma), and `dq_f16`, which dequantises a 4- or 8-bit
//! matrix into fp16 rows once per pass for it.
//!
//! Why: the 4-bit GEMM tiles of gemm.cu dequantise every k-tile in the
//! consumer warps and compute their own copy addresses, which leaves the
//! tensor pipe about half busy at thousands of tokens (NOTES, "Long
//! prefill"). At `Options::f16_gemm_from` tokens and more a matrix's
//! dequantisation once per pass (a few MB of codes into the `w16` scratch)
//! costs a few percent of its multiply, and the multiply becomes a plain
//! fp16 GEMM. The weights have the values gemm.cu's tiles give them
//! (fp16(fmaf(scale, q, bias))); the sums are fp32, in another order.
//!
//! Tile constants are defined here and reach hgemm.cu as defines; the
//! parameter structs are checked against their CUDA mirrors at compile time.

use std::mem::size_of;

use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::error::{CudaError, CudaResult};
use crate::gemm::GemmOut;
use crate::kernels::Kernels;
use crate::launch::launch;
use crate::weights::QMat;

/// Token rows of a tile: two consumer warpgroups of 64.
pub const HG_BM: usize = 128;
/// W rows of a tile (the N of each consumer's wgmma.m64n256k16).
pub const HG_BN: usize = 256;
/// Columns of a k-tile: 64 fp16 = one 128-byte swizzle row.
pub const HG_BK: usize = 64;
/// Stages of the shared-memory ring (48 KB each).
pub const HG_STAGES: usize = 4;
/// Threads of a block: one producer and two consumer warpgroups.
pub const HG_THREADS: usize = 384;
/// Column pairs a consumer thread's epilogue handles at once (of HG_BN / 8):
/// with `GemmOut::Add`, their old values are all loaded before the first
/// store, 2 x 8 float2 (32 registers) beside the 128 accumulators.
pub const HG_EPI_COLS: usize = 8;
/// Shortest K the model sends here: with fewer k-tiles (the shared
/// expert's down projection has 8) the ring's fill and the epilogue weigh
/// more than the multiply, and that GEMM runs beside the routed experts,
/// whose SMs a block of 197 KB of shared memory would take.
pub const MIN_K: usize = 1024;
/// Threads of a `dq_f16` block (one code word each).
const DQ_THREADS: usize = 256;

/// Every entry point of hgemm.cu.
pub const KERNELS: &[&str] = &["hgemm_f16", "dq_f16"];

/// Dynamic shared memory of `hgemm_f16`: alignment slack for the
/// 1024-byte swizzle atoms, the ring, a full and an empty mbarrier a stage.
pub fn smem_bytes() -> usize {
    1024 + HG_STAGES * (HG_BM + HG_BN) * HG_BK * 2 + 2 * HG_STAGES * 8
}

/// A tensor map as the kernel parameter holds it: the driver's 128 opaque
/// bytes at the 64-byte alignment hgemm.cu's `TmaMap` declares (cudarc's
/// CUDA 13 `CUtensorMap` is 128-byte aligned, which would move the fields
/// after it).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaMap {
    opaque: [u64; 16],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HgemmParams {
    a: TmaMap,
    w: TmaMap,
    out: u64,
    m: i32,
    n: i32,
    k: i32,
    ldc: i32,
    mode: i32,
}
// SAFETY: plain data mirroring hgemm.cu's HgemmParams (size checked there).
unsafe impl DeviceRepr for HgemmParams {}

/// Matrices a `dq_f16` launch dequantises (a mixer's in-projections are
/// four: qkv, z, a, b).
pub const DQ_MAX_MATS: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DqMatC {
    codes: u64,
    scales: u64,
    biases: u64,
    out: u64,
    word0: i64,
    bits: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DqParams {
    mat: [DqMatC; DQ_MAX_MATS],
    words: i64,
    nmat: i32,
    pad: i32,
}
// SAFETY: plain data mirroring hgemm.cu's DqParams (size checked there).
unsafe impl DeviceRepr for DqParams {}

/// The family's defines, each checked in hgemm.cu.
pub fn defines() -> Vec<String> {
    vec![
        format!("-DHG_BM={HG_BM}"),
        format!("-DHG_BN={HG_BN}"),
        format!("-DHG_BK={HG_BK}"),
        format!("-DHG_STAGES={HG_STAGES}"),
        format!("-DHG_THREADS={HG_THREADS}"),
        format!("-DHG_EPI_COLS={HG_EPI_COLS}"),
        format!("-DHG_SMEM={}", smem_bytes()),
        format!("-DHGEMM_PARAMS_BYTES={}", size_of::<HgemmParams>()),
        format!("-DDQ_PARAMS_BYTES={}", size_of::<DqParams>()),
        format!("-DDQ_MAX_MATS={DQ_MAX_MATS}"),
    ]
}

/// An fp16 matrix [rows][cols] in device memory (row-major, dense).
#[derive(Clone, Copy, Debug)]
pub struct F16Rows {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
}

/// Scratch for dequantised matrices: `elems` fp16 values at `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct F16Scratch {
    pub ptr: u64,
    pub elems: usize,
}

/// Writes the fp16 values of the quantised matrix `w` (one expert: `w`
/// must be dense) into `dst`, which must have room for its rows.
pub fn dequant(gpu: &Gpu, k: &Kernels, w: &QMat, dst: F16Rows) -> CudaResult<()> {
    dequant_all(gpu, k, &[(w, dst)])
}

/// `dequant` of up to `DQ_MAX_MATS` matrices in one launch (the launches
/// of a mixer's small a/b matrices cost more in their ramp than in their
/// bytes).
pub fn dequant_all(gpu: &Gpu, k: &Kernels, jobs: &[(&QMat, F16Rows)]) -> CudaResult<()> {
    if jobs.is_empty() || jobs.len() > DQ_MAX_MATS {
        return Err(CudaError::shape("dq_f16", format!("{} matrices in one launch (1 to {DQ_MAX_MATS})", jobs.len())));
    }
    let mut mat = [DqMatC::default(); DQ_MAX_MATS];
    let mut words = 0usize;
    for (i, (w, dst)) in jobs.iter().enumerate() {
        if w.experts != 1 {
            return Err(CudaError::shape("dq_f16", format!("a stack of {} experts (dense matrices only)", w.experts)));
        }
        if w.bits != 4 && w.bits != 8 {
            return Err(CudaError::shape("dq_f16", format!("{}-bit weights (4 or 8)", w.bits)));
        }
        if !w.cols.is_multiple_of(64) || w.cols != dst.cols || w.rows > dst.rows {
            return Err(CudaError::shape("dq_f16", format!("a {}x{} matrix into fp16 rows {}x{}", w.rows, w.cols, dst.rows, dst.cols)));
        }
        if !dst.ptr.is_multiple_of(16) {
            return Err(CudaError::shape("dq_f16", "destination not 16-byte aligned"));
        }
        mat[i] = DqMatC { codes: w.codes, scales: w.scales, biases: w.biases, out: dst.ptr, word0: words as i64, bits: w.bits as i32, pad: 0 };
        words += w.rows * w.cols * w.bits as usize / 32;
    }
    let p = DqParams { mat, words: words as i64, nmat: jobs.len() as i32, pad: 0 };
    launch(gpu, k, "dq_f16", (words.div_ceil(DQ_THREADS) as u32, 1, 1), DQ_THREADS as u32, 0, &p)
}

/// A 2-D fp16 tensor map: `rows` rows of `cols` values, `row_bytes` apart,
/// read in boxes of `box_rows` x HG_BK with the 128-byte swizzle.
fn tensor_map(what: &'static str, ptr: u64, rows: usize, cols: usize, row_bytes: usize, box_rows: usize) -> CudaResult<TmaMap> {
    if !ptr.is_multiple_of(16) || !row_bytes.is_multiple_of(16) {
        return Err(CudaError::shape(what, format!("tensor map of {rows}x{cols} at {ptr:#x}, rows {row_bytes} bytes apart: not 16-byte aligned")));
    }
    let dims: [u64; 2] = [cols as u64, rows as u64];
    let strides: [u64; 1] = [row_bytes as u64];
    let boxes: [u32; 2] = [HG_BK as u32, box_rows as u32];
    let elem: [u32; 2] = [1, 1];
    // SAFETY: a zeroed map is a valid destination; every array outlives the
    // call, which only reads them and writes `map`.
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver { what: format!("cuTensorMapEncodeTiled ({what})"), message: format!("{r:?}") });
    }
    Ok(TmaMap { opaque: map.opaque })
}

/// out (f32 [m][ldc]) (=, +=) A W^T for `m` rows of `a` (fp16, `lda` values
/// apart) and the fp16 rows `w` (K = w.cols): `GemmOut::Store` or
/// `GemmOut::Add` (no SwiGLU epilogue here).
#[allow(clippy::too_many_arguments)]
pub fn hgemm(gpu: &Gpu, k: &Kernels, a: u64, lda: usize, m: usize, w: F16Rows, out: GemmOut, ldc: usize) -> CudaResult<()> {
    let name = "hgemm_f16";
    let kk = w.cols;
    if m == 0 || w.rows == 0 {
        return Err(CudaError::shape(name, format!("{m} rows x {} columns", w.rows)));
    }
    if !kk.is_multiple_of(HG_BK) || lda < kk || !w.rows.is_multiple_of(2) || ldc < w.rows || !ldc.is_multiple_of(2) {
        return Err(CudaError::shape(name, format!("A [{m}][{lda}], W [{}][{kk}], out ldc {ldc}: K must be a multiple of {HG_BK}, N and ldc even", w.rows)));
    }
    if m > i32::MAX as usize || w.rows > i32::MAX as usize || kk > i32::MAX as usize || ldc > i32::MAX as usize {
        return Err(CudaError::shape(name, "dimensions past i32"));
    }
    let (ptr, mode) = match out {
        GemmOut::Store(p) => (p, 0),
        GemmOut::Add(p) => (p, 1),
        GemmOut::SwiGlu(_) => return Err(CudaError::shape(name, "a SwiGLU epilogue (store or add only)")),
    };
    if !ptr.is_multiple_of(8) {
        return Err(CudaError::shape(name, "output not 8-byte aligned"));
    }
    let p = HgemmParams {
        a: tensor_map(name, a, m, kk, lda * 2, HG_BM)?,
        w: tensor_map(name, w.ptr, w.rows, kk, kk * 2, HG_BN)?,
        out: ptr,
        m: m as i32,
        n: w.rows as i32,
        k: kk as i32,
        ldc: ldc as i32,
        mode,
    };
    // Persistent: one block an SM (its shared memory allows no second),
    // or one a tile when there are fewer tiles.
    let tiles = m.div_ceil(HG_BM) * w.rows.div_ceil(HG_BN);
    let grid = (tiles.min(gpu.sm_count as usize).max(1) as u32, 1, 1);
    launch(gpu, k, name, grid, HG_THREADS as u32, smem_bytes(), &p)
}

/// Dequantises `mats` (sharing K) one after another into `scratch` and
/// multiplies them by `a` in one GEMM, whose output column j of matrix i
/// lands at column (rows of matrices 0..i) + j of `out`: the matrices'
/// outputs must be consecutive in the output row (the in-projections of a
/// mixer are).
#[allow(clippy::too_many_arguments)]
pub fn dequant_and_multiply(
    gpu: &Gpu,
    k: &Kernels,
    a: u64,
    lda: usize,
    m: usize,
    mats: &[&QMat],
    scratch: F16Scratch,
    out: GemmOut,
    ldc: usize,
) -> CudaResult<()> {
    let w = dequant_rows(gpu, k, mats, scratch)?;
    hgemm(gpu, k, a, lda, m, w, out, ldc)
}

/// `dequant_and_multiply`'s first half: `mats` (sharing K) dequantised one
/// after another into `scratch`; returns the fp16 rows they make together,
/// which `hgemm` may multiply later (on another stream, once it has
/// waited for this one).
pub fn dequant_rows(gpu: &Gpu, k: &Kernels, mats: &[&QMat], scratch: F16Scratch) -> CudaResult<F16Rows> {
    let all = stacked_rows(mats, scratch)?;
    let mut row0 = 0;
    let mut jobs = Vec::with_capacity(mats.len());
    for w in mats {
        jobs.push((*w, F16Rows { ptr: scratch.ptr + (row0 * all.cols * 2) as u64, rows: w.rows, cols: all.cols }));
        row0 += w.rows;
    }
    for part in jobs.chunks(DQ_MAX_MATS) {
        dequant_all(gpu, k, part)?;
    }
    Ok(all)
}

/// Where `dequant_rows` lays `mats` (sharing K) in `scratch`: one after
/// another from its start, as one fp16 matrix of all their rows. A reader
/// on another stream gets the rows it multiplies from here.
pub fn stacked_rows(mats: &[&QMat], scratch: F16Scratch) -> CudaResult<F16Rows> {
    let kk = mats.first().map(|w| w.cols).ok_or_else(|| CudaError::shape("hgemm_f16", "no matrices"))?;
    let rows: usize = mats.iter().map(|w| w.rows).sum();
    if mats.iter().any(|w| w.cols != kk) || rows * kk > scratch.elems {
        return Err(CudaError::shape("hgemm_f16", format!("{} matrices of {rows} rows x {kk} into an fp16 scratch of {} values", mats.len(), scratch.elems)));
    }
    Ok(F16Rows { ptr: scratch.ptr, rows, cols: kk })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_mirror_the_kernel_layout_and_smem_fits_an_sm() {
        // Two 128-byte tensor maps (64-byte aligned), a pointer, five i32:
        // 284 bytes rounded up to the maps' alignment.
        assert_eq!(size_of::<HgemmParams>(), 320);
        assert_eq!(std::mem::align_of::<HgemmParams>(), 64);
        // DQ_MAX_MATS matrices of four pointers, an i64 and two i32, then an i64 and two i32.
        assert_eq!(size_of::<DqParams>(), DQ_MAX_MATS * 48 + 16);
        // The H200's opt-in limit is 227 KB a block.
        assert!(smem_bytes() <= 227 * 1024, "{} bytes", smem_bytes());
        assert_eq!((HG_BM + HG_BN) * HG_BK * 2 % 1024, 0, "stages start on swizzle atoms");
    }
}
