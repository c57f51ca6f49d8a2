//! Model dimensions as the kernels see them: defined once here from the
//! `ModelConfig`, passed to every kernel source as NVRTC `-D` defines, and
//! checked against what the kernels support (with a message naming the
//! field) before anything is compiled or uploaded.

use lily_core::ModelConfig;

use crate::error::{CudaError, CudaResult};

/// Tokens per paged KV-cache block.
pub const KV_BLOCK: usize = 64;
/// Chunk length of the chunked DeltaNet prefill.
pub const GDN_CHUNK: usize = 64;
/// Warps of a decode-attention block (one block per SM); each warp streams
/// its own splits through a private shared-memory pipeline.
pub const ATTN_DEC_WARPS: usize = 2;
/// Pipeline stages per decode-attention warp (one 16-key K and V tile each):
/// `ATTN_DEC_STAGES - 1` tiles in flight while one is computed.
pub const ATTN_DEC_STAGES: usize = 6;
/// Keys of a decode-attention tile (one m16n8k16 k-step of P V).
pub const ATTN_DEC_KEYS: usize = 16;
/// Contexts of up to this many KV blocks are cut into one-block splits,
/// longer ones into splits of at least two blocks.
pub const ATTN_SPLIT_SMALL: usize = 16;
/// Query tokens of a prefill-attention block (one m16 tile; the block's 8
/// warps are the 8 query heads of one KV head).
pub const ATTN_PF_TOKENS: usize = 16;
/// K and V tile stages of `attn_prefill` (attention.cu: its producer copies
/// tile t into K(t - 2)'s and V(t - 3)'s stages once the consumers have
/// released them, while PV(t - 1) and S(t) may still read).
pub const ATTN_PF_K_STAGES: usize = 2;
pub const ATTN_PF_V_STAGES: usize = 3;
/// Producer warps of an `attn_prefill` block (after its 8 consumer warps):
/// a warpgroup, so that it can give its registers to the consumers
/// (setmaxnreg acts on whole warpgroups); a lane copies a 16-byte chunk of
/// a K/V row.
pub const ATTN_PF_PRODUCER_WARPS: usize = 4;
/// Sequences (pieces of a prefill pass) one `attn_prefill` launch takes;
/// their table travels in the launch parameters.
pub const ATTN_PF_MAX_PIECES: usize = 16;
/// fp16 padding after every K/V/Q row staged in shared memory (16 bytes, so
/// ldmatrix rows fall in distinct banks).
pub const ATTN_PAD: usize = 8;

/// Every dimension a kernel needs, in one place.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub vocab: usize,
    pub layers: usize,
    pub group_size: usize,
    pub rms_eps: f32,
    // Gated DeltaNet
    pub gk_heads: usize,
    pub gv_heads: usize,
    pub gk_dim: usize,
    pub gv_dim: usize,
    pub conv_k: usize,
    pub conv_dim: usize,
    // Gated attention
    pub a_heads: usize,
    pub a_kv_heads: usize,
    pub a_head_dim: usize,
    pub rot_dim: usize,
    pub rope_theta: f64,
    // MoE
    pub n_experts: usize,
    pub topk: usize,
    pub moe_inter: usize,
}

impl Dims {
    /// Reads the dimensions of `cfg` and refuses shapes the kernels cannot run.
    pub fn from_config(cfg: &ModelConfig) -> CudaResult<Self> {
        let d = Dims {
            hidden: cfg.hidden_size,
            vocab: cfg.vocab_size,
            layers: cfg.num_layers,
            group_size: 64,
            rms_eps: cfg.rms_norm_eps,
            gk_heads: cfg.linear_num_key_heads,
            gv_heads: cfg.linear_num_value_heads,
            gk_dim: cfg.linear_key_head_dim,
            gv_dim: cfg.linear_value_head_dim,
            conv_k: cfg.conv_kernel,
            conv_dim: cfg.linear_conv_dim(),
            a_heads: cfg.num_attention_heads,
            a_kv_heads: cfg.num_kv_heads,
            a_head_dim: cfg.head_dim,
            rot_dim: cfg.rotary_dim(),
            rope_theta: cfg.rope_theta,
            n_experts: cfg.num_experts,
            topk: cfg.num_experts_per_tok,
            moe_inter: cfg.moe_intermediate_size,
        };
        d.check()?;
        Ok(d)
    }

    fn check(&self) -> CudaResult<()> {
        let rule = |ok: bool, field: &str, want: &str, got: usize| -> CudaResult<()> {
            if ok {
                Ok(())
            } else {
                Err(CudaError::Unsupported(format!("{field} = {got}: the CUDA kernels need {want}")))
            }
        };
        rule(self.hidden.is_multiple_of(64) && self.hidden >= 64, "hidden_size", "a multiple of 64", self.hidden)?;
        rule(self.gk_dim == self.gv_dim, "linear_value_head_dim", "linear_key_head_dim", self.gv_dim)?;
        rule(self.gk_dim.is_multiple_of(32) && self.gk_dim <= 128, "linear_key_head_dim", "a multiple of 32, at most 128", self.gk_dim)?;
        rule(self.gk_heads <= 32 && self.gk_heads >= 1, "linear_num_key_heads", "1 to 32", self.gk_heads)?;
        rule(self.gv_heads.is_multiple_of(self.gk_heads), "linear_num_value_heads", "a multiple of the key heads", self.gv_heads)?;
        rule(self.conv_k == 4, "linear_conv_kernel_dim", "4", self.conv_k)?;
        rule(self.a_head_dim.is_multiple_of(32) && self.a_head_dim <= 256, "head_dim", "a multiple of 32, at most 256", self.a_head_dim)?;
        rule(self.a_heads == 8 * self.a_kv_heads, "num_attention_heads", "8 x num_key_value_heads", self.a_heads)?;
        rule(self.rot_dim.is_multiple_of(2) && self.rot_dim <= self.a_head_dim, "rotary dim", "even, at most head_dim", self.rot_dim)?;
        rule(self.n_experts >= 1 && self.n_experts <= 1024, "num_experts", "1 to 1024", self.n_experts)?;
        rule(self.topk >= 1 && self.topk <= 32 && self.topk <= self.n_experts, "num_experts_per_tok", "1 to 32", self.topk)?;
        rule(self.moe_inter.is_multiple_of(64), "moe_intermediate_size", "a multiple of 64", self.moe_inter)?;
        // The decode matrix kernels split K over at most 8 warps of 512.
        let widest = self.hidden.max(self.moe_inter).max(self.gdn_val_dim()).max(self.a_heads * self.a_head_dim);
        rule(widest <= 4096, "hidden_size / intermediate / mixer widths", "at most 4096", widest)?;
        Ok(())
    }

    pub fn gdn_key_dim(&self) -> usize {
        self.gk_heads * self.gk_dim
    }
    pub fn gdn_val_dim(&self) -> usize {
        self.gv_heads * self.gv_dim
    }
    /// Width of a DeltaNet in-projection row: qkv | z | a | b.
    pub fn gdn_proj(&self) -> usize {
        self.conv_dim + self.gdn_val_dim() + 2 * self.gv_heads
    }
    /// Width of an attention in-projection row: q (+gates) | k | v.
    pub fn attn_proj(&self) -> usize {
        2 * self.a_heads * self.a_head_dim + 2 * self.a_kv_heads * self.a_head_dim
    }
    /// Row stride of the shared in-projection buffer, rounded to 4 floats.
    pub fn proj_stride(&self) -> usize {
        self.gdn_proj().max(self.attn_proj()).div_ceil(4) * 4
    }
    /// Width of the mixer output (input of out_proj / o_proj).
    pub fn mix_dim(&self) -> usize {
        self.gdn_val_dim().max(self.a_heads * self.a_head_dim)
    }
    pub fn attn_out_dim(&self) -> usize {
        self.a_heads * self.a_head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.a_kv_heads * self.a_head_dim
    }
    /// Bytes of one KV block for one layer, K and V together.
    pub fn kv_block_bytes(&self) -> usize {
        2 * self.a_kv_heads * KV_BLOCK * self.a_head_dim * 2
    }
    /// f32 floats of one layer's DeltaNet recurrent state of one sequence.
    pub fn gdn_state_floats(&self) -> usize {
        self.gv_heads * self.gk_dim * self.gv_dim
    }
    /// f32 floats of one layer's conv ring of one sequence.
    pub fn gdn_conv_floats(&self) -> usize {
        4 * self.conv_dim
    }

    /// RoPE inverse frequencies as transformers computes them in fp32:
    /// 1 / theta^(2j / rot_dim).
    pub fn inv_freq(&self) -> Vec<f32> {
        let theta = self.rope_theta as f32;
        (0..self.rot_dim / 2)
            .map(|j| {
                let e = (2 * j) as f32 / self.rot_dim as f32;
                1.0f32 / theta.powf(e)
            })
            .collect()
    }

    /// The `-D` defines every kernel source is compiled with.
    pub fn defines(&self) -> Vec<String> {
        let mut v = vec![
            format!("-DHIDDEN={}", self.hidden),
            format!("-DVOCAB={}", self.vocab),
            format!("-DGROUP_SIZE={}", self.group_size),
            format!("-DGK_HEADS={}", self.gk_heads),
            format!("-DGV_HEADS={}", self.gv_heads),
            format!("-DGK_DIM={}", self.gk_dim),
            format!("-DGV_DIM={}", self.gv_dim),
            format!("-DCONV_K={}", self.conv_k),
            format!("-DCONV_DIM={}", self.conv_dim),
            format!("-DA_HEADS={}", self.a_heads),
            format!("-DA_KV_HEADS={}", self.a_kv_heads),
            format!("-DA_HEAD_DIM={}", self.a_head_dim),
            format!("-DROT_DIM={}", self.rot_dim),
            format!("-DN_EXPERTS={}", self.n_experts),
            format!("-DTOPK={}", self.topk),
            format!("-DMOE_INTER={}", self.moe_inter),
            format!("-DKV_BLOCK={KV_BLOCK}"),
            format!("-DATT_DEC_WARPS={ATTN_DEC_WARPS}"),
            format!("-DATT_DEC_STAGES={ATTN_DEC_STAGES}"),
            format!("-DATT_DEC_KEYS={ATTN_DEC_KEYS}"),
            format!("-DATT_SPLIT_SMALL={ATTN_SPLIT_SMALL}"),
            format!("-DATT_PF_TOKENS={ATTN_PF_TOKENS}"),
            format!("-DATT_PF_MAX_PIECES={ATTN_PF_MAX_PIECES}"),
            format!("-DATT_PF_K_STAGES={ATTN_PF_K_STAGES}"),
            format!("-DATT_PF_V_STAGES={ATTN_PF_V_STAGES}"),
            format!("-DATT_PF_PRODUCER_WARPS={ATTN_PF_PRODUCER_WARPS}"),
            format!("-DATT_PAD={ATTN_PAD}"),
        ];
        v.push(format!("-DRMS_EPS={:e}f", self.rms_eps));
        // The decode matrix kernels', the sampler's, the DeltaNet's and the
        // GEMM's constants and struct layouts.
        v.extend(crate::qmm::defines(self));
        v.extend(crate::attention::defines());
        v.extend(crate::sampling::defines());
        v.extend(crate::feed::defines());
        v.extend(crate::gdn::defines(self));
        v.extend(crate::gemm::defines());
        v.extend(crate::hgemm::defines());
        v
    }
}
