//! Launchers of kernels/gdn.cu: the Gated DeltaNet decode step and the
//! chunked prefill (prep, conv store, phase A per chunk, phase B across
//! chunks, gated norm). State layouts are described in the kernel's header;
//! the memory plan (state.rs) owns the buffers.

use cudarc::driver::DeviceRepr;

use crate::device::Gpu;
use crate::dims::{Dims, GDN_CHUNK};
use crate::error::{CudaError, CudaResult};
use crate::kernels::Kernels;
use crate::launch::{launch, launch_pdl};
use crate::weights::DeltaNetDev;

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnDecodeParams {
    proj: u64,
    conv: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    norm_w: u64,
    state: u64,
    pos: u64,
    slot: u64,
    mix_f32: u64,
    mix_f16: u64,
    mix_px: u64,
    conv_slot_stride: i64,
    state_slot_stride: i64,
    proj_stride: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `GdnDecodeParams` in gdn.cu.
unsafe impl DeviceRepr for GdnDecodeParams {}

/// Where a DeltaNet layer's per-sequence state lives.
#[derive(Clone, Copy)]
pub struct GdnState {
    /// Conv ring of this layer in slot 0; slot s is at + s * conv_slot_stride floats.
    pub conv: u64,
    pub conv_slot_stride: usize,
    /// Recurrent state of this layer in slot 0.
    pub state: u64,
    pub state_slot_stride: usize,
}

/// Where the mixer output goes: f32, fp16 (the prefill GEMM's input), or
/// packed fp16 hi/lo activations (the decode step's qmm input, see qmm.cu).
#[derive(Clone, Copy)]
pub enum MixOut {
    F32(u64),
    F16(u64),
    Packed(u64),
}

impl MixOut {
    /// (f32, fp16, packed) pointers, 0 for the ones not written.
    pub fn split(self) -> (u64, u64, u64) {
        match self {
            MixOut::F32(p) => (p, 0, 0),
            MixOut::F16(p) => (0, p, 0),
            MixOut::Packed(p) => (0, 0, p),
        }
    }
}

/// One decode step for `ntok` tokens (each its own sequence slot).
#[allow(clippy::too_many_arguments)]
pub fn decode(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    st: &GdnState,
    proj: u64,
    proj_stride: usize,
    pos: u64,
    slot: u64,
    mix: MixOut,
    ntok: usize,
) -> CudaResult<()> {
    if proj_stride < dims.gdn_proj() {
        return Err(CudaError::shape("gdn_decode", format!("proj stride {proj_stride} < {}", dims.gdn_proj())));
    }
    if ntok == 0 {
        return Ok(());
    }
    let (mix_f32, mix_f16, mix_px) = mix.split();
    let p = GdnDecodeParams {
        proj,
        conv: st.conv,
        conv_w: w.conv_w,
        a_log: w.a_log,
        dt_bias: w.dt_bias,
        norm_w: w.norm,
        state: st.state,
        pos,
        slot,
        mix_f32,
        mix_f16,
        mix_px,
        conv_slot_stride: st.conv_slot_stride as i64,
        state_slot_stride: st.state_slot_stride as i64,
        proj_stride: proj_stride as i32,
        eps: dims.rms_eps,
    };
    launch_pdl(gpu, k, "gdn_decode", (dims.gv_heads as u32, ntok as u32, 1), (4 * dims.gv_dim) as u32, 0, &p)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnPrepParams {
    proj: u64,
    conv: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    qn: u64,
    kn: u64,
    vv: u64,
    gg: u64,
    bb: u64,
    proj_stride: i32,
    t: i32,
    tp: i32,
    p0: i32,
}
// SAFETY: plain-old-data mirroring `GdnPrepParams` in gdn.cu.
unsafe impl DeviceRepr for GdnPrepParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnConvStoreParams {
    proj: u64,
    conv: u64,
    proj_stride: i32,
    t: i32,
    p0: i32,
}
// SAFETY: plain-old-data mirroring `GdnConvStoreParams` in gdn.cu.
unsafe impl DeviceRepr for GdnConvStoreParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnChunkAParams {
    qn: u64,
    kn: u64,
    vv: u64,
    gg: u64,
    bb: u64,
    u: u64,
    w: u64,
    aqk: u64,
    gc: u64,
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnChunkAParams` in gdn.cu.
unsafe impl DeviceRepr for GdnChunkAParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnChunkBParams {
    qn: u64,
    kn: u64,
    u: u64,
    w: u64,
    aqk: u64,
    gc: u64,
    state: u64,
    o: u64,
    tp: i32,
}
// SAFETY: plain-old-data mirroring `GdnChunkBParams` in gdn.cu.
unsafe impl DeviceRepr for GdnChunkBParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnGatedNormParams {
    o: u64,
    proj: u64,
    norm_w: u64,
    mix_f32: u64,
    mix_f16: u64,
    proj_stride: i32,
    eps: f32,
}
// SAFETY: plain-old-data mirroring `GdnGatedNormParams` in gdn.cu.
unsafe impl DeviceRepr for GdnGatedNormParams {}

/// Scratch of the chunked prefill for up to `max_tokens` tokens (f32).
#[derive(Clone, Copy)]
pub struct GdnScratch {
    pub qn: u64,
    pub kn: u64,
    pub vv: u64,
    pub gg: u64,
    pub bb: u64,
    pub u: u64,
    pub w: u64,
    pub aqk: u64,
    pub gc: u64,
    pub o: u64,
    /// Tokens (rounded up to the chunk) the buffers hold.
    pub max_tokens: usize,
}

impl GdnScratch {
    /// Floats of each buffer for `tp` padded tokens, in field order.
    pub fn sizes(dims: &Dims, tp: usize) -> [usize; 10] {
        let kd = dims.gk_heads * tp * dims.gk_dim;
        let vd = dims.gv_heads * tp * dims.gv_dim;
        [kd, kd, vd, dims.gv_heads * tp, dims.gv_heads * tp, vd, vd, dims.gv_heads * tp * GDN_CHUNK, dims.gv_heads * tp, tp * dims.gdn_val_dim()]
    }
}

/// Shared-memory bytes of the chunk kernels (see their headers).
pub fn chunk_a_smem(dims: &Dims) -> usize {
    let d = dims.gk_dim;
    let qt = (d * (GDN_CHUNK + 4)).max(GDN_CHUNK * (d + 4));
    (d * (GDN_CHUNK + 4) + qt + GDN_CHUNK * (d + 4) + GDN_CHUNK * (GDN_CHUNK + 1) + 2 * GDN_CHUNK) * 4
}
pub fn chunk_b_smem(dims: &Dims) -> usize {
    let d = dims.gk_dim;
    let cols = 32;
    (d * (cols + 4) + 3 * GDN_CHUNK * (d + 4) + 2 * GDN_CHUNK * (cols + 4) + GDN_CHUNK * (GDN_CHUNK + 4) + GDN_CHUNK) * 4
}

/// The chunked DeltaNet over `t` tokens of one sequence starting at
/// position `p0`: reads the in-projection rows `proj`, updates the conv ring
/// `conv` and recurrent state `state` of that sequence (this layer), writes
/// the gated-norm output.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    gpu: &Gpu,
    k: &Kernels,
    dims: &Dims,
    w: &DeltaNetDev,
    conv: u64,
    state: u64,
    proj: u64,
    proj_stride: usize,
    t: usize,
    p0: usize,
    s: &GdnScratch,
    mix: MixOut,
) -> CudaResult<()> {
    if t == 0 {
        return Ok(());
    }
    let tp = t.div_ceil(GDN_CHUNK) * GDN_CHUNK;
    if tp > s.max_tokens {
        return Err(CudaError::shape("gdn_prefill", format!("{t} tokens, scratch holds {}", s.max_tokens)));
    }
    let prep = GdnPrepParams {
        proj,
        conv,
        conv_w: w.conv_w,
        a_log: w.a_log,
        dt_bias: w.dt_bias,
        qn: s.qn,
        kn: s.kn,
        vv: s.vv,
        gg: s.gg,
        bb: s.bb,
        proj_stride: proj_stride as i32,
        t: t as i32,
        tp: tp as i32,
        p0: p0 as i32,
    };
    launch(gpu, k, "gdn_prefill_prep", (tp as u32, 3, 1), (32 * dims.gk_heads) as u32, 0, &prep)?;
    let cs = GdnConvStoreParams { proj, conv, proj_stride: proj_stride as i32, t: t as i32, p0: p0 as i32 };
    launch(gpu, k, "gdn_conv_store", (dims.conv_dim.div_ceil(256) as u32, 1, 1), 256, 0, &cs)?;
    let nchunks = tp / GDN_CHUNK;
    let a = GdnChunkAParams { qn: s.qn, kn: s.kn, vv: s.vv, gg: s.gg, bb: s.bb, u: s.u, w: s.w, aqk: s.aqk, gc: s.gc, tp: tp as i32 };
    launch(gpu, k, "gdn_chunk_a", (nchunks as u32, dims.gv_heads as u32, 1), 256, chunk_a_smem(dims), &a)?;
    let b = GdnChunkBParams { qn: s.qn, kn: s.kn, u: s.u, w: s.w, aqk: s.aqk, gc: s.gc, state, o: s.o, tp: tp as i32 };
    launch(gpu, k, "gdn_chunk_b", (dims.gv_heads as u32, (dims.gv_dim / 32) as u32, 1), 256, chunk_b_smem(dims), &b)?;
    let (mix_f32, mix_f16, mix_px) = mix.split();
    if mix_px != 0 {
        return Err(CudaError::shape("gdn_gated_norm", "the prefill writes f32 or fp16 rows, not packed activations"));
    }
    let n = GdnGatedNormParams { o: s.o, proj, norm_w: w.norm, mix_f32, mix_f16, proj_stride: proj_stride as i32, eps: dims.rms_eps };
    launch(gpu, k, "gdn_gated_norm", (t as u32, dims.gv_heads.div_ceil(8) as u32, 1), 256, 0, &n)
}
