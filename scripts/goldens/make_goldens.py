#!/usr/bin/env python3
"""Golden fixtures for Lily from an independent implementation.

What this script owns: the tiny Qwen3.5-MoE test model in tests/fixtures/tiny/
(its weights, both checkpoint layouts) and the reference logits that Lily's
backends are tested against. The reference is transformers'
`Qwen3_5MoeForCausalLM`, run in float32; Lily's code is never imported here.

Modes (run from the repository root):

  hf --out DIR            [needs torch + transformers]  builds the tiny model
                          with a fixed seed, rounds its weights to bf16, saves
                          them in the BF16 release layout (DIR/hf-bf16/), runs
                          the reference on exactly those weights and writes
                          DIR/goldens-hf.safetensors and DIR/provenance.json.
  mlx CKPT --out DIR      [needs torch + transformers]  reads an MLX 4-bit
                          checkpoint, dequantises it here in numpy
                          (w = scale * q + bias, in f32), runs the same
                          reference on those weights and writes
                          DIR/goldens-mlx.safetensors and DIR/provenance.json.
  quantize HF_DIR OUT_DIR [numpy only]  an independent MLX converter: the
                          BF16 checkpoint to the MLX 4-bit layout, quantised as
                          MLX's GPU `affine_quantize` kernel does. Used for the
                          byte-for-byte expectation of `lily quantize`.
  check DIR               [numpy only]  reads every fixture file back and
                          prints a summary.
  finalize DIR --made-by  [numpy only]  records in DIR/provenance.json what
                          wrote DIR/mlx-q4, checks its tensors are the Python
                          converter's byte for byte, and adds sha256 sums.

Every safetensors file is read and written by the small numpy code below, so
the numpy-only modes need no torch and bf16 is handled bit-exactly.
"""

import argparse
import datetime
import json
import math
import os
import platform
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------
# The tiny model and the prompts.

SEED = 20260517
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}
ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
EOS_IDS = [248046, 248044]
# 150 tokens cross the 64-token chunk boundary of the DeltaNet prefill twice.
PROMPT_LENGTHS = [1, 7, 33, 100, 150]
DECODE_TAIL = 8
GROUP = 64


def layer_is_attention(i):
    return i % 4 == 3


def prompts():
    rng = np.random.default_rng(SEED + 1)
    return [rng.integers(0, TINY["vocab_size"], size=n).astype(np.int64) for n in PROMPT_LENGTHS]


# ---------------------------------------------------------------------------
# safetensors in plain numpy (bf16 kept as raw uint16 bit patterns).

ST_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U32": np.uint32, "I64": np.int64, "U8": np.uint8}


def st_read(path):
    """name -> (dtype string, numpy array); also returns the metadata."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    meta = header.pop("__metadata__", {})
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[base + a : base + b], dtype=ST_NP[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr.copy())
    return out, meta


def st_write(path, tensors, metadata=None):
    """tensors: name -> (dtype string, numpy array). Written in name order."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        arr = np.ascontiguousarray(arr, dtype=ST_NP[dtype])
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for raw in blobs:
            f.write(raw)


def read_dir_tensors(dir_):
    """All tensors of every *.safetensors file in a checkpoint directory."""
    out = {}
    for fn in sorted(os.listdir(dir_)):
        if fn.endswith(".safetensors"):
            t, _ = st_read(os.path.join(dir_, fn))
            out.update(t)
    return out


def f32_to_bf16_bits(x):
    """Round-to-nearest-even, as torch's .to(bfloat16) and Rust's half crate do."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_f32(dtype, arr):
    if dtype == "BF16":
        return bf16_bits_to_f32(arr)
    if dtype in ("F16", "F32"):
        return arr.astype(np.float32)
    raise ValueError(f"not a float tensor: {dtype}")


# ---------------------------------------------------------------------------
# config.json in the shape lily_core::config::to_config_json writes.


def config_json(quantized):
    n = TINY["num_hidden_layers"]
    text = dict(TINY)
    text.update(
        {
            "model_type": "qwen3_5_moe_text",
            "hidden_act": "silu",
            "attn_output_gate": True,
            "tie_word_embeddings": False,
            "full_attention_interval": 4,
            "layer_types": ["full_attention" if layer_is_attention(i) else "linear_attention" for i in range(n)],
            "rope_parameters": dict(ROPE),
            "eos_token_id": EOS_IDS[0],
            "dtype": "bfloat16",
        }
    )
    root = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_IDS[0],
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
    }
    if quantized:
        block = {"group_size": GROUP, "bits": 4, "mode": "affine"}
        for i in range(n):
            for m in ("mlp.gate", "mlp.shared_expert_gate"):
                block[f"language_model.model.layers.{i}.{m}"] = {"group_size": GROUP, "bits": 8}
        root["quantization"] = block
        root["quantization_config"] = dict(block)
    return root


def write_config(dir_, quantized):
    os.makedirs(dir_, exist_ok=True)
    with open(os.path.join(dir_, "config.json"), "w") as f:
        json.dump(config_json(quantized), f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------
# MLX affine quantisation, written from the GPU kernel's description
# (mlx/backend/metal/kernels/quantized.h, affine_quantize), in float32.

BF16_MAX = np.float32(3.3895313892515355e38)


def round_half_away(x):
    """Metal's round(): halves go away from zero (numpy's rint is half-even)."""
    t = np.trunc(x)
    frac = x - t  # exact in floating point
    return np.where(np.abs(frac) >= np.float32(0.5), t + np.sign(x), t).astype(np.float32)


def mlx_quantize(w, bits, group=GROUP):
    """w: float32 [..., cols] -> (codes u32 [..., cols*bits/32], scales f32, biases f32 [..., cols/group])."""
    w = np.asarray(w, dtype=np.float32)
    lead, cols = w.shape[:-1], w.shape[-1]
    g = w.reshape(-1, cols // group, group)
    n_bins = np.float32((1 << bits) - 1)
    # The kernel starts its running max at 0 and its min at the type's max.
    w_max = np.maximum(g.max(axis=-1), np.float32(0.0))
    w_min = np.minimum(g.min(axis=-1), BF16_MAX)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = round_half_away(edge / scale)
    at_zero = q0 == 0
    scale = np.where(at_zero, scale, edge / np.where(at_zero, np.float32(1.0), q0)).astype(np.float32)
    bias = np.where(at_zero, np.float32(0.0), edge).astype(np.float32)
    q = round_half_away((g - bias[..., None]) / scale[..., None])
    q = np.clip(q, 0, n_bins).astype(np.uint32)
    per = 32 // bits
    q = q.reshape(-1, cols // per, per)
    words = np.zeros(q.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= q[..., i] << np.uint32(bits * i)
    return (
        words.reshape(*lead, cols // per),
        scale.reshape(*lead, cols // group),
        bias.reshape(*lead, cols // group),
    )


def mlx_dequantize(codes, scales, biases, bits, group=GROUP):
    """Packed u32 codes and f32 scales/biases -> f32 weights, w = scale * q + bias."""
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits)).astype(np.uint32)
    q = (codes[..., None] >> shifts) & mask
    q = q.reshape(*codes.shape[:-1], codes.shape[-1] * per).astype(np.float32)
    cols = q.shape[-1]
    qg = q.reshape(*q.shape[:-1], cols // group, group)
    w = scales[..., None].astype(np.float32) * qg + biases[..., None].astype(np.float32)
    return w.reshape(q.shape).astype(np.float32)


# Release name -> MLX name, and which norms MLX stores as 1 + w.
ONE_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def is_one_centred(name):
    return name.endswith(ONE_CENTRED) or name == "model.language_model.norm.weight"


def mlx_prefix(release_name):
    if release_name == "lm_head.weight":
        return "language_model.lm_head.weight"
    assert release_name.startswith("model.language_model."), release_name
    return "language_model.model." + release_name[len("model.language_model.") :]


def eight_bit(module):
    return module.endswith(".mlp.gate") or module.endswith(".mlp.shared_expert_gate")


def convert_to_mlx(hf_tensors):
    """BF16 release tensors -> MLX 4-bit tensors (bits exact, numpy only)."""
    out = {}
    im = TINY["moe_intermediate_size"]
    for name, (dtype, arr) in sorted(hf_tensors.items()):
        if name.endswith("mlp.experts.gate_up_proj"):
            w = as_f32(dtype, arr)  # [E, 2I, H], gate rows first
            base = mlx_prefix(name.replace("mlp.experts.gate_up_proj", "mlp.switch_mlp.X.weight"))
            parts = {"gate_proj": w[:, :im, :], "up_proj": w[:, im:, :]}
        elif name.endswith("mlp.experts.down_proj"):
            base = mlx_prefix(name.replace("mlp.experts.down_proj", "mlp.switch_mlp.X.weight"))
            parts = {"down_proj": as_f32(dtype, arr)}
        else:
            parts = None
        if parts is not None:
            for part, w in parts.items():
                module = base.replace(".X.weight", "." + part)
                codes, s, b = mlx_quantize(w, 4)
                out[module + ".weight"] = ("U32", codes)
                out[module + ".scales"] = ("BF16", f32_to_bf16_bits(s))
                out[module + ".biases"] = ("BF16", f32_to_bf16_bits(b))
            continue
        mname = mlx_prefix(name)
        if name.endswith("conv1d.weight"):
            out[mname] = (dtype, np.ascontiguousarray(np.moveaxis(arr, 2, 1)))  # [C,1,K] -> [C,K,1]
        elif name.endswith(("A_log", "dt_bias", "linear_attn.norm.weight")):
            out[mname] = (dtype, arr)
        elif is_one_centred(name):
            out[mname] = ("BF16", f32_to_bf16_bits(as_f32(dtype, arr) + np.float32(1.0)))
        elif name.endswith(".weight") and arr.ndim == 2:
            module = mname[: -len(".weight")]
            bits = 8 if eight_bit(module) else 4
            codes, s, b = mlx_quantize(as_f32(dtype, arr), bits)
            out[module + ".weight"] = ("U32", codes)
            out[module + ".scales"] = ("BF16", f32_to_bf16_bits(s))
            out[module + ".biases"] = ("BF16", f32_to_bf16_bits(b))
        else:
            raise ValueError(f"no MLX rule for {name} {arr.shape}")
    return out


def mlx_to_release_f32(mlx_tensors, config):
    """MLX tensors -> release-layout f32 tensors (dequantised here in numpy)."""
    quant = config.get("quantization") or {}
    modules = {}
    plain = {}
    for name, (dtype, arr) in mlx_tensors.items():
        for part in (".weight", ".scales", ".biases"):
            module = name[: -len(part)]
            if name.endswith(part) and (module + ".scales") in mlx_tensors:
                modules.setdefault(module, {})[part[1:]] = (dtype, arr)
                break
        else:
            plain[name] = (dtype, arr)
    out = {}

    def release(mname):
        if mname == "language_model.lm_head.weight":
            return "lm_head.weight"
        assert mname.startswith("language_model.model."), mname
        return "model.language_model." + mname[len("language_model.model.") :]

    deq = {}
    for module, parts in modules.items():
        spec = quant.get(module)
        bits = spec["bits"] if isinstance(spec, dict) else quant["bits"]
        group = spec["group_size"] if isinstance(spec, dict) else quant["group_size"]
        codes = parts["weight"][1]
        s = as_f32(*parts["scales"])
        b = as_f32(*parts["biases"])
        deq[module] = mlx_dequantize(codes, s, b, bits, group)
    for module, w in deq.items():
        if ".switch_mlp." in module:
            continue
        out[release(module + ".weight")] = w
    layers = sorted({m.split(".switch_mlp.")[0] for m in deq if ".switch_mlp." in m})
    for lp in layers:
        gu = np.concatenate([deq[lp + ".switch_mlp.gate_proj"], deq[lp + ".switch_mlp.up_proj"]], axis=1)
        rp = release(lp + ".x")[: -len(".x")]
        out[rp + ".experts.gate_up_proj"] = gu
        out[rp + ".experts.down_proj"] = deq[lp + ".switch_mlp.down_proj"]
    for name, (dtype, arr) in plain.items():
        rname = release(name)
        v = as_f32(dtype, arr)
        if name.endswith("conv1d.weight"):
            v = np.ascontiguousarray(np.moveaxis(v, 2, 1))  # [C,K,1] -> [C,1,K]
        elif is_one_centred(rname):
            v = v - np.float32(1.0)  # exact: the gain is stored with the 1 added
        out[rname] = v
    return out


# ---------------------------------------------------------------------------
# The reference (torch + transformers from here on).


def text_config():
    from transformers import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        **TINY,
        rope_parameters=dict(ROPE),
        tie_word_embeddings=False,
        eos_token_id=EOS_IDS[0],
    )
    cfg._attn_implementation = "eager"
    try:
        cfg._experts_implementation = "eager"
    except Exception as e:  # older/newer configs may not have the switch
        print("note: could not set _experts_implementation:", e)
    return cfg


def build_model(torch):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3_5MoeForCausalLM(text_config()).float().eval()
    return model


def release_name(param_name):
    if param_name.startswith("model."):
        return "model.language_model." + param_name[len("model.") :]
    return param_name


# Ways the experts' parameters might relate to the release layout
# (gate_up [E, 2I, H] gate rows first; down [E, H, I]); probed at run time.
GATE_UP_LAYOUTS = ["same", "up_first", "transposed", "up_first_transposed"]
DOWN_LAYOUTS = ["same", "transposed"]


def gate_up_to_param(torch, x, layout):
    i = x.shape[1] // 2
    if "up_first" in layout:
        x = torch.cat([x[:, i:], x[:, :i]], dim=1)
    if "transposed" in layout:
        x = x.transpose(1, 2)
    return x.contiguous()


def down_to_param(torch, x, layout):
    return (x.transpose(1, 2) if layout == "transposed" else x).contiguous()


def probe_expert_layout(torch, model):
    """Finds how the experts module stores its weights by running it."""
    experts = model.model.layers[0].mlp.experts
    e, h, im = TINY["num_experts"], TINY["hidden_size"], TINY["moe_intermediate_size"]
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(e, 2 * im, h, generator=g)
    dn = torch.randn(e, h, im, generator=g)
    x = torch.randn(3, h, generator=g)
    idx = torch.tensor([[0, 1], [2, 3], [5, 0]])
    wts = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    want = torch.zeros(3, h)
    for t in range(3):
        for k in range(2):
            ex = idx[t, k]
            a = gu[ex] @ x[t]
            hmid = torch.nn.functional.silu(a[:im]) * a[im:]
            want[t] += wts[t, k] * (dn[ex] @ hmid)
    saved = (experts.gate_up_proj.data.clone(), experts.down_proj.data.clone())
    found = None
    for lg in GATE_UP_LAYOUTS:
        pg = gate_up_to_param(torch, gu, lg)
        if tuple(pg.shape) != tuple(experts.gate_up_proj.shape):
            continue
        for ld in DOWN_LAYOUTS:
            pd = down_to_param(torch, dn, ld)
            if tuple(pd.shape) != tuple(experts.down_proj.shape):
                continue
            with torch.no_grad():
                experts.gate_up_proj.copy_(pg)
                experts.down_proj.copy_(pd)
                got = experts(x, idx, wts)
            if torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                found = (lg, ld)
                break
        if found:
            break
    with torch.no_grad():
        experts.gate_up_proj.copy_(saved[0])
        experts.down_proj.copy_(saved[1])
    if not found:
        raise RuntimeError("could not match the experts' parameter layout to the release layout")
    return {"gate_up_proj": found[0], "down_proj": found[1], "param_shapes": [list(experts.gate_up_proj.shape), list(experts.down_proj.shape)]}


def release_shapes(model):
    """Release-layout name -> shape, from the model's parameters."""
    e, h, im = TINY["num_experts"], TINY["hidden_size"], TINY["moe_intermediate_size"]
    shapes = {}
    for name, p in model.named_parameters():
        r = release_name(name)
        if r.endswith("experts.gate_up_proj"):
            shapes[r] = (e, 2 * im, h)
        elif r.endswith("experts.down_proj"):
            shapes[r] = (e, h, im)
        else:
            shapes[r] = tuple(p.shape)
    return shapes


def init_release_weights(torch, shapes):
    """Random weights with sane scales, in the release layout, float32.

    Linear maps ~ N(0, 1/fan_in); embeddings N(0, 1); the lm_head and the
    router a little larger so that logits and routing are decisive; the
    zero-centred RMSNorm weights N(0, 0.1) (transformers computes x * (1 + w));
    the gated-norm gain 1 + N(0, 0.1); A = exp(A_log) log-uniform in
    [0.02, 0.5] and dt_bias uniform in [-1, 1], so decays exp(g) lie mostly in
    0.6..1 (short and long memories); conv taps N(0, 1/kernel).
    """
    g = torch.Generator().manual_seed(SEED)
    h = TINY["hidden_size"]
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        normal = lambda std: torch.randn(shape, generator=g) * std
        uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(shape, generator=g)
        if name.endswith("embed_tokens.weight"):
            v = normal(1.0)
        elif name == "lm_head.weight":
            v = normal(2.0 / math.sqrt(h))
        elif name.endswith("linear_attn.norm.weight"):
            v = 1.0 + normal(0.1)
        elif name.endswith(ONE_CENTRED) or name == "model.language_model.norm.weight":
            v = normal(0.1)
        elif name.endswith("A_log"):
            v = uniform(math.log(0.02), math.log(0.5))
        elif name.endswith("dt_bias"):
            v = uniform(-1.0, 1.0)
        elif name.endswith("conv1d.weight"):
            v = normal(1.0 / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):
            v = normal(2.0 / math.sqrt(shape[-1]))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) or len(shape) == 2:
            v = normal(1.0 / math.sqrt(shape[-1]))
        else:
            raise ValueError(f"no init rule for {name} {shape}")
        out[name] = v.float()
    return out


def round_release_to_bf16(torch, tensors):
    """Every tensor but A_log is stored in bf16 (A_log is F32 in the release)."""
    out = {}
    for name, v in tensors.items():
        out[name] = v if name.endswith("A_log") else v.to(torch.bfloat16).float()
    return out


def load_release(torch, model, tensors, layout):
    """Copies release-layout f32 tensors into the model's parameters."""
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = release_name(name)
            v = tensors[r]
            if r.endswith("experts.gate_up_proj"):
                v = gate_up_to_param(torch, v, layout["gate_up_proj"])
            elif r.endswith("experts.down_proj"):
                v = down_to_param(torch, v, layout["down_proj"])
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"{r}: shape {tuple(v.shape)} does not fit parameter {name} {tuple(p.shape)}")
            p.copy_(v.to(p.dtype))
            seen.add(r)
    extra = set(tensors) - seen
    if extra:
        raise ValueError(f"tensors not used by the model: {sorted(extra)[:5]}")


def release_to_st(torch, tensors):
    """Release f32 tensors (already bf16-representable) -> safetensors entries."""
    out = {}
    for name, v in tensors.items():
        a = v.detach().cpu().float().numpy()
        if name.endswith("A_log"):
            out[name] = ("F32", a)
        else:
            bits = f32_to_bf16_bits(a)
            assert np.array_equal(bf16_bits_to_f32(bits), a), f"{name} is not bf16-exact"
            out[name] = ("BF16", bits)
    return out


class RouterGaps:
    """Records, per token, the smallest gap over layers between the k-th and
    (k+1)-th router probability: where it is tiny, a numerically different
    implementation may pick another expert and its logits legitimately differ."""

    def __init__(self, torch, model):
        self.torch = torch
        self.calls = []
        self.handles = [layer.mlp.gate.register_forward_hook(self.hook) for layer in model.model.layers]

    def hook(self, module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        p = self.torch.softmax(logits.float(), dim=-1)
        top = self.torch.topk(p, TINY["num_experts_per_tok"] + 1, dim=-1).values
        k = TINY["num_experts_per_tok"]
        self.calls.append((top[:, k - 1] - top[:, k]).detach().cpu())

    def take(self):
        """Min over layers of the calls since the last take: [tokens]."""
        gaps = self.torch.stack(self.calls).min(dim=0).values
        self.calls = []
        return gaps

    def close(self):
        for h in self.handles:
            h.remove()


def run_reference(torch, model, device, record_gaps=False):
    """Prefill logits at every position and a teacher-forced decode tail."""
    gaps = RouterGaps(torch, model) if record_gaps else None
    res = []
    with torch.no_grad():
        for toks in prompts():
            n = len(toks)
            ids = torch.tensor(toks[None, :], device=device)
            out = model(input_ids=ids, use_cache=False)
            entry = {"tokens": toks, "prefill": out.logits[0].float().cpu().numpy()}
            if gaps:
                entry["prefill_gap"] = gaps.take().numpy()
            tail = min(DECODE_TAIL, n - 1)
            start = n - tail
            entry["decode_start"] = start
            if tail > 0:
                out = model(input_ids=ids[:, :start], use_cache=True)
                cache = out.past_key_values
                if gaps:
                    gaps.take()
                steps, step_gaps = [], []
                for j in range(tail):
                    out = model(input_ids=ids[:, start + j : start + j + 1], past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    steps.append(out.logits[0, -1].float().cpu().numpy())
                    if gaps:
                        step_gaps.append(gaps.take().numpy())
                entry["decode"] = np.stack(steps)
                if gaps:
                    entry["decode_gap"] = np.concatenate(step_gaps)
            res.append(entry)
    if gaps:
        gaps.close()
    return res


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref, other):
    """Statistics of log-prob differences between two runs, over all prompts,
    prefill and decode positions together."""
    d_all, d_top, agree, n = [], [], 0, 0
    for a, b in zip(ref, other):
        for key in ("prefill", "decode"):
            if key not in a:
                continue
            la, lb = log_softmax(a[key]), log_softmax(b[key])
            d_all.append(np.abs(la - lb).ravel())
            top = la.argmax(axis=-1)
            rows = np.arange(len(top))
            d_top.append(np.abs(la[rows, top] - lb[rows, top]))
            agree += int((lb.argmax(axis=-1) == top).sum())
            n += len(top)
    d_all = np.concatenate(d_all)
    d_top = np.concatenate(d_top)
    return {
        "positions": n,
        "top1_agreement": agree / n,
        "all_vocab_abs_dlogprob": {"mean": float(d_all.mean()), "p99": float(np.quantile(d_all, 0.99)), "max": float(d_all.max())},
        "ref_top1_abs_dlogprob": {"mean": float(d_top.mean()), "p99": float(np.quantile(d_top, 0.99)), "max": float(d_top.max())},
    }


def decode_vs_prefill(res):
    """Within one run: the decode tail against the prefill logits of the same positions."""
    ref, other = [], []
    for e in res:
        if "decode" in e:
            s = e["decode_start"]
            ref.append({"prefill": e["prefill"][s:]})
            other.append({"prefill": e["decode"]})
    return compare(ref, other)


def logit_stats(res):
    allp = np.concatenate([e["prefill"] for e in res])
    lp = log_softmax(allp)
    srt = np.sort(lp, axis=-1)
    gap = srt[:, -1] - srt[:, -2]
    return {
        "logit_std": float(allp.std()),
        "top1_prob_mean": float(np.exp(srt[:, -1]).mean()),
        "top1_top2_logprob_gap": {"min": float(gap.min()), "p01": float(np.quantile(gap, 0.01)), "median": float(np.median(gap))},
        "distinct_top1_tokens": int(len(np.unique(lp.argmax(axis=-1)))),
    }


def goldens_tensors(res):
    out = {}
    for k, e in enumerate(res):
        p = f"prompt{k}"
        out[f"{p}.tokens"] = ("I64", e["tokens"])
        out[f"{p}.prefill_logits"] = ("F32", e["prefill"])
        out[f"{p}.decode_start"] = ("I64", np.array([e["decode_start"]], dtype=np.int64))
        if "prefill_gap" in e:
            out[f"{p}.prefill_router_gap"] = ("F32", e["prefill_gap"])
        if "decode" in e:
            out[f"{p}.decode_logits"] = ("F32", e["decode"])
            if "decode_gap" in e:
                out[f"{p}.decode_router_gap"] = ("F32", e["decode_gap"])
    return out


def code_paths(torch, model, device):
    """Which functions ran (the torch fallbacks vs fla / hub kernels), read
    from a profile of one prefill and one cached decode step."""
    import cProfile
    import importlib.util
    import pstats

    prof = cProfile.Profile()
    ids = torch.tensor(prompts()[3][None, :], device=device)
    with torch.no_grad():
        prof.enable()
        out = model(input_ids=ids[:, :-1], use_cache=True)
        model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        prof.disable()
    stats = pstats.Stats(prof)
    keys = ("delta_rule", "conv1d", "experts", "attention_forward", "rmsnorm", "l2norm", "router")
    called = sorted(
        {f"{fn} ({os.path.basename(file)})" for (file, _line, fn) in stats.stats if any(k in fn.lower() for k in keys)}
    )
    from transformers.utils import is_flash_linear_attention_available

    return {
        "functions_called": called,
        "is_flash_linear_attention_available": bool(is_flash_linear_attention_available()),
        "packages_present": {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "kernels")},
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
    }


def env_info(torch):
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "host": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def noise_floor(torch, model, ref):
    """The same reference, run other ways, against the primary CPU f32 run."""
    import copy

    floors = {}
    m64 = copy.deepcopy(model).double()
    floors["cpu_float64_vs_cpu_float32"] = compare(ref, run_reference(torch, m64, "cpu"))
    floors["cpu_float64_vs_cpu_float32"]["note"] = (
        "transformers keeps parts in float32 even in a float64 model (RMSNorm upcasts with .float(), "
        "the chunked DeltaNet casts to float32), so this under-states pure float32 rounding"
    )
    del m64
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        mg = copy.deepcopy(model).to("cuda")
        floors["gpu_float32_vs_cpu_float32"] = compare(ref, run_reference(torch, mg, "cuda"))
        floors["gpu_float32_vs_cpu_float32"]["note"] = "same float32 math, different kernels and summation order (TF32 off)"
        mb = copy.deepcopy(model).to("cuda").to(torch.bfloat16)
        floors["gpu_bfloat16_vs_cpu_float32"] = compare(ref, run_reference(torch, mb, "cuda"))
        floors["gpu_bfloat16_vs_cpu_float32"]["note"] = "the whole model in bfloat16 (weights and activations): the scale of error of a bf16-activation implementation"
        del mg, mb
    floors["decode_vs_prefill_same_run"] = decode_vs_prefill(ref)
    floors["decode_vs_prefill_same_run"]["note"] = "the reference's own cached decode (recurrent DeltaNet) against its prefill (chunked) at the same positions"
    return floors


def update_provenance(path_in, path_out, section, data):
    prov = {}
    if path_in and os.path.exists(path_in):
        with open(path_in) as f:
            prov = json.load(f)
    prov["generator"] = {
        "script": "scripts/goldens/make_goldens.py",
        "seed": SEED,
        "config": {**TINY, "rope_parameters": ROPE, "eos_token_id": EOS_IDS[0]},
        "prompt_lengths": PROMPT_LENGTHS,
        "prompt_tokens": "numpy.random.default_rng(seed + 1).integers(0, vocab_size, size=n) for n in prompt_lengths, in order",
        "decode_tail": DECODE_TAIL,
    }
    prov[section] = data
    with open(path_out, "w") as f:
        json.dump(prov, f, indent=2, sort_keys=True)
        f.write("\n")


def torch_setup():
    import torch

    torch.set_num_threads(min(8, os.cpu_count() or 1))
    torch.set_float32_matmul_precision("highest")
    return torch


def mode_hf(args):
    torch = torch_setup()
    model = build_model(torch)
    layout = probe_expert_layout(torch, model)
    print("expert layout:", layout)
    shapes = release_shapes(model)
    weights = round_release_to_bf16(torch, init_release_weights(torch, shapes))
    load_release(torch, model, weights, layout)

    ckpt = os.path.join(args.out, "hf-bf16")
    write_config(ckpt, quantized=False)
    st_write(os.path.join(ckpt, "model.safetensors"), release_to_st(torch, weights), {"format": "pt"})

    ref = run_reference(torch, model, "cpu", record_gaps=True)
    # The saved file, read back, must give bit-identical logits.
    back, _ = st_read(os.path.join(ckpt, "model.safetensors"))
    reloaded = {n: torch.from_numpy(as_f32(d, a).copy()) for n, (d, a) in back.items()}
    m2 = build_model(torch)
    load_release(torch, m2, reloaded, layout)
    again = run_reference(torch, m2, "cpu")
    same = all(np.array_equal(a["prefill"], b["prefill"]) for a, b in zip(ref, again))
    print("reloaded checkpoint gives identical logits:", same)
    if not same:
        raise RuntimeError("the saved checkpoint does not reproduce the reference")
    del m2

    st_write(os.path.join(args.out, "goldens-hf.safetensors"), goldens_tensors(ref), {"format": "lily-goldens-v1", "model": "hf-bf16"})
    data = {
        "command": " ".join(sys.argv),
        "environment": env_info(torch),
        "checkpoint": "hf-bf16/ (written by this run)",
        "reference": "transformers Qwen3_5MoeForCausalLM, float32 on the CPU, eager attention, on the bf16-rounded weights (A_log float32)",
        "expert_param_layout": layout,
        "code_paths": code_paths(torch, model, "cpu"),
        "logit_stats": logit_stats(ref),
        "noise_floor": noise_floor(torch, model, ref),
        "reload_identical": same,
    }
    update_provenance(args.provenance, os.path.join(args.out, "provenance.json"), "hf", data)
    print(json.dumps(data, indent=1))


def mode_mlx(args):
    torch = torch_setup()
    with open(os.path.join(args.ckpt, "config.json")) as f:
        config = json.load(f)
    release = mlx_to_release_f32(read_dir_tensors(args.ckpt), config)
    model = build_model(torch)
    layout = probe_expert_layout(torch, model)
    load_release(torch, model, {n: torch.from_numpy(v.copy()) for n, v in release.items()}, layout)
    ref = run_reference(torch, model, "cpu", record_gaps=True)
    st_write(os.path.join(args.out, "goldens-mlx.safetensors"), goldens_tensors(ref), {"format": "lily-goldens-v1", "model": "mlx-q4"})
    data = {
        "command": " ".join(sys.argv),
        "environment": env_info(torch),
        "checkpoint": args.ckpt,
        "checkpoint_made_by": args.made_by,
        "reference": "transformers Qwen3_5MoeForCausalLM, float32 on the CPU, eager attention, on weights dequantised in numpy (w = scale * q + bias in float32, not re-rounded; norms stored as 1 + w have the 1 subtracted back)",
        "expert_param_layout": layout,
        "code_paths": code_paths(torch, model, "cpu"),
        "logit_stats": logit_stats(ref),
        "noise_floor": noise_floor(torch, model, ref),
    }
    hf_goldens = args.hf_goldens
    if hf_goldens and os.path.exists(hf_goldens):
        g, _ = st_read(hf_goldens)
        hf_res = []
        for k in range(len(PROMPT_LENGTHS)):
            e = {"prefill": g[f"prompt{k}.prefill_logits"][1]}
            if f"prompt{k}.decode_logits" in g:
                e["decode"] = g[f"prompt{k}.decode_logits"][1]
            hf_res.append(e)
        data["quantised_vs_bf16_reference"] = compare(hf_res, ref)
        data["quantised_vs_bf16_reference"]["note"] = "the effect of 4-bit quantisation itself: the bf16 model's goldens against these"
    update_provenance(args.provenance, os.path.join(args.out, "provenance.json"), "mlx", data)
    print(json.dumps(data, indent=1))


def mode_quantize(args):
    out = convert_to_mlx(read_dir_tensors(args.hf_dir))
    os.makedirs(args.out_dir, exist_ok=True)
    write_config(args.out_dir, quantized=True)
    st_write(os.path.join(args.out_dir, "model.safetensors"), out, {"format": "mlx"})
    print(f"wrote {len(out)} tensors to {args.out_dir}")


def mode_check(args):
    root = args.dir
    for dirpath, _dirs, files in sorted(os.walk(root)):
        for fn in sorted(files):
            path = os.path.join(dirpath, fn)
            if fn.endswith(".safetensors"):
                t, meta = st_read(path)
                total = sum(a.nbytes for _, a in t.values())
                print(f"{os.path.relpath(path, root)}: {len(t)} tensors, {total} bytes, metadata {meta}")
                for name, (d, a) in t.items():
                    if d in ("F32", "BF16"):
                        v = as_f32(d, a)
                        if not np.all(np.isfinite(v)):
                            raise ValueError(f"{path}: {name} has non-finite values")
            elif fn.endswith(".json"):
                with open(path) as f:
                    json.load(f)
                print(f"{os.path.relpath(path, root)}: valid JSON")


def mode_finalize(args):
    """Records in provenance.json what produced the committed MLX checkpoint,
    whether its tensors are byte-identical to the Python converter's output
    (the input of the MLX goldens), and the sha256 of every fixture file."""
    import hashlib

    root = args.dir
    prov_path = os.path.join(root, "provenance.json")
    with open(prov_path) as f:
        prov = json.load(f)
    got = read_dir_tensors(os.path.join(root, "mlx-q4"))
    want, _ = st_read(os.path.join(root, "mlx_q4_expected.safetensors"))
    differing = sorted(
        n for n in set(got) | set(want)
        if n not in got or n not in want or got[n][0] != want[n][0] or got[n][1].shape != want[n][1].shape
        or got[n][1].tobytes() != want[n][1].tobytes()
    )
    with open(os.path.join(root, "mlx-q4", "config.json")) as f:
        cfg_got = json.load(f)
    cfg_want = config_json(quantized=True)

    def diff(a, b, path=""):
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(set(a) | set(b)) for d in diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
        return [] if a == b else [f"{path}: {a!r} (file) vs {b!r} (make_goldens.py)"]

    prov.setdefault("mlx", {})["fixture_checkpoint"] = {
        "path": "mlx-q4/",
        "made_by": args.made_by,
        "tensors_identical_to_mlx_q4_expected": not differing,
        "differing_tensors": differing[:20],
        "config_json_differences": diff(cfg_got, cfg_want),
        "note": "the MLX goldens were computed on mlx_q4_expected.safetensors (the Python converter's output); "
        "identical tensors mean they hold for mlx-q4/ as well",
    }
    if args.device_command:
        prov["device_command"] = args.device_command
    files = {}
    for dirpath, _dirs, fns in os.walk(root):
        for fn in fns:
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            if rel in ("provenance.json", "README.md"):
                continue
            with open(path, "rb") as f:
                files[rel] = hashlib.sha256(f.read()).hexdigest()
    prov["sha256"] = dict(sorted(files.items()))
    with open(prov_path, "w") as f:
        json.dump(prov, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps(prov["mlx"]["fixture_checkpoint"], indent=1))
    if differing:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("hf")
    p.add_argument("--out", required=True)
    p.add_argument("--provenance", default="tests/fixtures/tiny/provenance.json", help="existing provenance to update")
    p = sub.add_parser("mlx")
    p.add_argument("ckpt")
    p.add_argument("--out", required=True)
    p.add_argument("--made-by", default="lily quantize", help="what produced the MLX checkpoint (recorded)")
    p.add_argument("--hf-goldens", default="tests/fixtures/tiny/goldens-hf.safetensors")
    p.add_argument("--provenance", default="tests/fixtures/tiny/provenance.json")
    p = sub.add_parser("quantize")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p = sub.add_parser("check")
    p.add_argument("dir")
    p = sub.add_parser("finalize")
    p.add_argument("dir")
    p.add_argument("--made-by", required=True, help="what wrote DIR/mlx-q4 (recorded)")
    p.add_argument("--device-command", default=None, help="the device command that ran hf/quantize/mlx (recorded)")
    args = ap.parse_args()
    {"hf": mode_hf, "mlx": mode_mlx, "quantize": mode_quantize, "check": mode_check, "finalize": mode_finalize}[args.mode](args)


if __name__ == "__main__":
    main()
