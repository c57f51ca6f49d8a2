//! The model's weights as one typed tree, read from either checkpoint layout.
//!
//! `expected_tensors` is the single list of every tensor a checkpoint of a
//! given config and format must hold (name, dtype, shape); `synth` writes
//! exactly this list and `Weights::load` takes exactly this list, then
//! refuses any tensor left over, except the groups real checkpoints carry
//! that the text model does not use (the vision tower, the multi-token-
//! prediction head): those are listed in `Weights::unused`, never read, and
//! left out of `Weights::model_bytes`.
//! Linear layers stay in their stored form (packed 4/8-bit or bf16, mapped,
//! not copied); small vectors (norm gains, conv taps, gates) are converted to
//! f32 at load, with the RMSNorm convention, which the layout decides,
//! resolved to a plain gain.
//!
//! It also checks the quantisation of every linear it loads against what
//! Lily's kernels run (`check_quantization`), since it is the module that
//! knows which modules those are.

use std::path::Path;
use std::sync::Arc;

use crate::config::{Format, LayerKind, ModelConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::quant;
use crate::tensors::{DType, TensorRef, TensorStore};

/// One tensor a checkpoint must contain.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// The dtype Lily writes; the loader also accepts `alt_dtypes`.
    pub dtype: DType,
    pub alt_dtypes: Vec<DType>,
    pub shape: Vec<usize>,
    /// What the tensor is, so writers can choose values (see `synth`).
    pub role: Role,
}

/// What a tensor holds, independent of naming.
#[derive(Clone, Debug, PartialEq)]
pub enum Role {
    /// A linear map `[experts?, rows, cols]`; for MLX, one of its three parts.
    Linear {
        part: LinearPart,
        rows: usize,
        cols: usize,
        experts: usize,
        fan_in: usize,
    },
    /// An RMSNorm weight stored as `1 + w` (MLX) or `w` (HF) per `Convention`.
    NormOneCentered,
    /// The DeltaNet gated-norm gain (plain gain in both formats).
    NormPlain,
    ConvWeight,
    ALog,
    DtBias,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPart {
    /// bf16 weight (HF layout), `[experts?, rows, cols]`.
    Dense,
    /// Packed codes U32 `[experts?, rows, cols * bits / 32]`.
    Codes {
        bits: u32,
    },
    Scales {
        bits: u32,
    },
    Biases {
        bits: u32,
    },
}

/// Logical description of a linear map, before it is named for a format.
struct LinearDesc {
    path: String,
    rows: usize,
    cols: usize,
    experts: usize,
}

/// MLX module path of layer `i`.
fn mlx_layer(i: usize) -> String {
    format!("language_model.model.layers.{i}")
}
/// HF module path of layer `i`.
fn hf_layer(i: usize) -> String {
    format!("model.language_model.layers.{i}")
}

fn layer_prefix(format: Format, i: usize) -> String {
    match format {
        Format::MlxQ4 => mlx_layer(i),
        Format::HfBf16 => hf_layer(i),
    }
}

/// Names of the tensors outside the layers.
pub struct TopNames {
    pub embed: String,
    pub norm: String,
    pub lm_head: String,
}

pub fn top_names(format: Format) -> TopNames {
    match format {
        Format::MlxQ4 => TopNames {
            embed: "language_model.model.embed_tokens".into(),
            norm: "language_model.model.norm.weight".into(),
            lm_head: "language_model.lm_head".into(),
        },
        Format::HfBf16 => {
            TopNames { embed: "model.language_model.embed_tokens".into(), norm: "model.language_model.norm.weight".into(), lm_head: "lm_head".into() }
        }
    }
}

/// A group of tensors real checkpoints carry that the text model does not use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UnusedKind {
    /// The vision encoder of the vision-language wrapper.
    VisionTower,
    /// The multi-token-prediction head (speculative decoding), which some
    /// conversions keep.
    Mtp,
}

impl UnusedKind {
    /// Name prefixes of each group, in the layouts seen on the hub.
    const PREFIXES: [(UnusedKind, &'static [&'static str]); 2] = [
        (UnusedKind::VisionTower, &["vision_tower.", "model.visual.", "visual."]),
        (UnusedKind::Mtp, &["mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."]),
    ];

    /// The group a tensor belongs to, if it is one the text model does not use.
    pub fn of(name: &str) -> Option<Self> {
        Self::PREFIXES.iter().find(|(_, prefixes)| prefixes.iter().any(|p| name.starts_with(p))).map(|(kind, _)| *kind)
    }
}

impl std::fmt::Display for UnusedKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UnusedKind::VisionTower => "vision tower",
            UnusedKind::Mtp => "multi-token-prediction (MTP) head",
        })
    }
}

/// Tensors of one unused group found in a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnusedGroup {
    pub kind: UnusedKind,
    pub tensors: usize,
    /// Bytes of tensor data in the files (mapped, never read).
    pub bytes: u64,
}

/// Tensors that are in real checkpoints but not used by the text model.
pub fn is_ignored_tensor(name: &str) -> bool {
    UnusedKind::of(name).is_some()
}

/// The bits Lily's kernels run for the MLX linear module at `path` (always
/// with group size 64): 8 for the router and the shared-expert gate, as the
/// MLX conversion stores them, 4 for everything else.
pub fn bits_lily_runs(path: &str) -> u32 {
    if path.ends_with(".mlp.gate") || path.ends_with(".mlp.shared_expert_gate") {
        8
    } else {
        4
    }
}

/// Checks that every linear module Lily loads from an MLX checkpoint is
/// quantised as Lily's kernels run it (`bits_lily_runs`, group size 64);
/// entries of the quantisation block for modules Lily does not load (the
/// vision tower, `mtp`) are not looked at. A BF16 checkpoint has nothing to
/// check.
pub fn check_quantization(cfg: &ModelConfig) -> Result<()> {
    let Some(q) = &cfg.quantization else {
        return Ok(());
    };
    for d in all_linears(cfg) {
        let want = QuantSpec { bits: bits_lily_runs(&d.path), group_size: 64 };
        let (got, source) = match q.overrides.get(&d.path) {
            Some(spec) => (*spec, ""),
            None => (Some(q.default), " (the block's default)"),
        };
        if got != Some(want) {
            let found = match got {
                Some(s) => format!("bits {}, group_size {}{source}", s.bits, s.group_size),
                None => "no quantisation (`false`, or an entry without integer bits and group_size)".to_string(),
            };
            return Err(Error::config(
                format!("quantization.{}", d.path),
                format!("bits {} with group_size {} (what Lily runs for this module)", want.bits, want.group_size),
                found,
            ));
        }
    }
    Ok(())
}

fn linear_specs(cfg: &ModelConfig, d: &LinearDesc, out: &mut Vec<TensorSpec>) {
    let lead: Vec<usize> = if d.experts > 1 || d.path.contains("switch_mlp") || d.path.contains("experts") { vec![d.experts] } else { vec![] };
    let role = |part| Role::Linear { part, rows: d.rows, cols: d.cols, experts: d.experts, fan_in: d.cols };
    match &cfg.quantization {
        None => {
            let mut shape = lead.clone();
            shape.extend([d.rows, d.cols]);
            let name = if d.path.ends_with("gate_up_proj") || d.path.ends_with("experts.down_proj") { d.path.clone() } else { format!("{}.weight", d.path) };
            out.push(TensorSpec { name, dtype: DType::BF16, alt_dtypes: vec![DType::F16, DType::F32], shape, role: role(LinearPart::Dense) });
        }
        Some(q) => {
            // `check_quantization` refuses a module Lily cannot run before
            // a checkpoint is read; this list only has to stay defined (no
            // division by a zero group size) for a config not checked yet.
            let spec = q.spec_for(&d.path).unwrap_or(q.default);
            let bits = spec.bits;
            let mut codes = lead.clone();
            codes.extend([d.rows, d.cols.saturating_mul(bits as usize) / 32]);
            let mut groups = lead.clone();
            groups.extend([d.rows, d.cols / spec.group_size.max(1)]);
            out.push(TensorSpec {
                name: format!("{}.weight", d.path),
                dtype: DType::U32,
                alt_dtypes: vec![],
                shape: codes,
                role: role(LinearPart::Codes { bits }),
            });
            out.push(TensorSpec {
                name: format!("{}.scales", d.path),
                dtype: DType::BF16,
                alt_dtypes: vec![DType::F16, DType::F32],
                shape: groups.clone(),
                role: role(LinearPart::Scales { bits }),
            });
            out.push(TensorSpec {
                name: format!("{}.biases", d.path),
                dtype: DType::BF16,
                alt_dtypes: vec![DType::F16, DType::F32],
                shape: groups,
                role: role(LinearPart::Biases { bits }),
            });
        }
    }
}

fn vec_spec(name: String, len: usize, dtype: DType, role: Role) -> TensorSpec {
    TensorSpec { name, dtype, alt_dtypes: vec![DType::BF16, DType::F16, DType::F32], shape: vec![len], role }
}

/// The linear maps of layer `i`, named for the config's format.
fn layer_linears(cfg: &ModelConfig, i: usize) -> Vec<LinearDesc> {
    let format = cfg.format();
    let p = layer_prefix(format, i);
    let h = cfg.hidden_size;
    let lin = |path: String, rows, cols, experts| LinearDesc { path, rows, cols, experts };
    let mut v = Vec::new();
    match cfg.layer_kind(i) {
        LayerKind::DeltaNet => {
            let la = format!("{p}.linear_attn");
            v.push(lin(format!("{la}.in_proj_qkv"), cfg.linear_conv_dim(), h, 1));
            v.push(lin(format!("{la}.in_proj_z"), cfg.linear_value_dim(), h, 1));
            v.push(lin(format!("{la}.in_proj_a"), cfg.linear_num_value_heads, h, 1));
            v.push(lin(format!("{la}.in_proj_b"), cfg.linear_num_value_heads, h, 1));
            v.push(lin(format!("{la}.out_proj"), h, cfg.linear_value_dim(), 1));
        }
        LayerKind::Attention => {
            let sa = format!("{p}.self_attn");
            v.push(lin(format!("{sa}.q_proj"), cfg.q_proj_dim(), h, 1));
            v.push(lin(format!("{sa}.k_proj"), cfg.kv_dim(), h, 1));
            v.push(lin(format!("{sa}.v_proj"), cfg.kv_dim(), h, 1));
            v.push(lin(format!("{sa}.o_proj"), h, cfg.attn_out_dim(), 1));
        }
    }
    let e = cfg.num_experts;
    let im = cfg.moe_intermediate_size;
    let si = cfg.shared_expert_intermediate_size;
    v.push(lin(format!("{p}.mlp.gate"), e, h, 1));
    match format {
        Format::MlxQ4 => {
            v.push(lin(format!("{p}.mlp.switch_mlp.gate_proj"), im, h, e));
            v.push(lin(format!("{p}.mlp.switch_mlp.up_proj"), im, h, e));
            v.push(lin(format!("{p}.mlp.switch_mlp.down_proj"), h, im, e));
        }
        Format::HfBf16 => {
            v.push(lin(format!("{p}.mlp.experts.gate_up_proj"), 2 * im, h, e));
            v.push(lin(format!("{p}.mlp.experts.down_proj"), h, im, e));
        }
    }
    v.push(lin(format!("{p}.mlp.shared_expert.gate_proj"), si, h, 1));
    v.push(lin(format!("{p}.mlp.shared_expert.up_proj"), si, h, 1));
    v.push(lin(format!("{p}.mlp.shared_expert.down_proj"), h, si, 1));
    v.push(lin(format!("{p}.mlp.shared_expert_gate"), 1, h, 1));
    v
}

/// Every linear map of the model: embedding, the layers', lm_head.
fn all_linears(cfg: &ModelConfig) -> Vec<LinearDesc> {
    let top = top_names(cfg.format());
    let h = cfg.hidden_size;
    let mut out = vec![LinearDesc { path: top.embed, rows: cfg.vocab_size, cols: h, experts: 1 }];
    for i in 0..cfg.num_layers {
        out.extend(layer_linears(cfg, i));
    }
    out.push(LinearDesc { path: top.lm_head, rows: cfg.vocab_size, cols: h, experts: 1 });
    out
}

/// Every tensor a checkpoint of `cfg` (in its format) must hold, in the
/// order Lily writes them.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let format = cfg.format();
    let top = top_names(format);
    let mut out = Vec::new();
    let h = cfg.hidden_size;
    linear_specs(cfg, &LinearDesc { path: top.embed.clone(), rows: cfg.vocab_size, cols: h, experts: 1 }, &mut out);
    for i in 0..cfg.num_layers {
        let p = layer_prefix(format, i);
        out.push(vec_spec(format!("{p}.input_layernorm.weight"), h, DType::BF16, Role::NormOneCentered));
        out.push(vec_spec(format!("{p}.post_attention_layernorm.weight"), h, DType::BF16, Role::NormOneCentered));
        match cfg.layer_kind(i) {
            LayerKind::DeltaNet => {
                let la = format!("{p}.linear_attn");
                let conv_shape = match format {
                    Format::MlxQ4 => vec![cfg.linear_conv_dim(), cfg.conv_kernel, 1],
                    Format::HfBf16 => vec![cfg.linear_conv_dim(), 1, cfg.conv_kernel],
                };
                out.push(TensorSpec {
                    name: format!("{la}.conv1d.weight"),
                    dtype: DType::BF16,
                    alt_dtypes: vec![DType::F16, DType::F32],
                    shape: conv_shape,
                    role: Role::ConvWeight,
                });
                out.push(vec_spec(format!("{la}.A_log"), cfg.linear_num_value_heads, DType::F32, Role::ALog));
                out.push(vec_spec(format!("{la}.dt_bias"), cfg.linear_num_value_heads, DType::BF16, Role::DtBias));
                out.push(vec_spec(format!("{la}.norm.weight"), cfg.linear_value_head_dim, DType::BF16, Role::NormPlain));
            }
            LayerKind::Attention => {
                let sa = format!("{p}.self_attn");
                out.push(vec_spec(format!("{sa}.q_norm.weight"), cfg.head_dim, DType::BF16, Role::NormOneCentered));
                out.push(vec_spec(format!("{sa}.k_norm.weight"), cfg.head_dim, DType::BF16, Role::NormOneCentered));
            }
        }
        for d in layer_linears(cfg, i) {
            linear_specs(cfg, &d, &mut out);
        }
    }
    out.push(vec_spec(top.norm.clone(), h, DType::BF16, Role::NormOneCentered));
    linear_specs(cfg, &LinearDesc { path: top.lm_head.clone(), rows: cfg.vocab_size, cols: h, experts: 1 }, &mut out);
    out
}

/// A quantised linear, still packed in the mapped file.
#[derive(Clone, Debug)]
pub struct QuantLinear {
    pub spec: QuantSpec,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// U32 `[experts?, rows, cols * bits / 32]`.
    pub codes: TensorRef,
    /// Half (bf16 or f16) or f32 `[experts?, rows, cols / group]`.
    pub scales: TensorRef,
    pub biases: TensorRef,
}

/// A bf16/f16/f32 linear. For the HF fused `gate_up_proj`, two views share
/// one tensor: `row_offset` selects the half, `tensor_rows` is its stride.
#[derive(Clone, Debug)]
pub struct DenseLinear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub tensor: TensorRef,
    pub tensor_rows: usize,
    pub row_offset: usize,
}

/// A linear map `y = W x` with `W` of `rows x cols` (per expert when stacked).
#[derive(Clone, Debug)]
// Built once at load and read in place; boxing the larger variant would only
// add an indirection to every matmul's lookup.
#[allow(clippy::large_enum_variant)]
pub enum Linear {
    Quant(QuantLinear),
    Dense(DenseLinear),
}

impl Linear {
    pub fn rows(&self) -> usize {
        match self {
            Linear::Quant(q) => q.rows,
            Linear::Dense(d) => d.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Linear::Quant(q) => q.cols,
            Linear::Dense(d) => d.cols,
        }
    }
    pub fn experts(&self) -> usize {
        match self {
            Linear::Quant(q) => q.experts,
            Linear::Dense(d) => d.experts,
        }
    }

    /// Dequantises (or converts) row `row` of expert `expert` into `out`.
    /// This is the plain reference path; backends read the packed data directly.
    pub fn row_f32(&self, expert: usize, row: usize, out: &mut [f32]) {
        assert!(expert < self.experts() && row < self.rows() && out.len() == self.cols());
        match self {
            Linear::Quant(q) => {
                let bits = q.spec.bits;
                let words = q.cols * bits as usize / 32;
                let groups = q.cols / q.spec.group_size;
                let r = expert * q.rows + row;
                let codes = q.codes.as_u32();
                let scales = half_row(&q.scales, r * groups, groups);
                let biases = half_row(&q.biases, r * groups, groups);
                quant::dequantize_row(&codes[r * words..(r + 1) * words], &scales, &biases, bits, q.spec.group_size, out);
            }
            Linear::Dense(d) => {
                let r = expert * d.tensor_rows + d.row_offset + row;
                let v = half_row(&d.tensor, r * d.cols, d.cols);
                out.copy_from_slice(&v);
            }
        }
    }

    /// The whole matrix of one expert as f32 `[rows, cols]` (tests, conversion).
    pub fn to_f32(&self, expert: usize) -> Vec<f32> {
        let mut m = vec![0f32; self.rows() * self.cols()];
        for (r, chunk) in m.chunks_exact_mut(self.cols()).enumerate() {
            self.row_f32(expert, r, chunk);
        }
        m
    }
}

/// Reads `len` float elements at element offset `start` of a float tensor.
pub fn half_row(t: &TensorRef, start: usize, len: usize) -> Vec<f32> {
    let b = t.bytes();
    let es = t.dtype.size();
    let bytes = &b[start * es..(start + len) * es];
    match t.dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
        _ => bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
    }
}

/// Gated DeltaNet mixer weights.
#[derive(Clone, Debug)]
pub struct DeltaNetWeights {
    pub in_qkv: Linear,
    pub in_z: Linear,
    pub in_a: Linear,
    pub in_b: Linear,
    pub out: Linear,
    /// Depthwise conv taps `[channels][kernel]`, oldest input first.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm gain over one value head.
    pub norm: Vec<f32>,
}

/// Gated full-attention mixer weights.
#[derive(Clone, Debug)]
pub struct AttentionWeights {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Clone, Debug)]
// One per layer, built once at load: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    DeltaNet(DeltaNetWeights),
    Attention(AttentionWeights),
}

/// Routed experts plus the shared expert.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub router: Linear,
    /// Stacked `[experts, intermediate, hidden]`.
    pub gate: Linear,
    pub up: Linear,
    /// Stacked `[experts, hidden, intermediate]`.
    pub down: Linear,
    pub shared_gate: Linear,
    pub shared_up: Linear,
    pub shared_down: Linear,
    /// `[1, hidden]`: the scalar gate of the shared expert.
    pub shared_expert_gate: Linear,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

/// How RMSNorm weights are stored in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormConvention {
    /// The stored value is the gain (MLX adds the 1 at conversion).
    Gain,
    /// The gain is `1 + w` (transformers' zero-centred weights).
    OnePlus,
}

impl NormConvention {
    /// The convention of a layout: the MLX conversion stores gains, the
    /// original release zero-centred weights.
    pub fn of_layout(format: Format) -> Self {
        match format {
            Format::MlxQ4 => NormConvention::Gain,
            Format::HfBf16 => NormConvention::OnePlus,
        }
    }

    /// What the values look like: gains sit around 1, zero-centred weights
    /// around 0; `mean` is the mean weight over every one-centred norm.
    fn suggested_by(mean: f64) -> Self {
        if mean > 0.5 {
            NormConvention::Gain
        } else {
            NormConvention::OnePlus
        }
    }
}

/// The warning to give when the norm values of a `format` checkpoint, of
/// mean `mean`, look like the other convention (a mislabelled or hand-made
/// checkpoint); `None` when they agree with the layout.
pub fn norm_values_warning(format: Format, mean: f64) -> Option<String> {
    let layout = NormConvention::of_layout(format);
    let values = NormConvention::suggested_by(mean);
    (values != layout).then(|| {
        format!(
            "the RMSNorm weights of this {format:?} checkpoint average {mean:.3}, which looks \
             like {values:?} storage, but the layout stores {layout:?}; using the layout's \
             convention (check the checkpoint if the output is garbage)"
        )
    })
}

/// All weights of the model.
pub struct Weights {
    pub config: ModelConfig,
    pub embed: Linear,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: Linear,
    /// Decided by the layout (`NormConvention::of_layout`).
    pub norm_convention: NormConvention,
    /// Groups of tensors present in the checkpoint that the model does not
    /// use (vision tower, MTP head), for the caller to report; they are not
    /// read, and not in `model_bytes`.
    pub unused: Vec<UnusedGroup>,
    /// Bytes of the tensors the model uses: what a backend holds or uploads.
    pub model_bytes: u64,
    pub store: Arc<TensorStore>,
}

impl Weights {
    /// Loads `config.json` and the safetensors of `dir`, checking every tensor.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let store = Arc::new(TensorStore::open_dir(dir)?);
        Self::from_store(config, store)
    }

    pub fn from_store(config: ModelConfig, store: Arc<TensorStore>) -> Result<Self> {
        check_quantization(&config)?;
        let specs = expected_tensors(&config);
        let mut taken = std::collections::HashMap::new();
        for s in &specs {
            let mut dtypes = vec![s.dtype];
            dtypes.extend(s.alt_dtypes.iter().copied());
            let t = store.take(&s.name, &dtypes, &s.shape)?;
            taken.insert(s.name.clone(), t);
        }
        store.check_all_used(is_ignored_tensor)?;
        let model_bytes = taken.values().map(|t| t.bytes().len() as u64).sum();
        let unused = unused_groups(&store);
        for g in &unused {
            tracing::info!(tensors = g.tensors, bytes = g.bytes, "the checkpoint carries a {} that Lily does not use: not loaded, not counted", g.kind);
        }

        let get = |name: &str| -> Result<TensorRef> {
            taken.get(name).cloned().ok_or_else(|| Error::MissingTensor { tensor: name.into(), searched: "expected list".into() })
        };
        let convention = NormConvention::of_layout(config.format());
        if let Some(warning) = norm_values_warning(config.format(), norm_mean(&config, &get)?) {
            tracing::warn!("{warning}");
        }
        let norm = |name: &str| -> Result<Vec<f32>> {
            let v = get(name)?.to_f32();
            Ok(match convention {
                NormConvention::Gain => v,
                NormConvention::OnePlus => v.into_iter().map(|w| 1.0 + w).collect(),
            })
        };
        let linear = |path: &str, rows: usize, cols: usize, experts: usize| -> Result<Linear> { load_linear(&config, &get, path, rows, cols, experts) };

        let format = config.format();
        let top = top_names(format);
        let h = config.hidden_size;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = layer_prefix(format, i);
            let mixer = match config.layer_kind(i) {
                LayerKind::DeltaNet => {
                    let la = format!("{p}.linear_attn");
                    let conv_t = get(&format!("{la}.conv1d.weight"))?;
                    // Both layouts hold, per channel, `kernel` contiguous taps
                    // (MLX [C, K, 1], HF [C, 1, K]); oldest input first.
                    let conv = conv_t.to_f32();
                    Mixer::DeltaNet(DeltaNetWeights {
                        in_qkv: linear(&format!("{la}.in_proj_qkv"), config.linear_conv_dim(), h, 1)?,
                        in_z: linear(&format!("{la}.in_proj_z"), config.linear_value_dim(), h, 1)?,
                        in_a: linear(&format!("{la}.in_proj_a"), config.linear_num_value_heads, h, 1)?,
                        in_b: linear(&format!("{la}.in_proj_b"), config.linear_num_value_heads, h, 1)?,
                        out: linear(&format!("{la}.out_proj"), h, config.linear_value_dim(), 1)?,
                        conv,
                        a_log: get(&format!("{la}.A_log"))?.to_f32(),
                        dt_bias: get(&format!("{la}.dt_bias"))?.to_f32(),
                        norm: get(&format!("{la}.norm.weight"))?.to_f32(),
                    })
                }
                LayerKind::Attention => {
                    let sa = format!("{p}.self_attn");
                    Mixer::Attention(AttentionWeights {
                        q: linear(&format!("{sa}.q_proj"), config.q_proj_dim(), h, 1)?,
                        k: linear(&format!("{sa}.k_proj"), config.kv_dim(), h, 1)?,
                        v: linear(&format!("{sa}.v_proj"), config.kv_dim(), h, 1)?,
                        o: linear(&format!("{sa}.o_proj"), h, config.attn_out_dim(), 1)?,
                        q_norm: norm(&format!("{sa}.q_norm.weight"))?,
                        k_norm: norm(&format!("{sa}.k_norm.weight"))?,
                    })
                }
            };
            let e = config.num_experts;
            let im = config.moe_intermediate_size;
            let si = config.shared_expert_intermediate_size;
            let (gate, up, down) = match format {
                Format::MlxQ4 => (
                    linear(&format!("{p}.mlp.switch_mlp.gate_proj"), im, h, e)?,
                    linear(&format!("{p}.mlp.switch_mlp.up_proj"), im, h, e)?,
                    linear(&format!("{p}.mlp.switch_mlp.down_proj"), h, im, e)?,
                ),
                Format::HfBf16 => {
                    let fused = get(&format!("{p}.mlp.experts.gate_up_proj"))?;
                    let view =
                        |row_offset| Linear::Dense(DenseLinear { experts: e, rows: im, cols: h, tensor: fused.clone(), tensor_rows: 2 * im, row_offset });
                    let down_t = get(&format!("{p}.mlp.experts.down_proj"))?;
                    (view(0), view(im), Linear::Dense(DenseLinear { experts: e, rows: h, cols: im, tensor: down_t, tensor_rows: h, row_offset: 0 }))
                }
            };
            let moe = MoeWeights {
                router: linear(&format!("{p}.mlp.gate"), e, h, 1)?,
                gate,
                up,
                down,
                shared_gate: linear(&format!("{p}.mlp.shared_expert.gate_proj"), si, h, 1)?,
                shared_up: linear(&format!("{p}.mlp.shared_expert.up_proj"), si, h, 1)?,
                shared_down: linear(&format!("{p}.mlp.shared_expert.down_proj"), h, si, 1)?,
                shared_expert_gate: linear(&format!("{p}.mlp.shared_expert_gate"), 1, h, 1)?,
            };
            layers.push(LayerWeights {
                input_norm: norm(&format!("{p}.input_layernorm.weight"))?,
                post_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                mixer,
                moe,
            });
        }
        Ok(Weights {
            embed: linear(&top.embed, config.vocab_size, h, 1)?,
            final_norm: norm(&top.norm)?,
            lm_head: linear(&top.lm_head, config.vocab_size, h, 1)?,
            layers,
            norm_convention: convention,
            unused,
            model_bytes,
            config,
            store,
        })
    }
}

fn load_linear(cfg: &ModelConfig, get: &dyn Fn(&str) -> Result<TensorRef>, path: &str, rows: usize, cols: usize, experts: usize) -> Result<Linear> {
    match &cfg.quantization {
        Some(q) => Ok(Linear::Quant(QuantLinear {
            spec: q.spec_for(path).unwrap_or(q.default),
            experts,
            rows,
            cols,
            codes: get(&format!("{path}.weight"))?,
            scales: get(&format!("{path}.scales"))?,
            biases: get(&format!("{path}.biases"))?,
        })),
        None => Ok(Linear::Dense(DenseLinear { experts, rows, cols, tensor: get(&format!("{path}.weight"))?, tensor_rows: rows, row_offset: 0 })),
    }
}

/// Groups of unused tensors in `store`, in `UnusedKind` order.
fn unused_groups(store: &TensorStore) -> Vec<UnusedGroup> {
    let mut groups: std::collections::BTreeMap<UnusedKind, UnusedGroup> = Default::default();
    for name in store.names() {
        let (Some(kind), Some(t)) = (UnusedKind::of(name), store.peek(name)) else {
            continue;
        };
        let g = groups.entry(kind).or_insert(UnusedGroup { kind, tensors: 0, bytes: 0 });
        g.tensors += 1;
        g.bytes += t.bytes().len() as u64;
    }
    groups.into_values().collect()
}

/// The mean weight over every one-centred norm (for the warning only: the
/// layout decides the convention).
fn norm_mean(cfg: &ModelConfig, get: &dyn Fn(&str) -> Result<TensorRef>) -> Result<f64> {
    let mut sum = 0f64;
    let mut n = 0usize;
    for s in expected_tensors(cfg) {
        if s.role == Role::NormOneCentered {
            for v in get(&s.name)?.to_f32() {
                sum += v as f64;
                n += 1;
            }
        }
    }
    Ok(if n == 0 { 0.0 } else { sum / n as f64 })
}
