"""A GGUF file as an mlx-lm model: in memory (`load_gguf`) or as a model folder `mlx_lm.load` reads (`convert`)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...files import replace_dir, sibling
from .config import config_from_gguf
from .header import read_header
from .tokenizer import _build_tokenizer, _read_vocab, _tokenizer_config, load_tokenizer
from .weights import GROUP_SIZE, _compute_dtype, _model_from_header

# Imported inside functions, on purpose: MLX, mlx-lm, each where it is used: they are costly to import or unneeded on
# the paths that import this module (`--help`, `plan`, the NumPy-only parts).


def _default_device_is_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.cpu


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
        raise UserError(f"{out} already exists; pass overwrite=True to replace it")
    h = read_header(path)
    config = config_from_gguf(h)
    vocab = _read_vocab(h)  # the tokenizer is checked before anything is written
    dtype = _compute_dtype(h, cpu=not keep_quantized)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(out, "tmp")
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
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["convert", "load_gguf"]
