"""Export an extended (and fine-tuned) model as a standard mlx-lm model folder.

The folder holds model*.safetensors, the tokenizer files, `pose_mlx.json` (the exact schedule plus run
metadata) and a config.json in which plain `mlx_lm.load` rebuilds the same scaled RoPE:

- none / ntk / abf: the schedule is a geometric frequency ladder inv_freq_i = b'^(-2i/d), so the config
  gets `rope_theta = b'` (for static NTK b' = b * s^(d/(d-2))) and no `rope_scaling`;
- linear (PI, eq. 2 of the PI paper), yarn (inverse-frequency blend), llama3, longrope: a `rope_scaling`
  entry with `original_max_position_embeddings`; YaRN's attention factor a is written as mlx-lm's `mscale`
  m with 0.1 * m * ln(s) + 1 = a;
- anything else (dprope, wavelength-blend YaRN, dynamic NTK): the closest expressible config (PI) is written
  and `pose_mlx.load(folder)` must be used - `export_model` reports `mlx_lm_exact = False`.

Which case applies is decided numerically: the RoPE layer mlx-lm would build from the candidate config must
have the same per-pair frequencies and input scale as the model's own (relative error <= 1e-5).
The folder is assembled in a temporary sibling and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .patch import PositionRoPE, find_rope_modules, save_extension

TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.tiktoken", "chat_template*", "generation_config.json", "*.py")
_EXACT_TOL = 1e-5


def candidate_rope_config(ext) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) that mlx-lm / transformers read for the schedule in `ext`."""
    d, s, p = ext.rotary_dims, float(ext.factor), ext.params
    orig = int(ext.original_length)
    inv_freq = _inv_freq(ext)
    if ext.method in ("none", "ntk", "abf") and d > 2:
        return float(inv_freq[-1] ** (-d / (d - 2))), None
    if ext.method == "yarn":
        mscale = (ext.attention_factor - 1.0) / (0.1 * np.log(s)) if s > 1 else 1.0
        return ext.base, {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": orig,
                          "beta_fast": float(p.get("beta_fast", 32.0)), "beta_slow": float(p.get("beta_slow", 1.0)),
                          "mscale": float(mscale), "mscale_all_dim": 0.0}
    if ext.method == "llama3":
        return ext.base, {"rope_type": "llama3", "factor": s, "original_max_position_embeddings": orig,
                          "low_freq_factor": float(p.get("low_freq_factor", 1.0)),
                          "high_freq_factor": float(p.get("high_freq_factor", 4.0))}
    if ext.method == "longrope":
        theta = ext.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        long_factor = [float(x) for x in theta / inv_freq]
        return ext.base, {"rope_type": "longrope", "factor": s, "original_max_position_embeddings": orig,
                          "long_factor": long_factor, "short_factor": long_factor}
    return ext.base, {"rope_type": "linear", "factor": s, "original_max_position_embeddings": orig}


def _inv_freq(ext) -> np.ndarray:
    from .rope import scaled_inv_freq

    inv_freq, _ = scaled_inv_freq(ext.method, ext.rotary_dims, ext.base, ext.factor, ext.original_length,
                                  **ext.params)
    return np.asarray(inv_freq, dtype=np.float64)


def rope_response(rope: nn.Module, dims: int, traditional: bool) -> tuple[np.ndarray, np.ndarray]:
    """(angle per unit position f_i, input scale a_i) of a RoPE layer, read off by rotating basis vectors.

    Basis vector e (the first feature of pair i) at position 1 comes out as a * (cos f_i, sin f_i) in the
    pair's two slots, so f_i = atan2 and a_i = the norm. Position 1 keeps float32 angle error at ~1e-7.
    """
    half = dims // 2
    first = np.arange(0, dims, 2) if traditional else np.arange(half)
    second = first + 1 if traditional else first + half
    basis = np.zeros((1, half, 1, dims), dtype=np.float32)
    basis[0, np.arange(half), 0, first] = 1.0
    x = mx.array(basis)
    y = np.array(rope(x, offset=1).astype(mx.float32))[0, :, 0, :]
    cos, sin = y[np.arange(half), first], y[np.arange(half), second]
    return np.arctan2(sin, cos), np.hypot(sin, cos)


def rope_matches(model: nn.Module, rope_theta: float, rope_scaling: dict | None, max_positions: int) -> bool:
    """True when mlx-lm's RoPE built from (rope_theta, rope_scaling) equals the model's extended RoPE.

    Compares the per-pair frequencies and input scales of both layers (relative error <= 1e-5), which fixes
    the rotation at every position. A dynamic schedule never matches (its frequencies depend on the length).
    """
    from mlx_lm.models.rope_utils import initialize_rope

    ours = next(m for _, m in find_rope_modules(model) if isinstance(m, PositionRoPE))
    if ours._dynamic is not None:
        return False
    try:
        theirs = initialize_rope(ours.dims, rope_theta, ours.traditional, rope_scaling, max_positions)
    except (KeyError, ValueError, TypeError):
        return False
    f_ours, a_ours = rope_response(ours, ours.dims, ours.traditional)
    f_theirs, a_theirs = rope_response(theirs, ours.dims, ours.traditional)
    return bool(np.allclose(f_theirs, f_ours, rtol=_EXACT_TOL, atol=0) and
                np.allclose(a_theirs, a_ours, rtol=_EXACT_TOL, atol=0))


def export_config(model: nn.Module, config: dict) -> tuple[dict, bool]:
    """The source `config` rewritten for the model's extension; also whether mlx-lm reproduces it exactly."""
    ext = model.pose_extension
    theta, scaling = candidate_rope_config(ext)
    exact = rope_matches(model, theta, scaling, ext.target_length)
    out = dict(config)
    out["rope_theta"] = theta
    if scaling is None:
        out.pop("rope_scaling", None)
    else:
        out["rope_scaling"] = scaling
    if isinstance(out.get("rope_parameters"), dict):
        out["rope_parameters"] = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    out["max_position_embeddings"] = int(ext.target_length)
    return out, exact


def _lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "fuse") and hasattr(m, "lora_a")]


def fuse_lora(model: nn.Module) -> None:
    """Fold every LoRA layer into its base layer in place (W <- W + scale * B A, re-quantized if needed)."""
    fused = [(n, m.fuse()) for n, m in _lora_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))


def _write_unfused(model: nn.Module, folder: Path, lora: dict) -> None:
    """Base weights as model*.safetensors plus adapters.safetensors + adapter_config.json (mlx-lm format)."""
    from mlx_lm.utils import save_model

    loras = _lora_modules(model)
    adapters = {}
    for name, m in loras:
        adapters[f"{name}.lora_a"] = m.lora_a
        adapters[f"{name}.lora_b"] = m.lora_b
    model.update_modules(tree_unflatten([(n, m.linear) for n, m in loras]))
    try:
        save_model(folder, model)
    finally:
        model.update_modules(tree_unflatten(loras))
    mx.save_safetensors(str(folder / "adapters.safetensors"), adapters)
    adapter_config = {"fine_tune_type": "lora", "num_layers": int(lora["num_layers"]),
                      "lora_parameters": {"rank": int(lora["rank"]), "scale": float(lora["scale"]), "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


def copy_tokenizer_files(source: Path, folder: Path) -> None:
    for pattern in TOKENIZER_PATTERNS:
        for path in Path(source).glob(pattern):
            if path.is_file():
                shutil.copyfile(path, folder / path.name)


def export_model(model: nn.Module, config: dict, source: Path, output: Path, *, fuse: bool = True,
                 lora: dict | None = None, record: dict | None = None, extra_files: dict | None = None,
                 overwrite: bool = False) -> dict:
    """Write the extended `model` to `output` as an mlx-lm folder; returns {"mlx_lm_exact": bool, ...}.

    `config` is the source config.json dict, `source` the source folder (tokenizer files are copied from
    it), `lora` {"num_layers", "rank", "scale"} when the model carries LoRA layers, `record` extra fields
    for pose_mlx.json, `extra_files` {name: path} copied in (logs). With `fuse=False` LoRA stays separate
    (load with `mlx_lm.load(output, adapter_path=output)`). An existing `output` is replaced only with
    `overwrite=True`; nothing appears at `output` until the folder is complete.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        raise ValueError(f"output folder {output} exists; pass --overwrite to replace it")
    if getattr(model, "pose_extension", None) is None:
        raise ValueError("model was not extended with pose_mlx.extend; nothing to export")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        new_config, exact = export_config(model, config)
        if _lora_modules(model) and not fuse:
            if lora is None:
                raise ValueError("fuse=False needs the LoRA settings (lora=...)")
            _write_unfused(model, tmp, lora)
        else:
            from mlx_lm.utils import save_model

            fuse_lora(model)
            save_model(tmp, model)
        from mlx_lm.utils import save_config

        save_config(new_config, tmp / "config.json")
        copy_tokenizer_files(Path(source), tmp)
        save_extension(model, tmp, mlx_lm_exact=exact, **(record or {}))
        for name, path in (extra_files or {}).items():
            if Path(path).is_file():
                shutil.copyfile(path, tmp / name)
        _replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"mlx_lm_exact": exact, "rope_theta": new_config["rope_theta"],
            "rope_scaling": new_config.get("rope_scaling")}


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder `src` to `dst`, replacing an existing `dst` only after `src` is complete."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


__all__ = ["candidate_rope_config", "copy_tokenizer_files", "export_config", "export_model", "fuse_lora",
           "rope_matches"]
