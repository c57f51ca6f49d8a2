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

// One per linear map, built at load: size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum MatData {
    Quant { bits: u32, codes: Words, scales: Floats, biases: Floats },
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
                    return Err(format!("`{}`: unsupported quantisation (bits {}, group {}, cols {})", q.codes.name, bits, q.spec.group_size, q.cols));
                }
                MatData::Quant { bits, codes: Words::new(&q.codes), scales: Floats::new(&q.scales)?, biases: Floats::new(&q.biases)? }
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
        matmul_many(vec![Product { mat: self, expert, x, n, y }]);
    }

    /// [`Mat::matmul`] with a chosen kernel variant, so tests can hold every
    /// variant to the reference on any machine that can run it. A variant
    /// the CPU lacks falls back to the baseline.
    pub fn matmul_isa(&self, variant: Isa, expert: usize, x: &[f32], n: usize, y: &mut [f32]) {
        let variant = if variant == Isa::Avx512 && isa() != Isa::Avx512 { Isa::Baseline } else { variant };
        run_products(variant, vec![Product { mat: self, expert, x, n, y }], true);
    }

    /// Same as [`Mat::matmul`] on the calling thread only.
    pub fn matmul_serial(&self, expert: usize, x: &[f32], n: usize, y: &mut [f32]) {
        run_products(isa(), vec![Product { mat: self, expert, x, n, y }], false);
    }

    /// Row `row` of expert `expert` as f32, in natural column order
    /// (embedding lookup).
    pub fn row_f32(&self, expert: usize, row: usize, out: &mut [f32]) {
        let r = expert * self.rows + row;
        let mut q = [0f32; 64];
        match self.view() {
            MatView::Q4(src) => {
                let (mut sc, mut bi) = (vec![0f32; self.cols / 64], vec![0f32; self.cols / 64]);
                src.params(r, &mut sc, &mut bi);
                for g in 0..self.cols / 64 {
                    src.group(r, g, &mut q);
                    for (j, &qv) in q.iter().enumerate() {
                        out[g * 64 + Q4_LANE_COL[j]] = sc[g] * qv + bi[g];
                    }
                }
            }
            MatView::Q8(src) => {
                let (mut sc, mut bi) = (vec![0f32; self.cols / 64], vec![0f32; self.cols / 64]);
                src.params(r, &mut sc, &mut bi);
                for g in 0..self.cols / 64 {
                    src.group(r, g, &mut q);
                    for (j, &qv) in q.iter().enumerate() {
                        out[g * 64 + j] = sc[g] * qv + bi[g];
                    }
                }
            }
            MatView::Dense(src) => src.weights.load(src.row_start(r), out),
        }
    }

    fn view(&self) -> MatView<'_> {
        match &self.data {
            MatData::Quant { bits, codes, scales, biases } => {
                let src = QuantSource {
                    codes: codes.get(),
                    scales: scales.view(),
                    biases: biases.view(),
                    words_per_row: self.cols * *bits as usize / 32,
                    groups: self.cols / 64,
                };
                if *bits == 4 {
                    MatView::Q4(Q4Source(src))
                } else {
                    MatView::Q8(Q8Source(src))
                }
            }
            MatData::Dense { weights, tensor_rows, row_offset } => {
                MatView::Dense(DenseSource { weights: weights.view(), rows: self.rows, cols: self.cols, tensor_rows: *tensor_rows, row_offset: *row_offset })
            }
        }
    }

    /// Everything a product needs besides its output: the source view, x in
    /// the source's lane order, and x's group sums.
    fn prepare<'a>(&'a self, variant: Isa, expert: usize, x: &'a [f32], n: usize) -> Prepared<'a> {
        let row_base = expert * self.rows;
        let (cols, groups) = (self.cols, self.cols / 64);
        match self.view() {
            MatView::Q4(src) => {
                // The 4-bit kernel holds a group's codes in nibble-plane order
                // (see Q4_LANE_COL); x is permuted to match once per product.
                let mut xp = vec![0f32; x.len()];
                for (dst, src) in xp.chunks_exact_mut(64).zip(x.chunks_exact(64)) {
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = src[Q4_LANE_COL[j]];
                    }
                }
                let xsum = group_sums(x);
                Prepared::Q4(Job { variant, src, cols, groups, x: Cow::Owned(xp), xsum, n, row_base })
            }
            MatView::Q8(src) => {
                let xsum = group_sums(x);
                Prepared::Q8(Job { variant, src, cols, groups, x: Cow::Borrowed(x), xsum, n, row_base })
            }
            MatView::Dense(src) => Prepared::Dense(Job { variant, src, cols, groups, x: Cow::Borrowed(x), xsum: Vec::new(), n, row_base }),
        }
    }
}

/// One product of a batch: `y = W[expert] x` for `n` tokens, `x` `[n][cols]`,
/// `y` `[n][rows]`.
pub struct Product<'a> {
    pub mat: &'a Mat,
    pub expert: usize,
    pub x: &'a [f32],
    pub n: usize,
    pub y: &'a mut [f32],
}

/// Runs several products as one parallel region: the rows of all of them
/// are cut into blocks spread over the pool together, so a handful of small
/// matrices (the chosen experts of one token, the four DeltaNet input
/// projections) still keep every thread busy, with one synchronisation.
pub fn matmul_many(products: Vec<Product<'_>>) {
    run_products(isa(), products, true)
}

/// A prepared product, dispatching to its source's kernels.
enum Prepared<'a> {
    Q4(Job<'a, Q4Source<'a>>),
    Q8(Job<'a, Q8Source<'a>>),
    Dense(Job<'a, DenseSource<'a>>),
}

impl Prepared<'_> {
    fn rows(&self, first: usize, out: &mut [f32]) {
        match self {
            Prepared::Q4(j) => j.rows(first, out),
            Prepared::Q8(j) => j.rows(first, out),
            Prepared::Dense(j) => j.rows(first, out),
        }
    }
}

fn run_products(variant: Isa, products: Vec<Product<'_>>, parallel: bool) {
    let products: Vec<Product> = products.into_iter().filter(|p| p.n > 0 && p.mat.rows > 0).collect();
    for p in &products {
        debug_assert!(p.expert < p.mat.experts);
        debug_assert_eq!(p.x.len(), p.n * p.mat.cols);
        debug_assert_eq!(p.y.len(), p.n * p.mat.rows);
    }
    let mut prepared = Vec::with_capacity(products.len());
    let mut outs: Vec<(&mut [f32], usize, usize)> = Vec::with_capacity(products.len());
    for p in products {
        prepared.push(p.mat.prepare(variant, p.expert, p.x, p.n));
        outs.push((p.y, p.n, p.mat.rows));
    }
    let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
    let total_rows: usize = outs.iter().map(|o| o.2).sum();
    let block = (total_rows / (threads * 16)).clamp(16, 512);
    // Rows are computed into [rows][n] (contiguous per row); with one token
    // that is y itself, otherwise a buffer transposed into y afterwards.
    let mut buffers: Vec<Vec<f32>> = outs.iter().map(|&(_, n, rows)| if n == 1 { Vec::new() } else { vec![0f32; rows * n] }).collect();
    {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (pi, ((y, n, _), buf)) in outs.iter_mut().zip(buffers.iter_mut()).enumerate() {
            let target: &mut [f32] = if *n == 1 { y } else { buf };
            for (b, chunk) in target.chunks_mut(block * *n).enumerate() {
                tasks.push((pi, b * block, chunk));
            }
        }
        if parallel && tasks.len() > 1 {
            tasks.par_iter_mut().for_each(|(pi, first, out)| prepared[*pi].rows(*first, out));
        } else {
            for (pi, first, out) in tasks.iter_mut() {
                prepared[*pi].rows(*first, out);
            }
        }
    }
    for ((y, n, rows), buf) in outs.into_iter().zip(&buffers) {
        if n > 1 {
            for r in 0..rows {
                for t in 0..n {
                    y[t * rows + r] = buf[r * n + t];
                }
            }
        }
    }
}

/// Sums of each group of 64 consecutive values (the bias term of a
/// quantised group is `bias * sum(x_g)`).
fn group_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(64).map(|g| g.iter().sum()).collect()
}

/// Column (within its group) of the code in lane `j` of the 4-bit kernel:
/// lanes 0..32 are the low nibbles of the group's 32 bytes, lanes 32..64 the
/// high nibbles. Byte `b` of word `i` holds codes `8i + 2b` (low) and
/// `8i + 2b + 1` (high), so unpacking is one mask or one shift per byte.
const Q4_LANE_COL: [usize; 64] = {
    let mut t = [0usize; 64];
    let mut j = 0;
    while j < 64 {
        let (half, jj) = (j / 32, j % 32);
        t[j] = (jj / 4) * 8 + 2 * (jj % 4) + half;
        j += 1;
    }
    t
};

enum MatView<'a> {
    Q4(Q4Source<'a>),
    Q8(Q8Source<'a>),
    Dense(DenseSource<'a>),
}

/// Where a kernel gets one group of 64 weights from, as f32 in lane order.
trait Source: Sync {
    /// Quantised sources have per-group scale and bias; dense ones do not.
    const QUANT: bool;
    /// 4-bit sources have a hand-written AVX-512 kernel.
    const Q4: bool = false;
    /// The packed words of absolute row `r` (4-bit sources only).
    fn q4_row(&self, _r: usize) -> &[u32] {
        &[]
    }
    /// Per-group scales and biases of absolute rows `r..` into `sc`, `bi`
    /// (`groups` values per row, as many rows as they hold; untouched when
    /// dense).
    fn params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]);
    /// Codes (quantised) or weights (dense) of group `g` of row `r`.
    fn group(&self, r: usize, g: usize, q: &mut [f32; 64]);
}

struct QuantSource<'a> {
    codes: Cow<'a, [u32]>,
    scales: FloatView<'a>,
    biases: FloatView<'a>,
    words_per_row: usize,
    groups: usize,
}

impl QuantSource<'_> {
    #[inline(always)]
    fn params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]) {
        self.scales.load(r * self.groups, sc);
        self.biases.load(r * self.groups, bi);
    }
}

struct Q4Source<'a>(QuantSource<'a>);
struct Q8Source<'a>(QuantSource<'a>);

impl Source for Q4Source<'_> {
    const QUANT: bool = true;
    const Q4: bool = true;
    fn q4_row(&self, r: usize) -> &[u32] {
        let w = self.0.words_per_row;
        &self.0.codes[r * w..(r + 1) * w]
    }
    #[inline(always)]
    fn params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]) {
        self.0.params(r, sc, bi)
    }
    #[inline(always)]
    fn group(&self, r: usize, g: usize, q: &mut [f32; 64]) {
        let start = r * self.0.words_per_row + g * 8;
        let words = &self.0.codes[start..start + 8];
        for (i, w) in words.iter().enumerate() {
            let b = w.to_le_bytes();
            for k in 0..4 {
                q[i * 4 + k] = (b[k] & 15) as f32;
                q[32 + i * 4 + k] = (b[k] >> 4) as f32;
            }
        }
    }
}

impl Source for Q8Source<'_> {
    const QUANT: bool = true;
    #[inline(always)]
    fn params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]) {
        self.0.params(r, sc, bi)
    }
    #[inline(always)]
    fn group(&self, r: usize, g: usize, q: &mut [f32; 64]) {
        let start = r * self.0.words_per_row + g * 16;
        let words = &self.0.codes[start..start + 16];
        for (i, w) in words.iter().enumerate() {
            let b = w.to_le_bytes();
            for k in 0..4 {
                q[i * 4 + k] = b[k] as f32;
            }
        }
    }
}

struct DenseSource<'a> {
    weights: FloatView<'a>,
    rows: usize,
    cols: usize,
    tensor_rows: usize,
    row_offset: usize,
}

impl DenseSource<'_> {
    /// Element offset of absolute row `r` (expert-major) in the tensor.
    fn row_start(&self, r: usize) -> usize {
        let (e, row) = (r / self.rows, r % self.rows);
        (e * self.tensor_rows + self.row_offset + row) * self.cols
    }
}

impl Source for DenseSource<'_> {
    const QUANT: bool = false;
    fn params(&self, _r: usize, _sc: &mut [f32], _bi: &mut [f32]) {}
    #[inline(always)]
    fn group(&self, r: usize, g: usize, q: &mut [f32; 64]) {
        self.weights.load(self.row_start(r) + g * 64, q);
    }
}

/// Tokens above which a row is dequantised once and dotted with tiles of
/// tokens, rather than unpacked per tile of tokens.
const SMALL_N: usize = 8;

/// Everything one product needs, shared by the row blocks.
struct Job<'a, S: Source> {
    variant: Isa,
    src: S,
    cols: usize,
    groups: usize,
    /// `[n][cols]`, in the source's lane order.
    x: Cow<'a, [f32]>,
    /// `[n][groups]` (quantised sources only).
    xsum: Vec<f32>,
    n: usize,
    row_base: usize,
}

impl<S: Source> Job<'_, S> {
    /// Computes rows `first..` into `out` (`[rows][n]`), dispatching on the
    /// CPU's kernel variant.
    fn rows(&self, first: usize, out: &mut [f32]) {
        match self.variant {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a job carries Avx512 only when `isa()` detected avx512f,
            // avx512bw, avx512vl and fma on this CPU (`matmul_isa` downgrades
            // otherwise), which is what this variant is compiled for.
            Isa::Avx512 => unsafe { self.rows_avx512(first, out) },
            _ => self.rows_generic::<false>(first, out),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn rows_avx512(&self, first: usize, out: &mut [f32]) {
        if !S::Q4 {
            return self.rows_generic::<true>(first, out);
        }
        let (n, groups) = (self.n, self.groups);
        let count = out.len() / n;
        // Scales and biases of the block's rows (contiguous in the file),
        // converted once in one vectorised pass.
        let mut sc = vec![0f32; count * groups];
        let mut bi = vec![0f32; count * groups];
        self.src.params(self.row_base + first, &mut sc, &mut bi);
        out.fill(0.0);
        // A decode-sized call walks each row once. A prefill-sized one is
        // blocked over columns so that a tile of tokens' x (8 tokens x 512
        // columns = 16 KB) stays in L1 while every row of the block passes
        // over it; partial sums accumulate in `out`.
        let span = if n <= avx512::MAX_TOKENS { groups } else { avx512::BLOCK_GROUPS };
        let mut g0 = 0;
        while g0 < groups {
            let g1 = (g0 + span).min(groups);
            let mut t = 0;
            while t < n {
                let m = (n - t).min(avx512::MAX_TOKENS);
                let tokens = avx512::Tokens { x: &self.x, xsum: &self.xsum, cols: self.cols, first: t, groups: g0..g1 };
                for i in 0..count {
                    let r = self.row_base + first + i;
                    let row = avx512::Q4Row { codes: self.src.q4_row(r), scales: &sc[i * groups..(i + 1) * groups], biases: &bi[i * groups..(i + 1) * groups] };
                    let dst = &mut out[i * n + t..i * n + t + m];
                    match m {
                        1 => avx512::q4_dot::<1>(&row, &tokens, dst),
                        2 => avx512::q4_dot::<2>(&row, &tokens, dst),
                        3 => avx512::q4_dot::<3>(&row, &tokens, dst),
                        4 => avx512::q4_dot::<4>(&row, &tokens, dst),
                        5 => avx512::q4_dot::<5>(&row, &tokens, dst),
                        6 => avx512::q4_dot::<6>(&row, &tokens, dst),
                        7 => avx512::q4_dot::<7>(&row, &tokens, dst),
                        _ => avx512::q4_dot::<8>(&row, &tokens, dst),
                    }
                }
                t += m;
            }
            g0 = g1;
        }
    }

    #[inline(always)]
    fn rows_generic<const FMA: bool>(&self, first: usize, out: &mut [f32]) {
        let n = self.n;
        let mut w = if n > SMALL_N { vec![0f32; self.cols] } else { Vec::new() };
        let (mut sc, mut bi) = (vec![0f32; self.groups], vec![0f32; self.groups]);
        for (i, dst) in out.chunks_exact_mut(n).enumerate() {
            let r = self.row_base + first + i;
            self.src.params(r, &mut sc, &mut bi);
            if n <= SMALL_N {
                let mut t = 0;
                while t < n {
                    let m = (n - t).min(TILE);
                    match m {
                        1 => self.small::<1, FMA>(r, t, &sc, &bi, &mut dst[t..t + 1]),
                        2 => self.small::<2, FMA>(r, t, &sc, &bi, &mut dst[t..t + 2]),
                        3 => self.small::<3, FMA>(r, t, &sc, &bi, &mut dst[t..t + 3]),
                        _ => self.small::<TILE, FMA>(r, t, &sc, &bi, &mut dst[t..t + TILE]),
                    }
                    t += m;
                }
            } else {
                let mut q = [0f32; 64];
                for (g, wg) in w.chunks_exact_mut(64).enumerate() {
                    self.src.group(r, g, &mut q);
                    if S::QUANT {
                        for (o, &qv) in wg.iter_mut().zip(&q) {
                            *o = madd::<FMA>(sc[g], qv, bi[g]);
                        }
                    } else {
                        wg.copy_from_slice(&q);
                    }
                }
                tile_dots::<FMA>(&w, &self.x, n, dst);
            }
        }
    }

    /// Row `r` against tokens `t0..t0 + N`, unpacking each group once for
    /// the N tokens: per group, lane-wise `sum q * x` is scaled into the
    /// row accumulator (no horizontal sum per group); the bias term adds
    /// `bias_g * sum(x_g)`.
    #[inline(always)]
    fn small<const N: usize, const FMA: bool>(&self, r: usize, t0: usize, sc: &[f32], bi: &[f32], dst: &mut [f32]) {
        let cols = self.cols;
        let mut acc = [[0f32; LANES]; N];
        let mut bias_acc = [0f32; N];
        let mut q = [0f32; 64];
        for g in 0..self.groups {
            self.src.group(r, g, &mut q);
            for t in 0..N {
                let xg = &self.x[(t0 + t) * cols + g * 64..][..64];
                let mut ga = [0f32; LANES];
                for c in 0..64 / LANES {
                    for l in 0..LANES {
                        ga[l] = madd::<FMA>(q[c * LANES + l], xg[c * LANES + l], ga[l]);
                    }
                }
                if S::QUANT {
                    for l in 0..LANES {
                        acc[t][l] = madd::<FMA>(sc[g], ga[l], acc[t][l]);
                    }
                    bias_acc[t] = madd::<FMA>(bi[g], self.xsum[(t0 + t) * self.groups + g], bias_acc[t]);
                } else {
                    for l in 0..LANES {
                        acc[t][l] += ga[l];
                    }
                }
            }
        }
        for t in 0..N {
            dst[t] = reduce(&acc[t]) + bias_acc[t];
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

/// The hand-written AVX-512 kernel for 4-bit rows (the bulk of the model:
/// every projection, expert, the embedding and lm_head).
///
/// Per group of 64 codes: one 32-byte load; low nibbles by a mask, high
/// nibbles by a 16-bit shift and the mask (lanes in `Q4_LANE_COL` order);
/// four zero-extend + convert steps give 64 f32 codes in 4 registers. For
/// each of up to `MAX_TOKENS` tokens, four FMAs against x (already in lane
/// order) give a 16-lane group sum, which one more FMA scales into the
/// token's row accumulator; the bias term is `bias_g * sum(x_g)`, scalar.
/// One horizontal sum per token per row.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Tokens one call handles (accumulators + codes stay in registers).
    pub const MAX_TOKENS: usize = 8;
    /// Groups per column block of a prefill-sized product.
    pub const BLOCK_GROUPS: usize = 8;

    pub struct Q4Row<'a> {
        /// The row's packed words: 8 per group.
        pub codes: &'a [u32],
        pub scales: &'a [f32],
        pub biases: &'a [f32],
    }

    pub struct Tokens<'a> {
        /// `[n][cols]` in lane order.
        pub x: &'a [f32],
        /// `[n][cols / 64]`.
        pub xsum: &'a [f32],
        pub cols: usize,
        /// First token of this call.
        pub first: usize,
        /// The groups (column blocks of 64) this call covers.
        pub groups: std::ops::Range<usize>,
    }

    /// `out[t] += row . x[first + t]` over the call's groups, for `t < N`
    /// (`out.len() == N`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub fn q4_dot<const N: usize>(row: &Q4Row, tok: &Tokens, out: &mut [f32]) {
        let groups = tok.cols / 64;
        // Every pointer read below stays inside these bounds; a shape bug
        // upstream must not turn into an out-of-bounds read.
        let fits = out.len() == N
            && tok.groups.end <= groups
            && row.codes.len() >= groups * 8
            && row.scales.len() >= groups
            && row.biases.len() >= groups
            && tok.x.len() >= (tok.first + N) * tok.cols
            && tok.xsum.len() >= (tok.first + N) * groups;
        debug_assert!(fits, "q4_dot: operand lengths do not match the shapes");
        if !fits {
            // Release builds poison the result rather than read out of bounds.
            out.fill(f32::NAN);
            return;
        }
        let mask = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut bias_acc = [0f32; N];
        let codes = row.codes.as_ptr();
        let x = tok.x.as_ptr();
        for g in tok.groups.clone() {
            // SAFETY: `g * 8 + 8 <= groups * 8 <= codes.len()` (checked above);
            // unaligned loads are used throughout.
            let raw = unsafe { _mm256_loadu_si256(codes.add(g * 8) as *const __m256i) };
            let lo = _mm256_and_si256(raw, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(lo)));
            let q2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
            let q3 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(hi)));
            let scale = _mm512_set1_ps(row.scales[g]);
            let bias = row.biases[g];
            for t in 0..N {
                let tt = tok.first + t;
                // SAFETY: `tt < first + N`, so `tt * cols + g * 64 + 64 <=
                // (first + N) * cols <= x.len()` (checked above).
                let xg = unsafe { x.add(tt * tok.cols + g * 64) };
                let (x0, x1, x2, x3) = unsafe { (_mm512_loadu_ps(xg), _mm512_loadu_ps(xg.add(16)), _mm512_loadu_ps(xg.add(32)), _mm512_loadu_ps(xg.add(48))) };
                let mut s = _mm512_mul_ps(q0, x0);
                s = _mm512_fmadd_ps(q1, x1, s);
                s = _mm512_fmadd_ps(q2, x2, s);
                s = _mm512_fmadd_ps(q3, x3, s);
                acc[t] = _mm512_fmadd_ps(scale, s, acc[t]);
                bias_acc[t] = bias.mul_add(tok.xsum[tt * groups + g], bias_acc[t]);
            }
        }
        for t in 0..N {
            out[t] += _mm512_reduce_add_ps(acc[t]) + bias_acc[t];
        }
    }
}
