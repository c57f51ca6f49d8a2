//! Streams a planned checkpoint to disk.
//!
//! Every shard is created at its final length with its header in place;
//! then the write units are cut into blocks of rows, and rayon workers fill
//! them in any order with positioned writes (`pwrite`) at the offsets the
//! plan fixed. A block is generated (or read), quantised and written, then
//! dropped, so memory use is a few blocks per worker (a few MB), whatever
//! the checkpoint's size. The output does not depend on the block size, the
//! thread count or the order of the work: each block's bytes are a function
//! of the source and the block's rows alone.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::bf16;
use lily_core::quant;
use lily_core::tensors::DType;
use lily_core::weights::Role;
use lily_core::{Error, Result};
use rayon::prelude::*;

use crate::layout::{units, DenseRows, LinearParam, Source, Unit};
use crate::plan::Plan;
use crate::Progress;

/// Elements a worker handles per block (4 MB of f32).
const BLOCK_ELEMS: usize = 1 << 20;

/// One block of work: rows `row0 .. row0 + rows` of unit `unit` (vectors
/// are a single block).
struct Block {
    unit: usize,
    row0: usize,
    rows: usize,
}

/// Writes all shards of `plan` into `dir`, filling tensors from `source`.
/// Returns the bytes written (headers and data).
pub fn write_shards(plan: &Plan, dir: &Path, source: &dyn Source, progress: &(dyn Fn(Progress) + Sync)) -> Result<u64> {
    let total = plan.total_file_bytes();
    let done = AtomicU64::new(0);
    let report = |bytes: u64| {
        let d = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        progress(Progress { bytes_done: d, bytes_total: total });
    };
    let mut files = Vec::with_capacity(plan.shards.len());
    for shard in &plan.shards {
        let path = dir.join(&shard.file_name);
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        file.set_len(shard.file_bytes()).map_err(|e| Error::io(&path, e))?;
        file.write_all_at(&shard.header, 0).map_err(|e| Error::io(&path, e))?;
        report(shard.header.len() as u64);
        files.push((path, file));
    }

    let units = units(plan)?;
    let mut blocks = Vec::new();
    for (u, unit) in units.iter().enumerate() {
        let (rows, cols) = match unit {
            Unit::Quant { param, .. } => (param.experts * param.rows, param.cols),
            Unit::Dense { total_rows, cols, .. } => (*total_rows, *cols),
            Unit::Vector { .. } => (1, 1),
        };
        let step = (BLOCK_ELEMS / cols.max(1)).max(1);
        let mut row0 = 0;
        while row0 < rows {
            let n = step.min(rows - row0);
            blocks.push(Block { unit: u, row0, rows: n });
            row0 += n;
        }
    }

    let writer = Writer { plan, files: &files };
    blocks.par_iter().try_for_each(|b| -> Result<()> {
        let written = writer.block(&units[b.unit], b.row0, b.rows, source)?;
        report(written);
        Ok(())
    })?;
    Ok(done.load(Ordering::Relaxed))
}

struct Writer<'a> {
    plan: &'a Plan,
    files: &'a [(PathBuf, File)],
}

impl Writer<'_> {
    /// Writes `bytes` at byte `at` of tensor `tensor`'s data.
    fn put(&self, tensor: usize, at: u64, bytes: &[u8]) -> Result<u64> {
        let t = &self.plan.tensors[tensor];
        if at + bytes.len() as u64 > t.bytes {
            return Err(Error::Other(format!("writer: {} bytes at {at} overflow `{}` ({} bytes)", bytes.len(), t.spec.name, t.bytes)));
        }
        let (path, file) = &self.files[t.shard];
        file.write_all_at(bytes, t.offset + at).map_err(|e| Error::io(path, e))?;
        Ok(bytes.len() as u64)
    }

    fn block(&self, unit: &Unit, row0: usize, rows: usize, source: &dyn Source) -> Result<u64> {
        match unit {
            Unit::Quant { param, bits, group, codes, scales, biases } => {
                let mut w = vec![0f32; rows * param.cols];
                source.linear_rows(param, row0, &mut w)?;
                let (q, s, b) = quant::quantize(&w, rows, param.cols, *bits, *group)?;
                let words = param.cols * *bits as usize / 32;
                let groups = param.cols / group;
                let mut n = self.put(*codes, (row0 * words * 4) as u64, &u32_bytes(&q))?;
                let half_of = |i: usize| self.plan.tensors[i].spec.dtype;
                n += self.put(*scales, (row0 * groups) as u64 * half_of(*scales).size() as u64, &float_bytes(&s, half_of(*scales))?)?;
                n += self.put(*biases, (row0 * groups) as u64 * half_of(*biases).size() as u64, &float_bytes(&b, half_of(*biases))?)?;
                Ok(n)
            }
            Unit::Dense { tensor, rows: map, cols, .. } => {
                let mut w = vec![0f32; rows * cols];
                match map {
                    DenseRows::Direct(p) => source.linear_rows(p, row0, &mut w)?,
                    DenseRows::GateUp { gate, up } => gate_up_rows(source, gate, up, row0, &mut w)?,
                }
                let dtype = self.plan.tensors[*tensor].spec.dtype;
                self.put(*tensor, (row0 * cols * dtype.size()) as u64, &float_bytes(&w, dtype)?)
            }
            Unit::Vector { tensor, param } => {
                let mut v = source.vector(param)?;
                if v.len() != param.len {
                    return Err(Error::Other(format!("source gave {} values for `{}`, expected {}", v.len(), param.key, param.len)));
                }
                let spec = &self.plan.tensors[*tensor].spec;
                // One-centred norms come as gains; transformers' layout
                // stores them zero-centred.
                if param.role == Role::NormOneCentered && self.plan.config.format() == lily_core::Format::HfBf16 {
                    for x in &mut v {
                        *x -= 1.0;
                    }
                }
                self.put(*tensor, 0, &float_bytes(&v, spec.dtype)?)
            }
        }
    }
}

/// Fills rows of a fused `[experts, 2 * im, cols]` tensor: per expert the
/// gate rows, then the up rows, each a contiguous run of its own parameter.
fn gate_up_rows(source: &dyn Source, gate: &LinearParam, up: &LinearParam, row0: usize, out: &mut [f32]) -> Result<()> {
    let im = gate.rows;
    let cols = gate.cols;
    let rows = out.len() / cols;
    let mut r = 0;
    while r < rows {
        let global = row0 + r;
        let expert = global / (2 * im);
        let within = global % (2 * im);
        let (param, local, left) = if within < im { (gate, within, im - within) } else { (up, within - im, 2 * im - within) };
        let n = left.min(rows - r);
        source.linear_rows(param, expert * im + local, &mut out[r * cols..(r + n) * cols])?;
        r += n;
    }
    Ok(())
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Encodes f32 values in a stored float type; bf16 and f16 round to
/// nearest even, as MLX and torch do.
pub fn float_bytes(v: &[f32], dtype: DType) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    match dtype {
        DType::BF16 => v.iter().for_each(|x| out.extend_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes())),
        DType::F16 => v.iter().for_each(|x| out.extend_from_slice(&half::f16::from_f32(*x).to_bits().to_le_bytes())),
        DType::F32 => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        other => return Err(Error::Other(format!("writer: cannot store floats as {}", other.name()))),
    }
    Ok(out)
}
