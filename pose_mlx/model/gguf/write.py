"""An mlx-lm model folder as a GGUF file that llama.cpp (Ollama, LM Studio) runs: the reverse of `load.convert`.

`export_gguf(folder, out, outtype)` loads the folder as every pose_mlx command does (LoRA adapters of a
``--no-fuse`` export folded in, the schedule of its pose_mlx.json re-applied, quantized weights dequantized), and
writes with gguf-py's `GGUFWriter`:

- the architecture's keys (``llama`` for mlx-lm's llama and mistral, ``qwen2``), the extended window as
  ``context_length`` and the schedule as llama.cpp reads it (`rope_keys`: a new ``rope.freq_base`` for
  none/ntk/abf, ``rope.scaling.*`` for linear and YaRN, a ``rope_freqs`` tensor for Llama 3). Before anything is
  written, the RoPE llama.cpp will compute from these keys (`llamacpp_rope`) is compared with every RoPE layer of
  the loaded model (frequencies and q/k scale within 1e-5), so a file that llama.cpp would read differently is
  never written;
- the tokenizer (`vocab_out`): the keys of the GGUF file the folder came from when it is known (finetune
  passes it; `pose_mlx.json`'s source_model when its vocabulary is the folder's), else the folder's
  tokenizer.json;
- the weights in ``f32``, ``f16``, ``bf16`` or ``q8_0`` (1-D tensors stay F32, as llama.cpp's converter writes
  them; a Q8_0 matrix whose rows are not a multiple of 32 is written F16). llama.cpp runs the llama
  architecture with interleaved RoPE pairs, so the rows of W_q and W_k (and their biases) are reordered within
  each head (`permute_rows`), the inverse of what the reader undoes.

The file is written under a temporary name beside `out` and renamed into place when complete (`write_atomic`):
Ctrl-C or a full disk leaves no partial file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UserError
from ...rope import SCHEDULES, rope_inv_freq, scaled_inv_freq
from .header import ARRAY, read_header
from .rope_keys import llamacpp_rope, rope_keys
from .vocab_out import tokenizer_metadata
from .weights import gguf_name, permute_rows, unpermute_rows

# Imported inside functions, on purpose: gguf-py, MLX, mlx-lm and the package's MLX-backed modules, each where it
# is used: they are costly to import or unneeded on the paths that import this module (`--help`, `plan`).

#: --outtype: the GGML type of the matrices.
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: mlx-lm model_type -> GGUF architecture (mlx-lm runs mistral as llama; llama.cpp's converter writes it as llama).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_F16_MAX = 65504.0
_EXACT_TOL = 1e-5


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its GGUF name, the mlx-lm parameter it comes from, its GGML type and how its rows
    are reordered ("permute", "unpermute" or None; with the head count)."""

    name: str
    source: str | None
    qtype: str
    shape: tuple
    rows: tuple | None = None


def gguf_path(output: str | os.PathLike) -> Path:
    """Where `finetune --export-gguf` writes the GGUF file of the output folder: beside it, ``<output>.gguf``."""
    output = Path(output)
    return output.with_name(output.name + ".gguf")


def check_exportable(config: dict, schedule: str | None = None, params: dict | None = None, factor: float = 1.0,
                     original: int | None = None) -> str:
    """The GGUF architecture of a model with `config` extended by `schedule` (None: the one its config's
    rope_scaling describes); UserError when the family or the schedule cannot be written (what `finetune
    --export-gguf` checks before training, and `export_gguf` before loading any weight)."""
    arch = _architecture(config)
    if schedule is None:
        schedule, params, factor, original, _, _ = _config_schedule(config)
    dims = _head_dim(config)
    base = float(config.get("rope_theta", 10000.0))
    if schedule in SCHEDULES:  # mlx-lm's own types outside pose_mlx's schedules are refused by rope_keys
        inv_freq, attention = scaled_inv_freq(schedule, dims, base, factor, original, **params)
        factors = list(rope_inv_freq(dims, base) / inv_freq)
    else:
        attention, factors = 1.0, None
    rope_keys(schedule, params, factor, original, attention, factors, arch)
    return arch


def _recorded_schedule(folder: Path) -> tuple:
    """(schedule, params, factor, original) of the folder's pose_mlx.json (the names of earlier versions too), or
    (None, ...) when it has none."""
    from ..source import SCHEDULE_FILE

    path = folder / SCHEDULE_FILE
    if not path.is_file():
        return None, None, 1.0, None
    s = json.loads(path.read_text())["schedule"]
    return (s.get("schedule", s.get("method")), dict(s.get("params") or {}), float(s["factor"]),
            int(s.get("original", s.get("original_length"))))


def _architecture(config: dict) -> str:
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise UserError(f"GGUF export supports the model types {', '.join(ARCHITECTURES)} (Llama, Mistral, SmolLM, "
                        f"Qwen2, ...); this model is {kind!r}")
    return ARCHITECTURES[kind]


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def export_gguf(folder: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16", *, overwrite: bool = False,
                source_gguf: str | os.PathLike | None = None, progress: bool | None = None) -> dict:
    """Write the model folder `folder` to the GGUF file `out` with matrices in `outtype` (f32, f16, bf16, q8_0);
    returns {"path", "outtype", "architecture", "rope" (the rope keys written), "tokenizer" (where it came
    from)}. `source_gguf`: the GGUF file the folder was made from (its tokenizer keys are copied); None looks
    for it in pose_mlx.json. `progress`: a progress bar on stderr (None: when stderr is a terminal)."""
    from ...files import write_atomic
    from ..source import load, read_config, resolve

    folder, out = Path(folder), Path(out)
    if outtype not in OUTTYPES:
        raise UserError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not a model folder (no config.json)")
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it")
    arch = check_exportable(read_config(resolve(str(folder))), *_recorded_schedule(folder))
    model, _, config = load(str(folder), return_config=True)
    _dense(model)
    weights = _weights(model)
    metadata, rope_freqs = _model_metadata(model, config, arch, weights, outtype, folder.name)
    source = _source_header(folder, source_gguf)
    vocab, origin = tokenizer_metadata(folder, metadata[f"{arch}.vocab_size"][0], source)
    tensors = _plan_tensors(config, arch, weights, outtype, rope_freqs is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda tmp: _write(tmp, arch, {**metadata, **vocab}, tensors, weights, rope_freqs,
                                         progress, out.name))
    rope = {k: v for k, (v, _) in metadata.items() if ".rope." in k or k.endswith("context_length")}
    return {"path": str(out), "outtype": outtype, "architecture": arch, "rope": rope, "tokenizer": origin}


def _dense(model) -> None:
    """Dequantize every quantized layer (in float32, whatever the dtype of its scales) and fold LoRA adapters
    into their layers, in place: float weights only."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    from ...training.lora import lora_modules

    dense = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        biases = None if m.get("biases") is None else m.biases.astype(mx.float32)
        w = mx.dequantize(m.weight, m.scales.astype(mx.float32), biases, group_size=m.group_size, bits=m.bits,
                          mode=m.mode)
        layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m) if isinstance(m, nn.QuantizedLinear) \
            else nn.Embedding(*w.shape)
        layer.weight = w
        if "bias" in m:
            layer.bias = m.bias
        dense.append((name, layer))
    if dense:
        model.update_modules(tree_unflatten(dense))
    fused = [(n, m.fuse()) for n, m in lora_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))


def _weights(model) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


def _source_header(folder: Path, source_gguf):
    """The header of the GGUF file the folder came from: `source_gguf`, else pose_mlx.json's source_model when it
    is a GGUF file whose tokens are those of the folder's tokenizer.json; None otherwise."""
    from ..source import is_gguf_file

    if source_gguf is not None:
        return read_header(source_gguf)
    try:
        record = json.loads((folder / "pose_mlx.json").read_text())
        candidate = Path(str(record["source_model"])).expanduser()
        if not (candidate.is_file() and is_gguf_file(candidate)):
            return None
        spec = json.loads((folder / "tokenizer.json").read_text())
        ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens") or ()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no record, no such file, no BPE vocab
        return None
    h = read_header(candidate)
    tokens = h.metadata.get("tokenizer.ggml.tokens") or []
    same = len(ids) == len(tokens) and all(isinstance(i, int) and 0 <= i < len(tokens) and tokens[i] == t
                                           for t, i in ids.items())
    return h if same else None


def _model_metadata(model, config: dict, arch: str, weights: dict, outtype: str, name: str) -> tuple[dict, object]:
    """({key: (value, value type id)} of the architecture, file type and RoPE; the rope_freqs tensor or None)."""
    import gguf

    U32, F32, STR = 4, 6, 8
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    dims = _head_dim(config)
    vocab, _ = weights["model.embed_tokens.weight"].shape
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    keys = {"general.name": (name, STR), "general.file_type": (int(file_type), U32),
            f"{arch}.vocab_size": (int(vocab), U32),
            f"{arch}.embedding_length": (hidden, U32), f"{arch}.block_count": (int(config["num_hidden_layers"]), U32),
            f"{arch}.feed_forward_length": (int(config["intermediate_size"]), U32),
            f"{arch}.attention.head_count": (heads, U32), f"{arch}.attention.head_count_kv": (kv_heads, U32),
            f"{arch}.attention.layer_norm_rms_epsilon": (float(config["rms_norm_eps"]), F32),
            f"{arch}.rope.dimension_count": (dims, U32)}
    if dims * heads != hidden:
        keys[f"{arch}.attention.key_length"] = keys[f"{arch}.attention.value_length"] = (dims, U32)
    if outtype == "q8_0":
        keys["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, U32)
    rope, rope_freqs = _rope_metadata(model, config, arch, dims)
    keys.update({k: (v, STR if isinstance(v, str) else F32 if isinstance(v, float) else U32)
                 for k, v in rope.items()})
    return keys, rope_freqs


def _rope_metadata(model, config: dict, arch: str, dims: int) -> tuple[dict, object]:
    """({key: value} of the base, context length and scaling, rope_freqs or None) for the model's RoPE: from its
    Extension record, else its config's rope_scaling; checked against every RoPE layer of the model."""
    from ..export import rope_response
    from ..patch import find_rope_modules

    schedule, params, factor, original, target, base = _schedule_of(model, config)
    layers = find_rope_modules(model)
    ext = getattr(model, "pose_extension", None)
    inv_freq, attention = rope_response(layers[0][1], dims, _traditional(layers[0][1], config))
    if ext is not None:  # the record's float64 frequencies, not their float32 response
        inv_freq = np.asarray(ext.layers[0].inv_freq, dtype=np.float64)
    theta = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    keys, rope_freqs = rope_keys(schedule, params, factor, original, float(np.mean(attention)),
                                 list(theta / inv_freq), arch)
    if schedule in ("ntk", "abf"):  # a geometric ladder: its base from the lowest frequency
        base = float(inv_freq[-1]) ** (-dims / (dims - 2))
    metadata = {f"{arch}.context_length": int(target), f"{arch}.rope.freq_base": float(base),
                **{f"{arch}.{k}": v for k, v in keys.items()}}
    expected, scale = llamacpp_rope(metadata, arch, dims, rope_freqs)
    for path, module in layers:
        f, a = rope_response(module, dims, _traditional(module, config))
        if not (np.allclose(f, expected, rtol=_EXACT_TOL, atol=0) and np.allclose(a, scale, rtol=_EXACT_TOL)):
            worst = float(np.max(np.abs(f / expected - 1)))
            raise UserError(f"llama.cpp would not reproduce the RoPE of {path} ('{schedule}' schedule) from the "
                            f"GGUF keys {sorted(keys)} (frequencies off by up to {worst:.2g}); not written")
    return metadata, rope_freqs


def _schedule_of(model, config: dict) -> tuple:
    """(schedule, params, factor, original, target, raw base) from the model's Extension record, else from its
    config (`_config_schedule`)."""
    ext = getattr(model, "pose_extension", None)
    if ext is None:
        return _config_schedule(config)
    return (ext.schedule, dict(ext.params), float(ext.factor), int(ext.original), int(ext.target),
            float(ext.layers[0].base))


def _config_schedule(config: dict) -> tuple:
    """(schedule, params, factor, original, target, raw base) that a config's rope_scaling describes (mlx-lm's
    types: none, linear, yarn, llama3; dynamic and longrope are refused by `rope_keys`)."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    target = int(config.get("max_position_embeddings") or 4096)
    base = float(config.get("rope_theta", 10000.0))
    if kind == "default":
        return "none", {}, 1.0, target, target, base
    factor = float(scaling.get("factor", 1.0))
    # mlx-lm's YaRN assumes 4096 when the config names no original window
    original = int(scaling.get("original_max_position_embeddings") or (4096 if kind == "yarn" else
                                                                         round(target / factor)))
    params = {k: float(scaling[k]) for k in ("beta_fast", "beta_slow") if k in scaling} if kind == "yarn" else {}
    return {"su": "longrope"}.get(kind, kind), params, factor, original, target, base


def _traditional(module, config: dict) -> bool:
    return bool(getattr(module, "traditional", config.get("rope_traditional", False)))


def _plan_tensors(config: dict, arch: str, weights: dict, outtype: str, rope_freqs: bool) -> list[Tensor]:
    """The tensors in llama.cpp's order (token_embd, blocks, output_norm, output), with their GGML types and
    row reordering; UserError when an f16 file cannot hold a weight."""
    heads = {"self_attn.q_proj": int(config["num_attention_heads"]),
             "self_attn.k_proj": int(config.get("num_key_value_heads") or config["num_attention_heads"])}
    traditional = bool(config.get("rope_traditional", False))
    # llama.cpp rotates interleaved pairs for llama, half-split ones for qwen2: rows move only where they differ
    if arch == "llama":
        reorder = None if traditional else "permute"
    else:
        reorder = "unpermute" if traditional else None
    tensors = [Tensor("rope_freqs.weight", None, "f32", (_head_dim(config) // 2,))] if rope_freqs else []
    for source, w in weights.items():
        module = source.rsplit(".", 1)[0]
        n_heads = next((n for suffix, n in heads.items() if module.endswith(suffix)), None)
        qtype = "f32" if w.ndim == 1 else outtype
        if qtype == "q8_0" and w.shape[-1] % 32:
            qtype = "f16"
        if qtype == "f16" and _overflows_f16(w):
            raise UserError(f"{source} holds values beyond float16's range (|x| > {_F16_MAX:g}); use --outtype bf16 "
                            "or f32")
        rows = (reorder, n_heads) if reorder and n_heads else None
        tensors.append(Tensor(gguf_name(source), source, qtype, tuple(w.shape), rows))
    order = {"token_embd": 0, "blk": 1, "output_norm": 2, "output": 3}
    return sorted(tensors, key=lambda t: (order.get(t.name.split(".")[0], -1), _block(t.name)))


def _block(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else 0


def _overflows_f16(w) -> bool:
    import mlx.core as mx

    return bool(mx.max(mx.abs(w.astype(mx.float32))).item() > _F16_MAX)


def _encode(t: Tensor, weights: dict, rope_freqs) -> np.ndarray:
    """The bytes of tensor `t` as written: float32 / float16 arrays, or gguf-py's BF16 / Q8_0 blocks (uint8)."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if t.source is None:
        return np.asarray(rope_freqs, dtype=np.float32)
    w = np.array(weights[t.source].astype(mx.float32), copy=False)
    if t.rows is not None:
        how, n_heads = t.rows
        w = (permute_rows if how == "permute" else unpermute_rows)(w, n_heads)
    if t.qtype == "f32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if t.qtype == "f16":
        return w.astype(np.float16)
    return quantize(np.ascontiguousarray(w), Q.BF16 if t.qtype == "bf16" else Q.Q8_0)


def _write(path: Path, arch: str, metadata: dict, tensors: list[Tensor], weights: dict, rope_freqs,
           progress: bool | None, label: str) -> None:
    """Write the GGUF file at `path`: header, metadata, tensor infos, then each tensor as it is encoded (one
    at a time in memory), with a progress bar over the bytes (`progress` None: shown on a terminal)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape
    from tqdm import tqdm

    writer = gguf.GGUFWriter(None, arch)
    for key, (value, kind) in metadata.items():
        if kind == ARRAY:
            writer.add_array(key, value)
        elif key != "general.architecture":
            writer.add_key_value(key, value, gguf.GGUFValueType(kind))
    total = 0
    for t in tensors:
        if t.qtype in ("f32", "f16"):
            dtype = np.dtype(np.float32 if t.qtype == "f32" else np.float16)
            shape, nbytes, raw = t.shape, int(np.prod(t.shape)) * dtype.itemsize, None
        else:
            dtype, raw = np.dtype(np.uint8), Q.BF16 if t.qtype == "bf16" else Q.Q8_0
            shape = quant_shape_to_byte_shape(t.shape, raw)
            nbytes = int(np.prod(shape))
        writer.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=raw)
        total += nbytes
    writer.write_header_to_file(path=Path(path))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {label}", leave=False,
                  disable=None if progress is None else not progress) as bar:
            for t in tensors:
                data = _encode(t, weights, rope_freqs)
                writer.write_tensor_data(data)
                bar.update(data.nbytes)
    finally:
        writer.close()


__all__ = ["ARCHITECTURES", "OUTTYPES", "check_exportable", "export_gguf", "gguf_path"]
