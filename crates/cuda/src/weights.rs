//! The model's weights on the GPU, exactly as the MLX checkpoint stores them.
//!
//! Every linear stays packed: U32 codes, bf16 scales and biases (4-bit group
//! 64; 8-bit for the router and the shared-expert gate), never dequantised
//! in GPU memory. Small vectors (norm gains, conv taps, A_log, dt_bias) are
//! f32. An original BF16 checkpoint is quantised on load to the same MLX
//! layout with `lily_core::quant` (8-bit where MLX's conversion puts 8-bit),
//! so one kernel set serves both formats.
//!
//! Everything lives in one allocation laid out up front (256-byte aligned
//! pieces), filled by large host-to-device copies straight from the mapped
//! files, with a progress callback (bytes done, bytes total).

use std::sync::Arc;

use half::bf16;
use rayon::prelude::*;

use lily_core::tensors::{DType, TensorRef};
use lily_core::weights::{Linear, Mixer, Weights};

use crate::device::{DeviceBuffer, Gpu};
use crate::dims::Dims;
use crate::error::{CudaError, CudaResult};

/// A packed linear map on the device (stacked experts when `experts > 1`).
#[derive(Clone, Copy, Debug, Default)]
pub struct QMat {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    pub bits: u32,
}

impl QMat {
    /// u32 words of one expert's codes.
    pub fn expert_words(&self) -> usize {
        self.rows * self.cols * self.bits as usize / 32
    }
    /// Scale (or bias) entries of one expert.
    pub fn expert_groups(&self) -> usize {
        self.rows * self.cols / 64
    }
    /// Bytes of codes, scales and biases.
    pub fn bytes(&self) -> usize {
        self.experts * (self.expert_words() * 4 + 2 * self.expert_groups() * 2)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct DeltaNetDev {
    pub in_qkv: QMat,
    pub in_z: QMat,
    pub in_a: QMat,
    pub in_b: QMat,
    pub out: QMat,
    /// f32 [conv_dim][4], oldest tap first.
    pub conv_w: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub norm: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct AttentionDev {
    pub q: QMat,
    pub k: QMat,
    pub v: QMat,
    pub o: QMat,
    pub q_norm: u64,
    pub k_norm: u64,
}

#[derive(Clone, Copy, Debug)]
pub enum MixerDev {
    DeltaNet(DeltaNetDev),
    Attention(AttentionDev),
}

#[derive(Clone, Copy, Debug)]
pub struct MoeDev {
    pub router: QMat,
    pub gate: QMat,
    pub up: QMat,
    pub down: QMat,
    pub sh_gate: QMat,
    pub sh_up: QMat,
    pub sh_down: QMat,
    pub sh_expert_gate: QMat,
}

#[derive(Clone, Copy, Debug)]
pub struct LayerDev {
    pub input_norm: u64,
    pub post_norm: u64,
    pub mixer: MixerDev,
    pub moe: MoeDev,
}

/// All weights of the model on the GPU.
pub struct DeviceWeights {
    _buffer: DeviceBuffer,
    pub embed: QMat,
    pub layers: Vec<LayerDev>,
    pub final_norm: u64,
    pub lm_head: QMat,
    /// RoPE inverse frequencies, f32 [rot_dim / 2].
    pub inv_freq: u64,
    pub bytes: usize,
}

/// Host data of one piece, before upload.
enum Piece<'a> {
    /// Bytes of the mapped file, copied as they are.
    Mapped(&'a [u8]),
    /// Converted on the host (f32 vectors, bf16 conversions, quantised codes).
    Owned(Vec<u8>),
}

impl Piece<'_> {
    fn len(&self) -> usize {
        match self {
            Piece::Mapped(b) => b.len(),
            Piece::Owned(v) => v.len(),
        }
    }
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

/// A quantised linear to be uploaded: its pieces are produced lazily (the
/// HF quantisation is done tensor by tensor, not all at once).
struct PendingLinear<'a> {
    linear: &'a Linear,
    /// Bits of the uploaded form.
    bits: u32,
    offset: usize,
    /// Byte sizes of codes, scales, biases.
    sizes: [usize; 3],
}

/// bf16 bytes of a float tensor (copied as is when already bf16).
fn to_bf16_piece(t: &TensorRef) -> Piece<'_> {
    match t.dtype {
        DType::BF16 => Piece::Mapped(t.bytes()),
        _ => Piece::Owned(t.to_f32().iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect()),
    }
}

/// Quantises one dense linear (all experts) to the MLX layout on the host.
fn quantize_dense(linear: &Linear, bits: u32) -> CudaResult<[Vec<u8>; 3]> {
    let rows = linear.rows();
    let cols = linear.cols();
    let experts = linear.experts();
    type Quantised = (Vec<u32>, Vec<f32>, Vec<f32>);
    let parts: Vec<CudaResult<Quantised>> = (0..experts)
        .into_par_iter()
        .map(|e| {
            let m = linear.to_f32(e);
            lily_core::quant::quantize(&m, rows, cols, bits, 64).map_err(CudaError::from)
        })
        .collect();
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for p in parts {
        let (codes, scales, biases) = p?;
        out[0].extend(codes.iter().flat_map(|w| w.to_le_bytes()));
        out[1].extend(scales.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()));
        out[2].extend(biases.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()));
    }
    Ok(out)
}

/// The upload plan: offsets of every piece in the one device buffer.
struct Planner<'a> {
    size: usize,
    linears: Vec<PendingLinear<'a>>,
    vectors: Vec<(usize, Vec<f32>)>,
}

impl<'a> Planner<'a> {
    fn linear(&mut self, linear: &'a Linear, want_bits: u32, what: &str) -> CudaResult<QMat> {
        let (rows, cols, experts) = (linear.rows(), linear.cols(), linear.experts());
        let bits = match linear {
            Linear::Quant(q) => {
                if q.spec.group_size != 64 {
                    return Err(CudaError::Unsupported(format!("{what}: group size {} (the kernels need 64)", q.spec.group_size)));
                }
                if q.spec.bits != want_bits {
                    return Err(CudaError::Unsupported(format!(
                        "{what}: stored with {} bits, the CUDA kernels for it take {want_bits}-bit weights",
                        q.spec.bits
                    )));
                }
                q.spec.bits
            }
            Linear::Dense(_) => want_bits,
        };
        if cols % 64 != 0 {
            return Err(CudaError::Unsupported(format!("{what}: {cols} columns is not a multiple of 64")));
        }
        let words = experts * rows * cols * bits as usize / 32;
        let groups = experts * rows * cols / 64;
        let sizes = [words * 4, groups * 2, groups * 2];
        let offset = self.size;
        self.size += align(sizes[0]) + align(sizes[1]) + align(sizes[2]);
        self.linears.push(PendingLinear { linear, bits, offset, sizes });
        Ok(QMat {
            codes: offset as u64,
            scales: (offset + align(sizes[0])) as u64,
            biases: (offset + align(sizes[0]) + align(sizes[1])) as u64,
            rows,
            cols,
            experts,
            bits,
        })
    }

    /// Space for a packed matrix with no source (synthetic weights).
    fn shape(&mut self, rows: usize, cols: usize, experts: usize, bits: u32) -> QMat {
        let words = experts * rows * cols * bits as usize / 32;
        let groups = experts * rows * cols / 64;
        let offset = self.size;
        self.size += align(words * 4) + 2 * align(groups * 2);
        QMat {
            codes: offset as u64,
            scales: (offset + align(words * 4)) as u64,
            biases: (offset + align(words * 4) + align(groups * 2)) as u64,
            rows,
            cols,
            experts,
            bits,
        }
    }

    fn vector(&mut self, v: Vec<f32>) -> u64 {
        let offset = self.size;
        self.size += align(v.len() * 4);
        self.vectors.push((offset, v));
        offset as u64
    }
}

/// Adds the buffer base to every offset of a QMat.
fn rebase(m: &mut QMat, base: u64) {
    m.codes += base;
    m.scales += base;
    m.biases += base;
}

/// Uploads `w` to the GPU. `progress(done, total)` is called after every
/// piece with bytes of the uploaded form.
pub fn upload(gpu: &Arc<Gpu>, w: &Weights, dims: &Dims, progress: &mut dyn FnMut(u64, u64)) -> CudaResult<DeviceWeights> {
    let cfg = &w.config;
    let mut pl = Planner { size: 0, linears: Vec::new(), vectors: Vec::new() };
    let mut embed = pl.linear(&w.embed, 4, "embed_tokens")?;
    let mut lm_head = pl.linear(&w.lm_head, 4, "lm_head")?;
    let final_norm = pl.vector(w.final_norm.clone());
    let inv_freq = pl.vector(dims.inv_freq());
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        let name = |s: &str| format!("layer {i} {s}");
        let mixer = match &l.mixer {
            Mixer::DeltaNet(d) => {
                if d.conv.len() != dims.conv_dim * dims.conv_k {
                    return Err(CudaError::Weights(format!("layer {i}: conv1d has {} taps, expected {}", d.conv.len(), dims.conv_dim * dims.conv_k)));
                }
                MixerDev::DeltaNet(DeltaNetDev {
                    in_qkv: pl.linear(&d.in_qkv, 4, &name("in_proj_qkv"))?,
                    in_z: pl.linear(&d.in_z, 4, &name("in_proj_z"))?,
                    in_a: pl.linear(&d.in_a, 4, &name("in_proj_a"))?,
                    in_b: pl.linear(&d.in_b, 4, &name("in_proj_b"))?,
                    out: pl.linear(&d.out, 4, &name("out_proj"))?,
                    conv_w: pl.vector(d.conv.clone()),
                    a_log: pl.vector(d.a_log.clone()),
                    dt_bias: pl.vector(d.dt_bias.clone()),
                    norm: pl.vector(d.norm.clone()),
                })
            }
            Mixer::Attention(a) => MixerDev::Attention(AttentionDev {
                q: pl.linear(&a.q, 4, &name("q_proj"))?,
                k: pl.linear(&a.k, 4, &name("k_proj"))?,
                v: pl.linear(&a.v, 4, &name("v_proj"))?,
                o: pl.linear(&a.o, 4, &name("o_proj"))?,
                q_norm: pl.vector(a.q_norm.clone()),
                k_norm: pl.vector(a.k_norm.clone()),
            }),
        };
        let m = &l.moe;
        let moe = MoeDev {
            router: pl.linear(&m.router, 8, &name("mlp.gate"))?,
            gate: pl.linear(&m.gate, 4, &name("experts gate_proj"))?,
            up: pl.linear(&m.up, 4, &name("experts up_proj"))?,
            down: pl.linear(&m.down, 4, &name("experts down_proj"))?,
            sh_gate: pl.linear(&m.shared_gate, 4, &name("shared_expert.gate_proj"))?,
            sh_up: pl.linear(&m.shared_up, 4, &name("shared_expert.up_proj"))?,
            sh_down: pl.linear(&m.shared_down, 4, &name("shared_expert.down_proj"))?,
            sh_expert_gate: pl.linear(&m.shared_expert_gate, 8, &name("shared_expert_gate"))?,
        };
        layers.push(LayerDev { input_norm: pl.vector(l.input_norm.clone()), post_norm: pl.vector(l.post_norm.clone()), mixer, moe });
    }
    if layers.len() != cfg.num_layers {
        return Err(CudaError::Weights(format!("{} layers loaded, config says {}", layers.len(), cfg.num_layers)));
    }

    let total = pl.size;
    let buffer = DeviceBuffer::zeroed(gpu, total, "model weights")?;
    let base = buffer.ptr();
    let mut done = 0u64;
    progress(0, total as u64);
    for (offset, v) in &pl.vectors {
        buffer.upload_sync_at(*offset, v)?;
        done += (v.len() * 4) as u64;
    }
    for p in &pl.linears {
        let pieces: [Piece; 3] = match p.linear {
            Linear::Quant(q) => [Piece::Mapped(q.codes.bytes()), to_bf16_piece(&q.scales), to_bf16_piece(&q.biases)],
            Linear::Dense(_) => {
                let [c, s, b] = quantize_dense(p.linear, p.bits)?;
                [Piece::Owned(c), Piece::Owned(s), Piece::Owned(b)]
            }
        };
        let mut off = p.offset;
        for (piece, size) in pieces.iter().zip(p.sizes) {
            if piece.len() != size {
                return Err(CudaError::Weights(format!("a tensor has {} bytes, the plan expected {size}", piece.len())));
            }
            match piece {
                Piece::Mapped(b) => buffer.upload_at(off, b)?,
                Piece::Owned(v) => buffer.upload_sync_at(off, v)?,
            }
            off += align(size);
            done += size as u64;
        }
        progress(done, total as u64);
    }
    gpu.synchronize()?;
    progress(total as u64, total as u64);

    rebase(&mut embed, base);
    rebase(&mut lm_head, base);
    rebase_layers(&mut layers, base);
    Ok(DeviceWeights { _buffer: buffer, embed, layers, final_norm: final_norm + base, lm_head, inv_freq: inv_freq + base, bytes: total })
}

fn rebase_layers(layers: &mut [LayerDev], base: u64) {
    for l in layers {
        l.input_norm += base;
        l.post_norm += base;
        match &mut l.mixer {
            MixerDev::DeltaNet(d) => {
                for m in [&mut d.in_qkv, &mut d.in_z, &mut d.in_a, &mut d.in_b, &mut d.out] {
                    rebase(m, base);
                }
                d.conv_w += base;
                d.a_log += base;
                d.dt_bias += base;
                d.norm += base;
            }
            MixerDev::Attention(a) => {
                for m in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                    rebase(m, base);
                }
                a.q_norm += base;
                a.k_norm += base;
            }
        }
        let m = &mut l.moe;
        for q in [&mut m.router, &mut m.gate, &mut m.up, &mut m.down, &mut m.sh_gate, &mut m.sh_up, &mut m.sh_down, &mut m.sh_expert_gate] {
            rebase(q, base);
        }
    }
}

/// Random weights of the shape of `dims` made directly in GPU memory
/// (speed probes at the real shape without a 20 GB checkpoint): uniform
/// codes, per-group scales and biases that put each weight in about
/// +-sqrt(3 / fan_in), unit norm gains, small conv taps and gates.
/// The layout of the real model's weights for `dims` (offsets relative to
/// one buffer), with what each piece is filled with when synthetic.
struct ShapePlan {
    size: usize,
    embed: QMat,
    lm_head: QMat,
    final_norm: u64,
    inv_freq: u64,
    layers: Vec<LayerDev>,
    mats: Vec<QMat>,
    vecs: Vec<(u64, usize, f32, f32)>,
}

fn shape_plan(dims: &Dims) -> ShapePlan {
    let d = dims;
    let mut pl = Planner { size: 0, linears: Vec::new(), vectors: Vec::new() };
    let (h, v) = (d.hidden, d.vocab);
    let mut mats: Vec<QMat> = Vec::new();
    let mut vecs: Vec<(u64, usize, f32, f32)> = Vec::new();
    let mut vector = |pl: &mut Planner, n: usize, lo: f32, hi: f32| -> u64 {
        let off = pl.size as u64;
        pl.size += align(n * 4);
        vecs.push((off, n, lo, hi));
        off
    };
    let mut mat = |pl: &mut Planner, rows: usize, cols: usize, experts: usize, bits: u32| -> QMat {
        let m = pl.shape(rows, cols, experts, bits);
        mats.push(m);
        m
    };
    let embed = mat(&mut pl, v, h, 1, 4);
    let lm_head = mat(&mut pl, v, h, 1, 4);
    let final_norm = vector(&mut pl, h, 1.0, 1.0);
    let inv_freq = pl.size as u64;
    pl.size += align(d.rot_dim / 2 * 4);
    let mut layers = Vec::with_capacity(d.layers);
    for i in 0..d.layers {
        let mixer = if i % 4 == 3 {
            let q = 2 * d.a_heads * d.a_head_dim;
            MixerDev::Attention(AttentionDev {
                q: mat(&mut pl, q, h, 1, 4),
                k: mat(&mut pl, d.kv_dim(), h, 1, 4),
                v: mat(&mut pl, d.kv_dim(), h, 1, 4),
                o: mat(&mut pl, h, d.attn_out_dim(), 1, 4),
                q_norm: vector(&mut pl, d.a_head_dim, 1.0, 1.0),
                k_norm: vector(&mut pl, d.a_head_dim, 1.0, 1.0),
            })
        } else {
            MixerDev::DeltaNet(DeltaNetDev {
                in_qkv: mat(&mut pl, d.conv_dim, h, 1, 4),
                in_z: mat(&mut pl, d.gdn_val_dim(), h, 1, 4),
                in_a: mat(&mut pl, d.gv_heads, h, 1, 4),
                in_b: mat(&mut pl, d.gv_heads, h, 1, 4),
                out: mat(&mut pl, h, d.gdn_val_dim(), 1, 4),
                conv_w: vector(&mut pl, d.conv_dim * 4, -0.5, 0.5),
                a_log: vector(&mut pl, d.gv_heads, -1.0, 1.0),
                dt_bias: vector(&mut pl, d.gv_heads, -1.0, 1.0),
                norm: vector(&mut pl, d.gv_dim, 1.0, 1.0),
            })
        };
        let moe = MoeDev {
            router: mat(&mut pl, d.n_experts, h, 1, 8),
            gate: mat(&mut pl, d.moe_inter, h, d.n_experts, 4),
            up: mat(&mut pl, d.moe_inter, h, d.n_experts, 4),
            down: mat(&mut pl, h, d.moe_inter, d.n_experts, 4),
            sh_gate: mat(&mut pl, d.moe_inter, h, 1, 4),
            sh_up: mat(&mut pl, d.moe_inter, h, 1, 4),
            sh_down: mat(&mut pl, h, d.moe_inter, 1, 4),
            sh_expert_gate: mat(&mut pl, 1, h, 1, 8),
        };
        layers.push(LayerDev { input_norm: vector(&mut pl, h, 1.0, 1.0), post_norm: vector(&mut pl, h, 1.0, 1.0), mixer, moe });
    }
    ShapePlan { size: pl.size, embed, lm_head, final_norm, inv_freq, layers, mats, vecs }
}

/// Bytes the packed weights of the model of shape `dims` take on the GPU
/// (the same layout `upload` produces for an MLX checkpoint of that shape).
pub fn planned_bytes(dims: &Dims) -> usize {
    shape_plan(dims).size
}

pub fn synthetic(gpu: &Arc<Gpu>, k: &crate::kernels::Kernels, dims: &Dims, seed: u64) -> CudaResult<DeviceWeights> {
    use crate::synth::{fill, Fill};
    let ShapePlan { size, mut embed, mut lm_head, final_norm, inv_freq, mut layers, mats, vecs } = shape_plan(dims);
    let total = size;
    let buffer = DeviceBuffer::zeroed(gpu, total, "synthetic weights")?;
    let base = buffer.ptr();
    for (i, m) in mats.iter().enumerate() {
        let s = seed.wrapping_mul(1000).wrapping_add(i as u64);
        let levels = ((1u32 << m.bits) - 1) as f32;
        let amp = (3.0 / m.cols as f32).sqrt();
        let scale = 2.0 * amp / levels;
        fill(gpu, k, base + m.codes, m.experts * m.expert_words(), Fill::Words, s)?;
        fill(gpu, k, base + m.scales, m.experts * m.expert_groups(), Fill::Bf16(scale * 0.9, scale * 1.1), s ^ 1)?;
        fill(gpu, k, base + m.biases, m.experts * m.expert_groups(), Fill::Bf16(-amp * 1.05, -amp * 0.95), s ^ 2)?;
    }
    for (j, (off, n, lo, hi)) in vecs.iter().enumerate() {
        fill(gpu, k, base + off, *n, Fill::F32(*lo, *hi), seed ^ (0x5eed + j as u64))?;
    }
    buffer.upload_sync_at(inv_freq as usize, &dims.inv_freq())?;
    rebase(&mut embed, base);
    rebase(&mut lm_head, base);
    rebase_layers(&mut layers, base);
    Ok(DeviceWeights { _buffer: buffer, embed, layers, final_norm: final_norm + base, lm_head, inv_freq: inv_freq + base, bytes: total })
}
