"""The config.json dict mlx-lm reads, from a GGUF file's metadata (no weights read)."""

from __future__ import annotations

import math

import numpy as np

from .header import Header, TensorInfo, _header, _short
from .weights import _LAYER_NAMES, FLOAT_TYPES, file_dtype

#: GGUF architecture -> mlx-lm model_type (both use the llama block: RMSNorm, SwiGLU MLP, GQA attention).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}


def config_from_gguf(path_or_header) -> dict:
    """A Hugging Face style config.json dict for mlx-lm's llama / qwen2, from the metadata (no weights read).

    tie_word_embeddings is true when the file has no ``output.weight``; vocab_size is the embedding's row
    count; rope_scaling comes from ``<arch>.rope.scaling.*`` (linear, yarn: its ``attn_factor`` m becomes mlx-lm's
    mscale with 0.1 mscale ln s + 1 = m (1 + 0.1 ln s), llama.cpp's scale of q and k) or a ``rope_freqs`` tensor
    (Llama 3 frequency factors, fitted back to mlx-lm's "llama3" parameters); torch_dtype is the file's precision
    (`file_dtype`); gguf_quantization names the file's block-quantized tensor types ("Q4_1"), when it has any.
    """
    h = _header(path_or_header)
    arch = h.architecture
    if arch not in ARCHITECTURES:
        raise h.fail(f"unsupported architecture {_short(arch)} (supported: {', '.join(ARCHITECTURES)})")
    shapes = _shapes(h, arch)
    eps, theta = _norm_and_rope_base(h, arch)
    context = _positive(h, f"{arch}.context_length")
    config = {"model_type": ARCHITECTURES[arch], **shapes, "rms_norm_eps": eps, "rope_theta": theta,
              "rope_traditional": False, "max_position_embeddings": context, "vocab_size": _vocabulary(h),
              "tie_word_embeddings": "output.weight" not in h.tensors, "hidden_act": "silu",
              "torch_dtype": file_dtype(h)}
    quantized = sorted({t.type_name for t in h.tensors.values()} - set(FLOAT_TYPES))
    if quantized:  # the file's weights are already quantized: the planner does not advise quantizing them
        config["gguf_quantization"] = "+".join(quantized)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in h.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in h.tensors
    scaling = _rope_scaling(h, arch, shapes["head_dim"], theta, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return {**config, **_special_tokens(h)}


def _shapes(h: Header, arch: str) -> dict:
    """The block's sizes (hidden_size ... head_dim, config.json's keys), checked against what mlx-lm's `arch`
    builds: heads a multiple of kv heads, keys as long as values, a full rotary embedding over an even head dim."""

    def key(name):
        return f"{arch}.{name}"

    hidden = _positive(h, key("embedding_length"))
    layers = _positive(h, key("block_count"))
    if layers * len(_LAYER_NAMES) > len(h.tensors):  # every layer has nine weights
        raise h.fail(f"{key('block_count')}={layers} but the file has only {len(h.tensors)} tensors")
    ffn = _positive(h, key("feed_forward_length"))
    heads = _positive(h, key("attention.head_count"))
    kv_heads = _positive(h, key("attention.head_count_kv"), default=heads)
    if heads % kv_heads:
        raise h.fail(f"{key('attention.head_count_kv')}={kv_heads} does not divide the {heads} query heads")
    head_dim = _positive(h, key("attention.key_length"), default=hidden // heads)
    value_dim = _positive(h, key("attention.value_length"), default=head_dim)
    if value_dim != head_dim:
        raise h.fail(f"key length {head_dim} differs from value length {value_dim}; mlx-lm's {arch} needs them equal")
    rope_dims = _positive(h, key("rope.dimension_count"), default=head_dim)
    if rope_dims != head_dim or head_dim % 2:
        raise h.fail(f"{key('rope.dimension_count')}={rope_dims} with head dimension {head_dim}: only a full "
                     "rotary embedding over an even head dimension is supported")
    if arch == "qwen2" and head_dim * heads != hidden:
        raise h.fail(f"head dimension {head_dim} x {heads} heads != hidden size {hidden} (mlx-lm's qwen2 needs it)")
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim}


def _norm_and_rope_base(h: Header, arch: str) -> tuple[float, float]:
    """(RMSNorm epsilon > 0, RoPE base theta > 1; 10000 when the file names none)."""
    eps_key, theta_key = f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.rope.freq_base"
    eps = _decimal(h, eps_key, h.require(eps_key, float))
    if not eps > 0:
        raise h.fail(f"{eps_key} must be positive, got {eps}")
    theta = _decimal(h, theta_key, h.get(theta_key, 10000.0, float))
    if not theta > 1:
        raise h.fail(f"{theta_key} must be > 1, got {theta}")
    return eps, theta


def _vocabulary(h: Header) -> int:
    """The vocabulary size: the token embedding's row count (GGUF lists dims innermost first)."""
    embedding = h.tensors.get("token_embd.weight")
    if embedding is None:
        raise h.fail("missing tensor token_embd.weight")
    if len(embedding.dims) != 2:
        raise h.fail(f"tensor token_embd.weight has dims {list(embedding.dims)}, expected 2")
    return embedding.dims[1]


def _special_tokens(h: Header) -> dict:
    """bos_token_id and eos_token_id where the file names them; an end-of-turn token other than eos joins it
    (eos_token_id becomes [eos, eot], as Hugging Face lists several)."""
    ids = {}
    for name, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                           ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if gguf_key in h.metadata:
            ids[name] = h.require(gguf_key, int)
    eot = h.get("tokenizer.ggml.eot_token_id", None, int)
    if eot is not None and eot != ids.get("eos_token_id", eot):
        ids["eos_token_id"] = [ids["eos_token_id"], eot]
    return ids


def _decimal(h: Header, key: str, value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(value))) if h.value_types.get(key) == 6 else float(value)


def _positive(h: Header, key: str, default: int | None = None) -> int:
    if default is not None and key not in h.metadata:
        return default
    value = h.require(key, (int, list))
    if isinstance(value, list):  # per-layer values (e.g. head_count_kv): fine when all equal
        if not value or len(set(value)) != 1 or not all(isinstance(v, int) for v in value):
            raise h.fail(f"metadata {key} varies per layer ({_short(value)}); not supported")
        value = value[0]
    if value <= 0:
        raise h.fail(f"metadata {key} must be positive, got {value}")
    return value


def _rope_scaling(h: Header, arch: str, head_dim: int, theta: float, context: int) -> dict | None:
    kind = h.get(f"{arch}.rope.scaling.type", None, str)
    factor = h.get(f"{arch}.rope.scaling.factor", None, float)
    if kind is None and h.get(f"{arch}.rope.scale_linear", None, float) not in (None, 1.0):
        kind, factor = "linear", h.get(f"{arch}.rope.scale_linear", None, float)
    original = h.get(f"{arch}.rope.scaling.original_context_length", None, int)
    attn_key = f"{arch}.rope.scaling.attn_factor"
    attn = _decimal(h, attn_key, h.require(attn_key, float)) if attn_key in h.metadata else 1.0
    freqs = h.tensors.get("rope_freqs.weight")
    if attn != 1.0 and (freqs is not None or kind != "yarn" or factor in (None, 1.0)):
        raise h.fail(f"{attn_key}={attn:g} without YaRN scaling; not supported")
    if freqs is not None:
        if kind not in (None, "none"):
            raise h.fail(f"both a rope_freqs tensor and rope scaling {_short(kind)}; not supported")
        return _llama3_scaling(h, freqs, head_dim, theta)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if factor <= 0:
        raise h.fail(f"{arch}.rope.scaling.factor must be positive, got {factor}")
    factor = float(str(np.float32(factor)))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original or context}
        for name in ("beta_fast", "beta_slow"):
            key = f"{arch}.rope.scaling.yarn_{name}"
            if key in h.metadata:
                scaling[name] = _decimal(h, key, h.require(key, float))
        if attn != 1.0 and factor > 1:  # llama.cpp scales q and k by attn (1 + 0.1 ln s) = 0.1 mscale ln s + 1
            scaling["mscale"] = (attn * (1 + 0.1 * math.log(factor)) - 1) / (0.1 * math.log(factor))
            scaling["mscale_all_dim"] = 0.0
        return scaling
    raise h.fail(f"unsupported rope scaling type {_short(kind)} (supported: linear, yarn, Llama 3 rope_freqs)")


def _llama3_scaling(h: Header, info: TensorInfo, head_dim: int, theta: float) -> dict:
    """mlx-lm "llama3" parameters reproducing a ``rope_freqs`` tensor (per-pair wavelength factors r_i).

    llama.cpp's converter writes r_i = 1 for wavelengths w_i = 2 pi theta^(2i/d) below L/high, the factor f
    above L/low, and 1 / ((1 - s)/f + s) with s = (L/w_i - low)/(high - low) in between. Only the ratios
    L/low and L/high matter, and s is linear in 1/w, so two in-between pairs (or the region boundaries)
    determine them: L is set to 8192 (the Llama 3 value) and low/high fitted; the fit is checked against r.
    """
    if info.type_name != "F32" or info.dims != (head_dim // 2,):
        raise h.fail(f"tensor rope_freqs.weight must be F32 with {head_dim // 2} values, "
                     f"got {info.type_name} {list(info.dims)}")
    with open(h.path, "rb") as f:
        f.seek(info.offset)
        r = np.frombuffer(f.read(info.nbytes), dtype="<f4").astype(np.float64)
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(r.max())
    if not np.all(np.isfinite(r)) or r.min() < 1 - 1e-6 or factor <= 1 + 1e-6:
        raise h.fail("tensor rope_freqs.weight is not a Llama 3 frequency-factor table (factors must be >= 1)")
    original = 8192.0
    middle = (r > 1 + 1e-6) & (r < factor - 1e-6)
    if middle.sum() >= 2:
        smooth = (factor / r[middle] - 1) / (factor - 1)  # s from r = 1 / ((1 - s)/f + s)
        slope, intercept = np.polyfit(1 / wavelen[middle], smooth, 1)  # s = (L/w - low)/(high - low)
        low, high = -intercept * original / slope, (1 - intercept) * original / slope
    elif (r <= 1 + 1e-6).any() and (r >= factor - 1e-6).any():  # a step: cut between the two pairs
        a, b = float(np.max(wavelen[r <= 1 + 1e-6])), float(np.min(wavelen[r >= factor - 1e-6]))
        low, high = original / (a + 2 * (b - a) / 3), original / (a + (b - a) / 3)
    else:
        raise h.fail("tensor rope_freqs.weight is not a Llama 3 frequency-factor table")
    params = {"type": "llama3", "factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
              "original_max_position_embeddings": int(original)}
    if not np.allclose(_llama3_factors(params, wavelen), r, rtol=1e-4, atol=1e-5):
        raise h.fail("tensor rope_freqs.weight does not follow the Llama 3 frequency-factor formula")
    return params


def _llama3_factors(params: dict, wavelen: np.ndarray) -> np.ndarray:
    """The r_i that mlx-lm's Llama3RoPE applies for these parameters (the formula in `_llama3_scaling`)."""
    f, low, high, L = (params["factor"], params["low_freq_factor"], params["high_freq_factor"],
                       params["original_max_position_embeddings"])
    smooth = (L / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / f + smooth)
    return np.where(wavelen < L / high, 1.0, np.where(wavelen > L / low, f, medium))


__all__ = ["ARCHITECTURES", "config_from_gguf"]
