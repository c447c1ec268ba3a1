"""The weights of a GGUF file as an mlx-lm llama / qwen2 model.

Block types store each row in blocks of B values of S bytes:

- Q8_0 (B=32, S=34): fp16 d, 32 int8 q; x = d q.
- Q4_0 (B=32, S=18): fp16 d, 16 bytes of 4-bit q (value i: low nibble of byte i, value i+16: high nibble);
  x = d (q - 8).
- Q4_1 (B=32, S=20): fp16 d, fp16 m, 16 bytes of q as in Q4_0; x = d q + m.

These are MLX's affine quantization with group size 32 (scale d; bias -8d, m, and -128d on q + 128): the
blocks are repacked into MLX's layout (``weight`` as uint32, ``scales``, ``biases``) and either kept that way
or dequantized with ``mx.dequantize``. Tensor bytes are read here, after the header was validated, not with
``mx.load`` (whose own GGUF parser crashes on some valid files, e.g. one with a float64 metadata value).

llama.cpp rotates the interleaved pairs (2i, 2i+1) of each head ("normal" RoPE) for the llama architecture,
while Hugging Face checkpoints (and mlx-lm with ``rope_traditional=False``) rotate the pairs (i, i + d/2). Its
converter therefore reorders the rows of W_q and W_k (and their biases) within each head: GGUF row 2i holds
Hugging Face row i and row 2i+1 holds row i + d/2, i.e. ``w.reshape(h, 2, d/2, ...).swapaxes(1, 2)``. Loading
undoes it: ``w.reshape(h, d/2, 2, ...).swapaxes(1, 2)`` with h the query heads for Q and the KV heads for K.
llama.cpp runs qwen2 with the half-split ("NeoX") RoPE, as Hugging Face does, so those rows are unchanged.
"""

from __future__ import annotations

import importlib
import math
import re

import numpy as np

from .header import GGML_TYPES, Header, TensorInfo, _label

# Imported inside functions, on purpose: MLX, each where it is used: they are costly to import or unneeded on the
# paths that import this module (`--help`, `plan`, the NumPy-only parts).

#: Tensor types `load_gguf` reads: float types, and block types with their MLX quantization bits.
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
LOADABLE = FLOAT_TYPES + tuple(QUANT_BITS)
GROUP_SIZE = 32
#: Architectures whose Q/K rows llama.cpp's converter permuted (interleaved RoPE).
PERMUTED_QK = frozenset({"llama"})

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"([a-z_]+)\.(weight|bias)")
#: Tensors that are not parameters of the mlx-lm model (folded into the config).
_NOT_PARAMETERS = frozenset({"rope_freqs.weight"})


def mlx_name(gguf_name: str) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None when it is not a llama-family parameter."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(match.group(1))}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    match = _GLOBAL_RE.fullmatch(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def permute_rows(w, n_heads: int):
    """llama.cpp's per-head Q/K row interleaving (what its converter writes): row i -> 2i, row i + d/2 -> 2i+1
    within each head; the inverse of `unpermute_rows`."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of pairs")
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's per-head Q/K row interleaving: row 2i -> i, row 2i+1 -> i + d/2 within each head.

    Works on NumPy and MLX arrays whose first axis is the rows (weights, packed quantized weights, scales,
    biases, 1-D bias vectors).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters of mlx-lm's llama / qwen2 for `config` and their shapes, computed without building
    the model (so that metadata a forged file inflates cannot make a huge model)."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    qwen2 = config["model_type"] == "qwen2"
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        layer = {"self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
                 "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
                 "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
        for module, shape in layer.items():
            shapes[f"model.layers.{i}.{module}.weight"] = shape
            attention = module.startswith("self_attn")
            if (attention and (attention_bias or (qwen2 and module != "self_attn.o_proj"))) or (
                    not attention and mlp_bias):
                shapes[f"model.layers.{i}.{module}.bias"] = shape[:1]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"model.layers.{i}.{norm}.weight"] = (hidden,)
    return shapes


def _check_tensors(h: Header, expected: dict[str, tuple]) -> dict[str, TensorInfo]:
    """GGUF tensors by mlx-lm name, checked against the model's parameter shapes: known names, loadable
    types, matching shapes, and none missing (an attention output bias may be absent: it is then zero)."""
    found: dict[str, TensorInfo] = {}
    for info in h.tensors.values():
        if info.name in _NOT_PARAMETERS:
            continue
        name = mlx_name(info.name)
        if name is None or name not in expected:
            raise h.fail(f"unexpected tensor {_label(info.name)} for a {h.architecture} model with this metadata")
        if info.type_name not in LOADABLE:
            raise h.fail(f"unsupported tensor type {info.type_name} in tensor {info.name} "
                         f"(supported: {', '.join(LOADABLE)})")
        if info.shape != tuple(expected[name]):
            raise h.fail(f"tensor {info.name} has shape {list(info.shape)} but the metadata implies "
                         f"{list(expected[name])}")
        found[name] = info
    for name in expected:
        if name not in found and not name.endswith("self_attn.o_proj.bias"):
            raise h.fail(f"missing tensor {gguf_name(name)}")
    return found


def gguf_name(mlx: str) -> str:
    """The GGUF tensor name of an mlx-lm parameter name (the inverse of `mlx_name`)."""
    module, _, kind = mlx.rpartition(".")
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if match:
        short = next(k for k, v in _LAYER_NAMES.items() if v == match.group(2))
        return f"blk.{match.group(1)}.{short}.{kind}"
    return next(k for k, v in _GLOBAL_NAMES.items() if v == module) + "." + kind


def file_dtype(h: Header) -> str:
    """The file's own precision, from its tensor types: float32 for an all-F32 file, bfloat16 when it has BF16
    tensors, else float16 (also the precision of a quantized file's scales)."""
    types = {t.type_name for t in h.tensors.values()}
    if types == {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in types else "float16"


def _compute_dtype(h: Header, cpu: bool):
    """float32 on the CPU (fp16/bf16 matmuls are much slower there); on a GPU the file's own precision
    (`file_dtype`)."""
    import mlx.core as mx

    return mx.float32 if cpu else getattr(mx, file_dtype(h))


def _read_float(raw: bytes, info: TensorInfo) -> np.ndarray:
    """An F32/F16/BF16 tensor as float32 (bfloat16 bits are the top half of float32's)."""
    if info.type_name == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    return np.frombuffer(raw, "<f4" if info.type_name == "F32" else "<f2").reshape(info.shape)


def _read_quantized(raw: bytes, info: TensorInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0/Q4_0/Q4_1 tensor as MLX affine quantization (group 32): (uint32 weight, scales, biases).

    MLX packs value j of a row at bits (j mod 32/b) * b of word j // (32/b), little-endian: for 8 bits the
    bytes in order, for 4 bits byte k holds values 2k (low nibble) and 2k+1 (high nibble). Scales and
    biases are float32: d and -128 d (Q8_0, on q + 128), d and -8 d (Q4_0), d and m (Q4_1).
    """
    rows = math.prod(info.shape[:-1])
    _, _, block_bytes = GGML_TYPES[info.type_id]
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, block_bytes)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)[:, 0]
    if info.type_name == "Q8_0":
        values = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    else:
        nibbles = blocks[:, 2:] if info.type_name == "Q4_0" else blocks[:, 4:]
        values = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1)  # value i: low nibble of byte i, i+16: high
        values = values[:, 0::2] | (values[:, 1::2] << 4)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales are the file's business
        if info.type_name == "Q4_1":
            biases = blocks[:, 2:4].copy().view("<f2").astype(np.float32)[:, 0]
        else:
            biases = (-128 if info.type_name == "Q8_0" else -8) * d
    packed = np.ascontiguousarray(values).view("<u4").reshape(rows, -1)
    return packed, d.reshape(rows, -1), biases.reshape(rows, -1)


def _load_weights(h: Header, config: dict, found: dict[str, TensorInfo], expected: dict[str, tuple],
                  keep_quantized: bool, dtype) -> tuple[dict, dict]:
    """(weights by mlx-lm name, {module path: bits} of the modules kept quantized) for `model`.

    Each tensor's bytes (inside the file, as `read_header` checked) are read and converted here, renamed,
    Q/K rows un-permuted for llama, and block-quantized matrices either dequantized to `dtype` or kept as
    MLX affine weights (group 32) with scales and biases in `dtype`. (`mx.load` also reads GGUF, but it
    parses the whole header itself and crashes on some valid files, e.g. with a float64 metadata value.)
    """
    import mlx.core as mx

    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    permuted = h.architecture in PERMUTED_QK
    weights, quantized = {}, {}
    with open(h.path, "rb") as f:
        for name, info in found.items():
            module = name.rsplit(".", 1)[0]
            n_heads = next((n for suffix, n in heads.items() if module.endswith(suffix)), None) if permuted else None
            fix = (lambda a: unpermute_rows(a, n_heads)) if n_heads else (lambda a: a)
            f.seek(info.offset)
            raw = f.read(info.nbytes)
            if info.type_name not in QUANT_BITS:
                weights[name] = mx.array(fix(_read_float(raw, info))).astype(dtype)
            elif keep_quantized and len(info.shape) == 2:
                w, scales, biases = (mx.array(fix(a)) for a in _read_quantized(raw, info))
                weights[name] = w
                weights[module + ".scales"] = scales.astype(dtype)
                weights[module + ".biases"] = biases.astype(dtype)
                quantized[module] = QUANT_BITS[info.type_name]
            else:
                w, scales, biases = (mx.array(fix(a)) for a in _read_quantized(raw, info))
                dense = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=QUANT_BITS[info.type_name])
                weights[name] = dense.reshape(info.shape).astype(dtype)
            del raw
            mx.eval([weights[k] for k in weights if k.startswith(module + ".")])  # one tensor's bytes at a time
    for name in expected:  # a llama attention with Q/K/V biases but no output bias
        if name not in weights:
            weights[name] = mx.zeros(expected[name], dtype=dtype)
    return weights, quantized


def _build_model(config: dict):
    """mlx-lm's own Model class for config["model_type"] (parameters are lazy until loaded)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def _quantize_modules(model, quantized: dict[str, int]) -> None:
    import mlx.nn as nn

    nn.quantize(model, class_predicate=lambda path, _m: (
        {"group_size": GROUP_SIZE, "bits": quantized[path], "mode": "affine"} if path in quantized else False))


def _model_from_header(h: Header, config: dict, keep_quantized: bool, dtype):
    """(model, {module: bits}) with the weights loaded in `dtype`; the tensors are checked against
    `expected_shapes(config)` before the model is built."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    expected = expected_shapes(config)
    found = _check_tensors(h, expected)
    model = _build_model(config)
    built = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    if built != expected:
        raise RuntimeError(f"mlx-lm's {config['model_type']} has other parameters than expected_shapes: "
                           f"{sorted(set(built.items()) ^ set(expected.items()))[:4]}")
    weights, quantized = _load_weights(h, config, found, expected, keep_quantized, dtype)
    if quantized:
        _quantize_modules(model, quantized)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model, quantized


__all__ = ["expected_shapes", "file_dtype", "gguf_name", "mlx_name", "permute_rows", "unpermute_rows"]
