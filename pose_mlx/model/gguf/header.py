"""Read GGUF files (llama.cpp, Ollama, LM Studio) of the llama family as mlx-lm models.

File layout (GGUF versions 2 and 3, little-endian):

- header: magic ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 metadata count;
- metadata: count x (key, uint32 value type, value). A string is a uint64 byte length and UTF-8 bytes; an
  array is a uint32 element type, a uint64 element count and the elements. Value types: 0 uint8, 1 int8,
  2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array, 10 uint64, 11 int64, 12 float64;
- tensor infos: count x (name, uint32 n_dims, n_dims x uint64 ne, uint32 ggml type, uint64 offset);
- tensor data: from the first multiple of ``general.alignment`` (default 32) after the infos; each tensor's
  offset is relative to that point and a multiple of the alignment.

``ne[0]`` is the contiguous dimension, so a (rows, columns) matrix has ``ne = [columns, rows]`` and its
NumPy/MLX shape is ``ne`` reversed. Block types store each row in blocks of B values of S bytes:

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

API:
- `read_header(path) -> Header`: parse and validate everything but the tensor data (no MLX). ``Header.tensors``
  has each tensor's type, shape and bytes (what a memory planner needs), ``Header.metadata`` the key/values.
- `config_from_gguf(path_or_header)`: the Hugging Face style config.json dict mlx-lm reads (metadata only).
- `build_tokenizer` / `tokenizer_config` / `write_tokenizer(path_or_header, folder)` / `load_tokenizer`:
  the file's tokenizer as a `tokenizers.Tokenizer`, tokenizer.json + tokenizer_config.json, an mlx-lm
  `TokenizerWrapper`.
- `load_gguf(path, keep_quantized=None)`: (mlx-lm model, mlx-lm TokenizerWrapper, config).
- `convert(path, out_folder, keep_quantized=False)`: a model folder `mlx_lm.load` reads.

Every problem with a file is a `pose_mlx.errors.UserError` naming the file: the header is checked against
the file size before anything is allocated, so a truncated or forged file fails with one line.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays nest at most this deep

# Metadata value types: id -> (name, struct format, bytes); 8 = string and 9 = array are variable-sized.
STRING, ARRAY = 8, 9
VALUE_TYPES = {
    0: ("uint8", "<B", 1), 1: ("int8", "<b", 1), 2: ("uint16", "<H", 2), 3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4), 5: ("int32", "<i", 4), 6: ("float32", "<f", 4), 7: ("bool", "<?", 1),
    10: ("uint64", "<Q", 8), 11: ("int64", "<q", 8), 12: ("float64", "<d", 8),
}
_MIN_VALUE_BYTES = {STRING: 8, ARRAY: 12, **{k: v[2] for k, v in VALUE_TYPES.items()}}

# ggml tensor types: id -> (name, values per block, bytes per block). Every type is listed so that the layout
# of any file can be validated (and its metadata read); `LOADABLE` are the ones `load_gguf` turns into weights.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
#: Tensor types `load_gguf` reads: float types, and block types with their MLX quantization bits.
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
LOADABLE = FLOAT_TYPES + tuple(QUANT_BITS)
GROUP_SIZE = 32

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# ------------------------------------------------------------------------------------------------ header


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: `dims` in GGUF order (``ne[0]`` first), `offset` absolute in the file."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (NumPy/MLX) shape: `dims` reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class Header:
    """Everything in a GGUF file but the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    alignment: int
    data_offset: int
    file_size: int
    value_types: dict[str, int] = field(default_factory=dict, repr=False)  # key -> GGUF value type id

    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def fail(self, problem: str) -> UserError:
        return UserError(f"{self.path}: {problem}")

    def require(self, key: str, kind: type | tuple = int):
        """Metadata `key`, which must exist and be of `kind` (int excludes bool; float accepts int)."""
        if key not in self.metadata:
            raise self.fail(f"missing metadata key {key}")
        return self._checked(key, kind)

    def get(self, key: str, default=None, kind: type | tuple | None = None):
        if key not in self.metadata:
            return default
        return self._checked(key, kind) if kind is not None else self.metadata[key]

    def _checked(self, key: str, kind):
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(
            (k is int and isinstance(value, int) and not isinstance(value, bool))
            or (k is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (k not in (int, float) and isinstance(value, k))
            for k in kinds
        )
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(f"metadata {key} must be {names}, got {type(value).__name__} {_short(value)}")
        return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _label(name: str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: control characters escaped, long names cut."""
    if name.isprintable() and len(name) <= limit:
        return name
    text = repr(name)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Cursor:
    """Bounds-checked little-endian reads from a memory-mapped file."""

    def __init__(self, buffer, path: Path):
        self.buf, self.path, self.pos, self.size = buffer, path, 0, len(buffer)

    def fail(self, problem: str) -> UserError:
        return UserError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated at byte {self.size}: {what} at byte {self.pos} needs {n} bytes")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A uint64 count of items that each take at least `min_item_bytes`: bounded by the bytes left."""
        at = self.pos
        n = self.u64(f"the {what} count")
        left = self.size - self.pos
        if n * min_item_bytes > left:
            raise self.fail(f"{what} count {n} at byte {at} cannot fit in the {left} bytes left in the file "
                            "(truncated or corrupt)")
        return n

    def value(self, type_id: int, what: str, depth: int = 0):
        if type_id in VALUE_TYPES:
            _, fmt, size = VALUE_TYPES[type_id]
            return self.unpack(fmt, size, what)
        if type_id == STRING:
            return self.string(what)
        if type_id == ARRAY:
            at = self.pos
            item_type = self.u32(f"the element type of {what}")
            if item_type not in _MIN_VALUE_BYTES:
                raise self.fail(f"{what} at byte {at} has an unknown element type {item_type}")
            if item_type == ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} at byte {at} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            n = self.count(f"{what} element", _MIN_VALUE_BYTES[item_type])
            if item_type in VALUE_TYPES:  # numbers: one vectorised read
                dtype = np.dtype(VALUE_TYPES[item_type][1].replace("?", "u1"))
                items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return items.astype(bool).tolist() if item_type == 7 else items.tolist()
            return [self.value(item_type, f"{what}[{i}]", depth + 1) for i in range(n)]
        raise self.fail(f"{what} has an unknown value type {type_id}")


def _open_buffer(path: Path):
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    size = path.stat().st_size
    if size < len(MAGIC):
        raise UserError(f"{path}: truncated at byte {size}: too short for a GGUF header")
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_header(path: str | os.PathLike) -> Header:
    """Parse a GGUF file's header, metadata and tensor infos (no tensor data) and validate the layout.

    Checks, before anything proportional to a count is allocated: magic, version (2 or 3), counts and
    string/array lengths against the bytes left, known value and tensor types, 1..4 positive dims with
    ``ne[0]`` a whole number of blocks, alignment (a power of two) and every tensor inside the file, aligned,
    not overlapping another, with a unique name. Any violation raises `UserError` naming the file.
    """
    path = Path(path)
    buffer = _open_buffer(path)
    try:
        return _parse(buffer, path)
    finally:
        buffer.close()


def _parse(buffer, path: Path) -> Header:
    cur = _Cursor(buffer, path)
    magic = bytes(buffer[:4])
    if magic != MAGIC:
        raise cur.fail(f"not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16:
            raise cur.fail("big-endian GGUF files are not supported")
        raise cur.fail(f"GGUF version {version} is not supported (only versions 2 and 3)")
    n_tensors = cur.count("tensor", 32)  # name length 8 + n_dims 4 + one dim 8 + type 4 + offset 8
    n_kv = cur.count("metadata", 13)  # key length 8 + type 4 + one byte of value
    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"metadata key {_label(key)} appears twice")
        type_id = cur.u32(f"the value type of {_label(key)}")
        metadata[key] = cur.value(type_id, f"metadata {_label(key)}")
        value_types[key] = type_id

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a positive power of two, got {_short(alignment)}")

    raw = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        label = _label(name)
        n_dims = cur.u32(f"the dimension count of tensor {label}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {label} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cur.u64(f"dimension {j} of tensor {label}") for j in range(n_dims))
        type_id = cur.u32(f"the type of tensor {label}")
        offset = cur.u64(f"the data offset of tensor {label}")
        raw.append((name, dims, type_id, offset))

    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in raw:
        label = _label(name)
        if name in tensors:
            raise cur.fail(f"tensor {label} appears twice")
        if type_id not in GGML_TYPES:
            raise cur.fail(f"unknown tensor type {type_id} in tensor {label}")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        if any(d <= 0 for d in dims):
            raise cur.fail(f"tensor {label} has a non-positive dimension {list(dims)}")
        if dims[0] % block:
            raise cur.fail(f"tensor {label} ({type_name}) has {dims[0]} values per row, not a multiple of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        if offset % alignment:
            raise cur.fail(f"tensor {label} has offset {offset}, not a multiple of the alignment {alignment}")
        start = data_offset + offset
        if start + nbytes > cur.size:
            raise cur.fail(f"tensor {label} claims {nbytes} bytes at byte {start}, "
                           f"{start + nbytes - cur.size} bytes beyond the end of the file ({cur.size} bytes)")
        tensors[name] = TensorInfo(name, dims, type_id, start, nbytes)

    previous = None
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if previous is not None and info.offset < previous.offset + previous.nbytes:
            raise cur.fail(f"tensors {_label(previous.name)} and {_label(info.name)} overlap")
        previous = info
    return Header(path, version, metadata, tensors, alignment, data_offset, cur.size, value_types)


def _header(path_or_header) -> Header:
    return path_or_header if isinstance(path_or_header, Header) else read_header(path_or_header)


# ------------------------------------------------------------------------------------------------ config

#: GGUF architecture -> mlx-lm model_type (both use the llama block: RMSNorm, SwiGLU MLP, GQA attention).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
#: Architectures whose Q/K rows llama.cpp's converter permuted (interleaved RoPE).
PERMUTED_QK = frozenset({"llama"})


def config_from_gguf(path_or_header) -> dict:
    """A Hugging Face style config.json dict for mlx-lm's llama / qwen2, from the metadata (no weights read).

    tie_word_embeddings is true when the file has no ``output.weight``; vocab_size is the embedding's row
    count; rope_scaling comes from ``<arch>.rope.scaling.*`` (linear, yarn) or a ``rope_freqs`` tensor
    (Llama 3 frequency factors, fitted back to mlx-lm's "llama3" parameters); torch_dtype is the file's precision
    (`file_dtype`); gguf_quantization names the file's block-quantized tensor types ("Q4_1"), when it has any.
    """
    h = _header(path_or_header)
    arch = h.architecture
    if arch not in ARCHITECTURES:
        raise h.fail(f"unsupported architecture {_short(arch)} (supported: {', '.join(ARCHITECTURES)})")

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
    eps_key = key("attention.layer_norm_rms_epsilon")
    eps = _decimal(h, eps_key, h.require(eps_key, float))
    if not eps > 0:
        raise h.fail(f"{eps_key} must be positive, got {eps}")
    theta = _decimal(h, key("rope.freq_base"), h.get(key("rope.freq_base"), 10000.0, float))
    if not theta > 1:
        raise h.fail(f"{key('rope.freq_base')} must be > 1, got {theta}")
    context = _positive(h, key("context_length"))
    embedding = h.tensors.get("token_embd.weight")
    if embedding is None:
        raise h.fail("missing tensor token_embd.weight")
    if len(embedding.dims) != 2:
        raise h.fail(f"tensor token_embd.weight has dims {list(embedding.dims)}, expected 2")
    vocab = embedding.dims[1]

    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_traditional": False,
        "max_position_embeddings": context,
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        "hidden_act": "silu",
        "torch_dtype": file_dtype(h),
    }
    quantized = sorted({t.type_name for t in h.tensors.values()} - set(FLOAT_TYPES))
    if quantized:  # the file's weights are already quantized: the planner does not advise quantizing them
        config["gguf_quantization"] = "+".join(quantized)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in h.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in h.tensors
    scaling = _rope_scaling(h, arch, head_dim, theta, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for name, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                           ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if gguf_key in h.metadata:
            config[name] = h.require(gguf_key, int)
    eot = h.get("tokenizer.ggml.eot_token_id", None, int)
    if eot is not None and eot != config.get("eos_token_id", eot):
        config["eos_token_id"] = [config["eos_token_id"], eot]
    return config


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
    freqs = h.tensors.get("rope_freqs.weight")
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


# ----------------------------------------------------------------------------------------------- weights

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


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's per-head Q/K row interleaving: row 2i -> i, row 2i+1 -> i + d/2 within each head.

    Works on NumPy and MLX arrays whose first axis is the rows (weights, packed quantized weights, scales,
    biases, 1-D bias vectors).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _default_device_is_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.cpu


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
            raise h.fail(f"missing tensor {_gguf_name(name)}")
    return found


def _gguf_name(mlx: str) -> str:
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
    import importlib

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


# --------------------------------------------------------------------------------------------- tokenizer

# Pre-tokenizer regexes of llama.cpp's byte-level BPE (`tokenizer.ggml.pre`), applied one after the other,
# each isolating its matches ("isolated" splits), then the byte-to-unicode mapping of GPT-2.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
#: pre-tokenizer name -> (regexes, ignore_merges, add_bos default), as llama.cpp reads them.
PRE_TOKENIZERS = {
    "default": (_DEFAULT_RES, False, False),
    "gpt-2": ((_GPT2_RE,), False, False),
    "phi-2": ((_GPT2_RE,), False, False),
    "mpt": ((_GPT2_RE,), False, False),
    "olmo": ((_GPT2_RE,), False, False),
    "llama3": ((_LLAMA3_RE,), True, True),
    "llama-v3": ((_LLAMA3_RE,), True, True),
    "llama-bpe": ((_LLAMA3_RE,), True, True),
    "falcon3": ((_LLAMA3_RE,), True, True),
    "smaug-bpe": ((_LLAMA3_RE,), False, False),
    "dbrx": ((_LLAMA3_RE,), False, False),
    "smollm": ((r"\p{N}", _GPT2_RE), False, False),
    "starcoder": ((r"\p{N}", _GPT2_RE), False, False),
    "refact": ((r"\p{N}", _GPT2_RE), False, False),
    "qwen2": ((_QWEN2_RE,), False, False),
    "stablelm2": ((_QWEN2_RE,), False, False),
    "deepseek-r1-qwen": ((_QWEN2_RE,), False, False),
}


@dataclass
class _Vocab:
    kind: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style BPE with byte fallback)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[tuple[str, str]] | None
    pre: str | None
    special: dict[str, int]  # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def _read_vocab(h: Header) -> _Vocab:
    kind = h.get("tokenizer.ggml.model", None, str)
    if kind is None:
        raise h.fail("missing metadata key tokenizer.ggml.model (the file has no tokenizer)")
    if kind not in ("gpt2", "llama"):
        raise h.fail(f"unsupported tokenizer model {_short(kind)} (supported: gpt2 byte-level BPE, llama SentencePiece)")
    tokens = h.require("tokenizer.ggml.tokens", list)
    n = len(tokens)
    if not n or not all(isinstance(t, str) for t in tokens):
        raise h.fail("tokenizer.ggml.tokens must be a non-empty array of strings")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for empty tokens
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if seen.setdefault(t, i) != i:
            raise h.fail(f"token {_short(t)} appears twice in tokenizer.ggml.tokens (ids {seen[t]} and {i})")

    def per_token(key, kinds, default):
        values = h.get(key, None, list)
        if values is None:
            return default
        if len(values) != n or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in values):
            raise h.fail(f"{key} must have one number per token ({n}), got {len(values)} values")
        return values

    types = per_token("tokenizer.ggml.token_type", int, [NORMAL] * n)
    scores = per_token("tokenizer.ggml.scores", (int, float), None)
    merges = None
    pre = None
    if kind == "gpt2":
        raw = h.require("tokenizer.ggml.merges", list)
        merges = []
        for m in raw:
            parts = m.split(" ") if isinstance(m, str) else []
            if len(parts) != 2 or not (parts[0] in seen and parts[1] in seen and parts[0] + parts[1] in seen):
                raise h.fail(f"tokenizer.ggml.merges has a merge {_short(m)} of or into tokens not in the vocabulary")
            merges.append((parts[0], parts[1]))
        pre = h.get("tokenizer.ggml.pre", "default", str)
        if pre not in PRE_TOKENIZERS:
            raise h.fail(f"unsupported pre-tokenizer {_short(pre)} (tokenizer.ggml.pre); supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    elif scores is None:
        raise h.fail("missing metadata key tokenizer.ggml.scores (needed by a llama tokenizer)")
    special = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        value = h.get(f"tokenizer.ggml.{key}", None, int)
        if value is not None:
            if not 0 <= value < n:
                raise h.fail(f"tokenizer.ggml.{key}={value} is not a token id (vocabulary of {n})")
            special[role] = value
    if kind == "llama":  # llama.cpp's defaults for SentencePiece vocabularies
        add_bos_default, space_default = True, True
    else:
        add_bos_default, space_default = PRE_TOKENIZERS[pre][2], False
    add_bos = bool(h.get("tokenizer.ggml.add_bos_token", add_bos_default, bool)) and "bos" in special
    add_eos = bool(h.get("tokenizer.ggml.add_eos_token", False, bool)) and "eos" in special
    add_space_prefix = bool(h.get("tokenizer.ggml.add_space_prefix", space_default, bool))
    return _Vocab(kind, tokens, types, scores, merges, pre, special, add_bos, add_eos, add_space_prefix)


def _spm_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece/llama.cpp's rule "merge the adjacent pair whose concatenation is
    the highest-scoring normal piece, leftmost first": every split a + b of a normal piece p into two normal
    pieces, ranked by p's score (descending), then p's id."""
    normal = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types)) if k == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in normal and b in normal:
                ranked.append((-vocab.scores[i], i, normal[a], (a, b)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_tokenizer(path_or_header):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for the file's vocabulary.

    gpt2: byte-level BPE over the file's merges, after llama.cpp's regex splits for ``tokenizer.ggml.pre``
    (Llama 3's pre-tokenizers also take a whole pre-token that is in the vocabulary as one token,
    "ignore_merges"). llama: spaces become U+2581 (with one prepended unless ``add_space_prefix`` is false),
    BPE over merges derived from the scores (`_spm_merges`), unknown characters as <0xXX> byte tokens.
    Control and unknown tokens are special added tokens, user-defined tokens plain added tokens. BOS/EOS are
    added by the post-processor when ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so (llama.cpp's
    defaults otherwise: BOS for SentencePiece vocabularies and Llama 3 pre-tokenizers).
    """
    return _build_tokenizer(_read_vocab(_header(path_or_header)))


def _build_tokenizer(vocab: _Vocab):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.kind == "gpt2":
        regexes, ignore_merges, _ = PRE_TOKENIZERS[vocab.pre]
        tok = Tokenizer(models.BPE(ids, vocab.merges, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        unk = vocab.tokens[vocab.special["unk"]] if "unk" in vocab.special else None
        tok = Tokenizer(models.BPE(ids, _spm_merges(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True))
        steps = [normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(vocab.tokens, vocab.types) if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(vocab.tokens, vocab.types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos = vocab.tokens[vocab.special["bos"]] if vocab.add_bos else None
    eos = vocab.tokens[vocab.special["eos"]] if vocab.add_eos else None
    if bos or eos:
        single = " ".join(([bos] if bos else []) + ["$A"] + ([eos] if eos else []))
        pair = single + " " + " ".join(([bos + ":1"] if bos else []) + ["$B:1"] + ([eos + ":1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, ids[t]) for t in (bos, eos) if t])
    return tok


def tokenizer_config(path_or_header) -> dict:
    """tokenizer_config.json for `build_tokenizer`'s tokenizer: special tokens, add_bos/add_eos and the chat
    template (``tokenizer.chat_template``). No model_max_length: evaluating beyond the trained window is
    what context extension is about, and transformers would warn on every longer text."""
    h = _header(path_or_header)
    return _tokenizer_config(h, _read_vocab(h))


def _tokenizer_config(h: Header, vocab: _Vocab) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos}
    for role, i in vocab.special.items():
        config[f"{role}_token"] = vocab.tokens[i]
    template = h.get("tokenizer.chat_template", None, str)
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(path_or_header, folder: str | os.PathLike) -> Path:
    """Write tokenizer.json and tokenizer_config.json for the file's tokenizer into `folder`; returns it."""
    h = _header(path_or_header)
    vocab = _read_vocab(h)  # checked before anything is written
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(h, vocab), indent=2) + "\n")
    return folder


def _eos_ids(config: dict) -> list[int] | None:
    eos = config.get("eos_token_id")
    return None if eos is None else (list(eos) if isinstance(eos, list) else [eos])


def load_tokenizer(path_or_header, config: dict | None = None):
    """The file's tokenizer as an mlx-lm `TokenizerWrapper` (what `mlx_lm.load` returns)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    h = _header(path_or_header)
    config = config if config is not None else config_from_gguf(h)
    with tempfile.TemporaryDirectory(prefix="pose_mlx_gguf_") as tmp:
        write_tokenizer(h, tmp)
        return mlx_load_tokenizer(Path(tmp), eos_token_ids=_eos_ids(config))


# -------------------------------------------------------------------------------------------- load, convert


def load_gguf(path: str | os.PathLike, keep_quantized: bool | None = None):
    """Load a llama-family GGUF file: (mlx-lm model, mlx-lm TokenizerWrapper, config dict).

    keep_quantized: None (default) dequantizes Q8_0/Q4_0/Q4_1 weights when MLX's default device is the CPU
    (a quantized matmul is several times slower there than a float32 one) and keeps them quantized otherwise;
    True keeps them as ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` (group size 32) everywhere; False
    always dequantizes. On the CPU every float weight is float32.
    """
    h = read_header(path)
    config = config_from_gguf(h)
    tokenizer = load_tokenizer(h, config)
    cpu = _default_device_is_cpu()
    keep = (not cpu) if keep_quantized is None else bool(keep_quantized)
    model, _ = _model_from_header(h, config, keep, _compute_dtype(h, cpu))
    return model, tokenizer, config


def _quantization_config(quantized: dict[str, int]) -> dict:
    """mlx-lm's config["quantization"]: the most common bits as the default, other modules listed."""
    bits = Counter(quantized.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    for module, b in sorted(quantized.items()):
        if b != bits:
            config[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def convert(path: str | os.PathLike, out_folder: str | os.PathLike, keep_quantized: bool = False,
            overwrite: bool = False) -> Path:
    """Write an mlx-lm model folder (config.json, model.safetensors, tokenizer files) from a GGUF file.

    Without `keep_quantized` every weight is float32 (dequantization is exact); with it Q8_0/Q4_0/Q4_1 weights
    stay quantized (config["quantization"] lists their bits) and the other arrays keep the file's precision
    (float16 scales for a quantized file, as mlx-lm's quantized models have). The folder is written
    under a temporary name next to `out_folder` and renamed into place, so it is complete or absent.
    """
    from mlx_lm.utils import save_model

    out = Path(out_folder)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
    h = read_header(path)
    config = config_from_gguf(h)
    vocab = _read_vocab(h)  # the tokenizer is checked before anything is written
    dtype = _compute_dtype(h, cpu=not keep_quantized)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "tmp")
    tmp.mkdir()
    try:
        _build_tokenizer(vocab).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(h, vocab), indent=2) + "\n")
        model, quantized = _model_from_header(h, config, bool(keep_quantized), dtype)
        save_model(tmp, model)
        if quantized:
            config["quantization"] = config["quantization_config"] = _quantization_config(quantized)
        config["torch_dtype"] = str(dtype).rsplit(".", 1)[-1]
        config.pop("gguf_quantization", None)  # the folder's own quantization (if any) is config["quantization"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _sibling(out: Path, kind: str) -> Path:
    """A fresh hidden name next to `out` (same file system, so renames are atomic)."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and removed once `tmp` is in place."""
    if out.exists():
        old = _sibling(out, "old")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


__all__ = ["Header", "TensorInfo", "build_tokenizer", "config_from_gguf", "convert", "load_gguf", "load_tokenizer",
           "mlx_name", "read_header", "tokenizer_config", "unpermute_rows", "write_tokenizer"]
