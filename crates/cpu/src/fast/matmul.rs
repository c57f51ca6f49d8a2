//! Matrix products directly on the stored weights: packed MLX 4/8-bit codes
//! (dequantised one group at a time, never copied), or bf16/f16/f32 rows.
//!
//! `Mat::matmul` computes `y[t][r] = sum_c W[e][r][c] x[t][c]` for `n`
//! tokens. Work is split over output rows with rayon; each weight row is read
//! once per call whatever `n` is, so a prefill chunk or a decode batch pays
//! for the weights once.
//!
//! Kernels (per output row):
//! - `n == 1` (decode): per group of 64, the codes are unpacked to f32 and
//!   multiplied by the group scale, accumulated against `x` in 16 lanes; the
//!   bias term is `bias_g * sum(x_g)`, with the group sums of `x` computed
//!   once per call.
//! - `n > 1`: the row is dequantised once into an f32 buffer, then dotted
//!   with tiles of 4 tokens.
//!
//! The hot loops are written lane-wise so LLVM vectorises them; they are
//! compiled twice, for AVX-512 (plus FMA) and for the baseline target, and
//! the variant is chosen once at run time from the CPU's features.

use std::borrow::Cow;
use std::sync::OnceLock;

use lily_core::tensors::{DType, TensorRef};
use lily_core::weights::Linear;
use rayon::prelude::*;

/// Lanes of the accumulators (one AVX-512 register of f32).
const LANES: usize = 16;
/// Tokens per tile in the multi-token kernel.
const TILE: usize = 4;

/// A tensor of u32 words, mapped when aligned, else copied once.
#[derive(Clone, Debug)]
struct Words {
    tensor: TensorRef,
    copy: Option<Vec<u32>>,
}

impl Words {
    fn new(tensor: &TensorRef) -> Self {
        let copy = match tensor.as_u32() {
            Cow::Borrowed(_) => None,
            Cow::Owned(v) => Some(v),
        };
        Words { tensor: tensor.clone(), copy }
    }
    fn get(&self) -> Cow<'_, [u32]> {
        match &self.copy {
            Some(v) => Cow::Borrowed(v.as_slice()),
            None => self.tensor.as_u32(),
        }
    }
}

/// A tensor of 16-bit words (bf16 or f16 bit patterns), mapped when
/// aligned, else copied once.
#[derive(Clone, Debug)]
struct Halves {
    tensor: TensorRef,
    copy: Option<Vec<u16>>,
}

impl Halves {
    fn new(tensor: &TensorRef) -> Self {
        let copy = match tensor.as_u16() {
            Cow::Borrowed(_) => None,
            Cow::Owned(v) => Some(v),
        };
        Halves { tensor: tensor.clone(), copy }
    }
    fn get(&self) -> Cow<'_, [u16]> {
        match &self.copy {
            Some(v) => Cow::Borrowed(v.as_slice()),
            None => self.tensor.as_u16(),
        }
    }
}

/// A float tensor in its stored type.
#[derive(Clone, Debug)]
enum Floats {
    Bf16(Halves),
    F16(Halves),
    F32(Words),
}

impl Floats {
    fn new(tensor: &TensorRef) -> Result<Self, String> {
        match tensor.dtype {
            DType::BF16 => Ok(Floats::Bf16(Halves::new(tensor))),
            DType::F16 => Ok(Floats::F16(Halves::new(tensor))),
            DType::F32 => Ok(Floats::F32(Words::new(tensor))),
            other => Err(format!("tensor `{}`: dtype {} is not a float type", tensor.name, other.name())),
        }
    }

    /// A borrowed view for the duration of one product.
    fn view(&self) -> FloatView<'_> {
        match self {
            Floats::Bf16(h) => FloatView::Bf16(h.get()),
            Floats::F16(h) => FloatView::F16(h.get()),
            Floats::F32(w) => FloatView::F32(w.get()),
        }
    }
}

enum FloatView<'a> {
    Bf16(Cow<'a, [u16]>),
    F16(Cow<'a, [u16]>),
    F32(Cow<'a, [u32]>),
}

impl FloatView<'_> {
    /// Converts `out.len()` elements starting at `start` to f32.
    #[inline(always)]
    fn load(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            FloatView::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..end]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            FloatView::F16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..end]) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
            FloatView::F32(v) => {
                for (o, &b) in out.iter_mut().zip(&v[start..end]) {
                    *o = f32::from_bits(b);
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum MatData {
    Quant { bits: u32, group: usize, codes: Words, scales: Floats, biases: Floats },
    Dense { weights: Floats, tensor_rows: usize, row_offset: usize },
}

/// A linear map ready for the fast kernels (borrowing the mapped file).
#[derive(Clone, Debug)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub experts: usize,
    data: MatData,
}

/// Which compiled variant of the kernels this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Baseline,
}

/// The kernel variant for this CPU, detected once.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
                return Isa::Avx512;
            }
        }
        Isa::Baseline
    })
}

impl Mat {
    /// Wraps a weight-tree linear. Only group-64 MLX codes of 4 or 8 bits and
    /// float matrices exist in the checkpoints Lily reads; anything else is
    /// refused here rather than computed wrongly later.
    pub fn new(lin: &Linear) -> Result<Self, String> {
        let data = match lin {
            Linear::Quant(q) => {
                let bits = q.spec.bits;
                if !(bits == 4 || bits == 8) || q.spec.group_size != 64 || q.cols % 64 != 0 {
                    return Err(format!(
                        "`{}`: unsupported quantisation (bits {}, group {}, cols {})",
                        q.codes.name, bits, q.spec.group_size, q.cols
                    ));
                }
                MatData::Quant {
                    bits,
                    group: q.spec.group_size,
                    codes: Words::new(&q.codes),
                    scales: Floats::new(&q.scales)?,
                    biases: Floats::new(&q.biases)?,
                }
            }
            Linear::Dense(d) => {
                if d.cols % LANES != 0 {
                    return Err(format!("`{}`: {} columns is not a multiple of {LANES}", d.tensor.name, d.cols));
                }
                MatData::Dense { weights: Floats::new(&d.tensor)?, tensor_rows: d.tensor_rows, row_offset: d.row_offset }
            }
        };
        Ok(Mat { rows: lin.rows(), cols: lin.cols(), experts: lin.experts(), data })
    }

    /// `y = W x` for `n` tokens, rows split over the rayon pool.
    /// `x` is `[n][cols]`, `y` is `[n][rows]`.
    pub fn matmul(&self, expert: usize, x: &[f32], n: usize, y: &mut [f32]) {
        self.product(expert, x, n, y, true)
    }

    /// Same as [`Mat::matmul`] on the calling thread only (for callers that
    /// already parallelise across matrices, like the MoE experts).
    pub fn matmul_serial(&self, expert: usize, x: &[f32], n: usize, y: &mut [f32]) {
        self.product(expert, x, n, y, false)
    }

    /// Row `row` of expert `expert` as f32 (embedding lookup).
    pub fn row_f32(&self, expert: usize, row: usize, out: &mut [f32]) {
        let view = self.view();
        let mut scratch = RowScratch::new(self.cols);
        view.dequant_row(self, expert * self.rows + row, out, &mut scratch);
    }

    fn view(&self) -> MatView<'_> {
        match &self.data {
            MatData::Quant { bits, group, codes, scales, biases } => MatView::Quant {
                bits: *bits,
                group: *group,
                codes: codes.get(),
                scales: scales.view(),
                biases: biases.view(),
            },
            MatData::Dense { weights, tensor_rows, row_offset } => {
                MatView::Dense { weights: weights.view(), tensor_rows: *tensor_rows, row_offset: *row_offset }
            }
        }
    }

    fn product(&self, expert: usize, x: &[f32], n: usize, y: &mut [f32], parallel: bool) {
        debug_assert!(expert < self.experts);
        debug_assert_eq!(x.len(), n * self.cols);
        debug_assert_eq!(y.len(), n * self.rows);
        if n == 0 {
            return;
        }
        let view = self.view();
        let groups = self.cols / 64;
        // Group sums of x: the bias term of a quantised group is bias * sum(x_g).
        let xsum: Vec<f32> = match &view {
            MatView::Quant { .. } => x.chunks_exact(64).map(|g| g.iter().sum()).collect(),
            MatView::Dense { .. } => Vec::new(),
        };
        let job = Job { mat: self, view: &view, x, xsum: &xsum, n, groups, row_base: expert * self.rows };
        let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
        let block = (self.rows / (threads * 8)).clamp(4, 256);
        if n == 1 {
            if parallel {
                y.par_chunks_mut(block).enumerate().for_each(|(b, ys)| job.rows(b * block, ys));
            } else {
                job.rows(0, y);
            }
        } else {
            // Rows are computed into a [rows][n] buffer (contiguous per row),
            // then transposed into y.
            let mut yt = vec![0f32; self.rows * n];
            if parallel {
                yt.par_chunks_mut(block * n).enumerate().for_each(|(b, ys)| job.rows(b * block, ys));
            } else {
                job.rows(0, &mut yt);
            }
            for r in 0..self.rows {
                for t in 0..n {
                    y[t * self.rows + r] = yt[r * n + t];
                }
            }
        }
    }
}

enum MatView<'a> {
    Quant { bits: u32, group: usize, codes: Cow<'a, [u32]>, scales: FloatView<'a>, biases: FloatView<'a> },
    Dense { weights: FloatView<'a>, tensor_rows: usize, row_offset: usize },
}

/// Per-thread buffers of one row.
struct RowScratch {
    w: Vec<f32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
}

impl RowScratch {
    fn new(cols: usize) -> Self {
        RowScratch { w: vec![0.0; cols], scales: vec![0.0; cols / 64 + 1], biases: vec![0.0; cols / 64 + 1] }
    }
}

impl MatView<'_> {
    /// Dequantises absolute row `r` (expert-major) into `out`.
    #[inline(always)]
    fn dequant_row(&self, mat: &Mat, r: usize, out: &mut [f32], s: &mut RowScratch) {
        match self {
            MatView::Quant { bits, group, codes, scales, biases } => {
                let groups = mat.cols / group;
                let words = mat.cols * *bits as usize / 32;
                scales.load(r * groups, &mut s.scales[..groups]);
                biases.load(r * groups, &mut s.biases[..groups]);
                let row = &codes[r * words..(r + 1) * words];
                let wpg = 64 * *bits as usize / 32;
                for g in 0..groups {
                    let mut q = [0f32; 64];
                    unpack(*bits, &row[g * wpg..(g + 1) * wpg], &mut q);
                    let (sc, bi) = (s.scales[g], s.biases[g]);
                    for (o, &qv) in out[g * 64..(g + 1) * 64].iter_mut().zip(&q) {
                        *o = sc * qv + bi;
                    }
                }
            }
            MatView::Dense { weights, tensor_rows, row_offset } => {
                let (e, row) = (r / mat.rows, r % mat.rows);
                let abs = e * tensor_rows + row_offset + row;
                weights.load(abs * mat.cols, out);
            }
        }
    }
}

/// Unpacks one group of 64 codes to f32.
#[inline(always)]
fn unpack(bits: u32, words: &[u32], q: &mut [f32; 64]) {
    if bits == 4 {
        for (i, &w) in words.iter().enumerate().take(8) {
            for k in 0..8 {
                q[i * 8 + k] = ((w >> (4 * k)) & 15) as f32;
            }
        }
    } else {
        for (i, &w) in words.iter().enumerate().take(16) {
            for k in 0..4 {
                q[i * 4 + k] = ((w >> (8 * k)) & 255) as f32;
            }
        }
    }
}

/// Everything one product needs, shared by the row blocks.
struct Job<'a> {
    mat: &'a Mat,
    view: &'a MatView<'a>,
    x: &'a [f32],
    xsum: &'a [f32],
    n: usize,
    groups: usize,
    row_base: usize,
}

impl Job<'_> {
    /// Computes rows `first..` into `out` (`[rows][n]`, or `[rows]` when
    /// `n == 1`), dispatching on the CPU's kernel variant.
    fn rows(&self, first: usize, out: &mut [f32]) {
        match isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa()` returned Avx512 only after detecting avx512f and
            // fma on this CPU, which is what the variant is compiled for.
            Isa::Avx512 => unsafe { self.rows_avx512(first, out) },
            _ => self.rows_generic::<false>(first, out),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn rows_avx512(&self, first: usize, out: &mut [f32]) {
        self.rows_generic::<true>(first, out)
    }

    #[inline(always)]
    fn rows_generic<const FMA: bool>(&self, first: usize, out: &mut [f32]) {
        let mat = self.mat;
        let mut s = RowScratch::new(mat.cols);
        let count = out.len() / self.n;
        for i in 0..count {
            let r = self.row_base + first + i;
            if self.n == 1 {
                out[i] = self.dot_one::<FMA>(r, &mut s);
            } else {
                let mut w = std::mem::take(&mut s.w);
                self.view.dequant_row(mat, r, &mut w, &mut s);
                tile_dots::<FMA>(&w, self.x, self.n, &mut out[i * self.n..(i + 1) * self.n]);
                s.w = w;
            }
        }
    }

    /// One row against one token, fused with dequantisation.
    #[inline(always)]
    fn dot_one<const FMA: bool>(&self, r: usize, s: &mut RowScratch) -> f32 {
        let mat = self.mat;
        let x = self.x;
        match self.view {
            MatView::Quant { bits, codes, scales, biases, .. } => {
                let groups = self.groups;
                let words = mat.cols * *bits as usize / 32;
                scales.load(r * groups, &mut s.scales[..groups]);
                biases.load(r * groups, &mut s.biases[..groups]);
                let row = &codes[r * words..(r + 1) * words];
                let wpg = 64 * *bits as usize / 32;
                let mut acc = [0f32; LANES];
                let mut bias_acc = 0f32;
                for g in 0..groups {
                    let mut q = [0f32; 64];
                    unpack(*bits, &row[g * wpg..(g + 1) * wpg], &mut q);
                    let sc = s.scales[g];
                    let xg = &x[g * 64..(g + 1) * 64];
                    for c in 0..64 / LANES {
                        for l in 0..LANES {
                            acc[l] = madd::<FMA>(q[c * LANES + l] * sc, xg[c * LANES + l], acc[l]);
                        }
                    }
                    bias_acc = madd::<FMA>(s.biases[g], self.xsum[g], bias_acc);
                }
                reduce(&acc) + bias_acc
            }
            MatView::Dense { .. } => {
                let mut w = std::mem::take(&mut s.w);
                self.view.dequant_row(mat, r, &mut w, s);
                let mut acc = [0f32; LANES];
                for (wc, xc) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        acc[l] = madd::<FMA>(wc[l], xc[l], acc[l]);
                    }
                }
                s.w = w;
                reduce(&acc)
            }
        }
    }
}

/// `out[t] = w . x[t]` for every token, four tokens at a time.
#[inline(always)]
fn tile_dots<const FMA: bool>(w: &[f32], x: &[f32], n: usize, out: &mut [f32]) {
    let cols = w.len();
    let mut t = 0;
    while t < n {
        let m = TILE.min(n - t);
        let mut acc = [[0f32; LANES]; TILE];
        for (c, wc) in w.chunks_exact(LANES).enumerate() {
            for (j, a) in acc.iter_mut().enumerate().take(m) {
                let xc = &x[(t + j) * cols + c * LANES..][..LANES];
                for l in 0..LANES {
                    a[l] = madd::<FMA>(wc[l], xc[l], a[l]);
                }
            }
        }
        for j in 0..m {
            out[t + j] = reduce(&acc[j]);
        }
        t += m;
    }
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}
