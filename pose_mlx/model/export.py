"""Export an extended (and fine-tuned) model as a standard mlx-lm model folder, its config written from the
`Extension` record that `pose_mlx.extend` made (layer by layer; nothing is recomputed).

The folder holds model*.safetensors, the tokenizer files, `pose_mlx.json` (the exact schedule plus run metadata)
and a config.json in which plain `mlx_lm.load` (and transformers) rebuild the same scaled RoPE (scale factor
s = target / original):

- none / ntk / abf: every layer's frequencies are a geometric ladder inv_freq_i = b'^(-2i/d), so the config key
  the layer's base came from (`rope_theta`; Gemma-3's local layers: `rope_local_base_freq`) gets b'
  (static NTK: b' = b * s^(d/(d-2))) and no `rope_scaling`;
- linear (PI), yarn (inverse-frequency blend), llama3: a `rope_scaling` entry; YaRN's attention factor a is
  written as mlx-lm's `mscale` m with 0.1 * m * ln(s) + 1 = a;
- longrope, dprope (and any other static schedule whose attention factor mlx-lm's longrope reproduces): a
  `longrope` entry with per-dimension factors lambda_i = theta_i / inv_freq_i. mlx-lm scales q and k by
  sqrt(1 + ln(M / O) / ln O) there (M = max_position_embeddings, O = original_max_position_embeddings), so a
  schedule without attention factor (dprope) is written with O = M (the original window stays in pose_mlx.json);
- dynamic NTK: mlx-lm's own `dynamic` entry (its frequencies depend on the length, so it is never "exact").

Which case applies is decided numerically: mlx-lm's model is built from the candidate config (no weights are
read) and every RoPE layer must have the per-pair frequencies and input scale of ours (relative error <= 1e-5).
When no candidate reproduces the schedule (wavelength-blend YaRN), the closest is written, `mlx_lm_exact` is
False, and the folder must be loaded with `pose_mlx.load`. The folder is assembled in a temporary sibling and
renamed into place at the end.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import save_config, save_model

from ..files import replace_dir, sibling
from ..words import counted
from .gguf import write_tokenizer
from .patch import Extension, find_rope_modules, save_extension
from .source import build_model
from .stored import stored_dtype

TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.tiktoken", "chat_template*", "generation_config.json", "*.py")
_EXACT_TOL = 1e-5


def _base_of_ladder(inv_freq: list) -> float:
    """b' with inv_freq_i = b'^(-2i/d) read off the last pair (exact when the ladder is geometric)."""
    d = 2 * len(inv_freq)
    return float(inv_freq[-1] ** (-d / (d - 2))) if d > 2 else float("nan")


def candidate_configs(ext: Extension, config: dict) -> list[dict]:
    """Configs (the source config rewritten) that may make mlx-lm rebuild `ext`, most specific first."""
    scale, orig, p = float(ext.factor), int(ext.original), ext.params
    global_layers = [l for l in ext.layers if l.config_key in (None, "rope_theta")] or ext.layers
    first = global_layers[0]

    def with_rope(theta: float | None = None, scaling: dict | None = None, bases: dict | None = None) -> dict:
        out = {k: v for k, v in config.items() if k != "rope_scaling"}
        out["rope_theta"] = float(first.base if theta is None else theta)
        out.update(bases or {})
        if scaling is not None:
            out["rope_scaling"] = scaling
        if isinstance(out.get("rope_parameters"), dict):  # transformers >= 5 reads this form
            out["rope_parameters"] = {"rope_theta": out["rope_theta"], **(scaling or {"rope_type": "default"})}
        out["max_position_embeddings"] = int(ext.target)
        return out

    schedule = ext.schedule
    if schedule in ("none", "ntk", "abf"):
        bases = {l.config_key: _base_of_ladder(l.inv_freq) for l in ext.layers if l.config_key}
        return [with_rope(_base_of_ladder(first.inv_freq), None, bases)]
    if schedule == "dynamic":
        return [with_rope(scaling={"rope_type": "dynamic", "factor": scale})]
    candidates = []
    if schedule == "linear":
        candidates.append(with_rope(scaling={"rope_type": "linear", "factor": scale}))
    elif schedule == "yarn":
        mscale = (first.attention_factor - 1.0) / (0.1 * math.log(scale)) if scale > 1 else 1.0
        candidates.append(with_rope(scaling={
            "rope_type": "yarn", "factor": scale, "original_max_position_embeddings": orig,
            "beta_fast": float(p.get("beta_fast", 32.0)), "beta_slow": float(p.get("beta_slow", 1.0)),
            "mscale": float(mscale), "mscale_all_dim": 0.0}))
    elif schedule == "llama3":
        candidates.append(with_rope(scaling={
            "rope_type": "llama3", "factor": scale, "original_max_position_embeddings": orig,
            "low_freq_factor": float(p.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(p.get("high_freq_factor", 4.0))}))
    factors = first.factors
    for original in (orig, int(ext.target)):  # mlx-lm's own attention factor, or none (O = M)
        candidates.append(with_rope(scaling={
            "rope_type": "longrope", "factor": scale, "original_max_position_embeddings": original,
            "long_factor": factors, "short_factor": factors,
            **({"attention_factor": 1.0} if original == ext.target else {})}))
    if schedule not in ("longrope", "dprope"):  # PI first among the fallbacks
        candidates.append(with_rope(scaling={"rope_type": "linear", "factor": scale}))
    return candidates


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
    y = np.array(rope(mx.array(basis), offset=1).astype(mx.float32))[0, :, 0, :]
    cos, sin = y[np.arange(half), first], y[np.arange(half), second]
    return np.arctan2(sin, cos), np.hypot(sin, cos)


def reproduces(ext: Extension, model: nn.Module, config: dict) -> bool:
    """True when mlx-lm's model built from `config` has, layer by layer, the RoPE of our extended `model`
    (per-pair frequencies and input scales within 1e-5 relative). A dynamic schedule never does."""
    if ext.dynamic:
        return False
    try:
        theirs = dict(find_rope_modules(build_model(config)))
    except (KeyError, ValueError, TypeError, AssertionError):
        return False
    ours = dict(find_rope_modules(model))
    if set(theirs) != set(ours):
        return False
    for path, layer in ((l.path, l) for l in ext.layers):
        f_ours, a_ours = rope_response(ours[path], layer.dims, layer.traditional)
        try:
            f_theirs, a_theirs = rope_response(theirs[path], layer.dims, layer.traditional)
        except (ValueError, TypeError):
            return False
        if not (np.allclose(f_theirs, f_ours, rtol=_EXACT_TOL, atol=0)
                and np.allclose(a_theirs, a_ours, rtol=_EXACT_TOL, atol=0)):
            return False
    return True


def export_config(model: nn.Module, config: dict) -> tuple[dict, bool]:
    """The config.json for the extended `model` (from its Extension record) and whether mlx-lm reproduces it."""
    ext = model.pose_extension
    candidates = candidate_configs(ext, config)
    for candidate in candidates:
        if reproduces(ext, model, candidate):
            return candidate, True
    return candidates[0], False


def with_stored_dtype(config: dict, folder: Path) -> dict:
    """`config` with torch_dtype (and dtype, which newer transformers write, when it has that key) set to the dtype
    of the weights written in `folder` (`stored_dtype`), not the source's: a GGUF file's precision, or a 16-bit base
    that the CPU fine-tuned and saved in float32. Without it the planner and the evaluators would assume 16 bits."""
    dtype = stored_dtype(folder)
    if dtype is None:
        return config
    return {**config, "torch_dtype": dtype, **({"dtype": dtype} if "dtype" in config else {})}


def copy_tokenizer_files(source: Path, folder: Path) -> None:
    for pattern in TOKENIZER_PATTERNS:
        for path in Path(source).glob(pattern):
            if path.is_file():
                shutil.copyfile(path, folder / path.name)


def export_model(model: nn.Module, config: dict, tokenizer_source: Path, output: Path, *,
                 save_weights: Callable[[nn.Module, Path], object] | None = None, record: dict | None = None,
                 extra_files: dict | None = None, overwrite: bool = False) -> dict:
    """Write the extended `model` to `output` as an mlx-lm folder; returns {"mlx_lm_exact", "rope_theta",
    "rope_scaling"}.

    `config` is the source config.json dict, `tokenizer_source` a folder holding the tokenizer files,
    `save_weights(model, folder)` what writes the weights into the folder (default: mlx-lm's `save_model`, the
    model as it is; a fine-tuning run passes how its LoRA layers are written: fused, or apart as adapters),
    `record` extra fields for pose_mlx.json, `extra_files` {name: path} copied in (logs, a checkpoint; a name may
    hold a subfolder). An existing `output` is replaced only with `overwrite=True`; nothing appears at `output`
    until the folder is complete.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        raise ValueError(f"output folder {output} exists; pass --overwrite to replace it")
    if getattr(model, "pose_extension", None) is None:
        raise ValueError("model was not extended with pose_mlx.extend; nothing to export")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(output, "export")
    tmp.mkdir()
    try:
        new_config, exact = export_config(model, config)
        if save_weights is None:
            save_model(tmp, model)
        else:
            save_weights(model, tmp)
        save_config(with_stored_dtype(new_config, tmp), tmp / "config.json")
        copy_tokenizer_files(Path(tokenizer_source), tmp)
        save_extension(model, tmp, mlx_lm_exact=exact, **(record or {}))
        for name, path in (extra_files or {}).items():
            if Path(path).is_file():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, tmp / name)
        replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"mlx_lm_exact": exact, "rope_theta": new_config["rope_theta"],
            "rope_scaling": new_config.get("rope_scaling")}


def export_run(model: nn.Module, extension: Extension, plan, summary: dict,
               save_weights: Callable[[nn.Module, Path], object] | None = None) -> Path:
    """The export stage of a run (`plan` a `pose_mlx.plan.RunPlan`, `summary` the training stage's,
    `save_weights` as in `export_model`): rank 0 writes the output folder (config from `extension`, pose_mlx.json
    with the run's record, the training log and the checkpoint files `summary["checkpoint_files"]` names), removes
    the run folder, and prints one summary line. Returns the output folder."""
    settings = plan.settings
    if not plan.world.is_main:
        return plan.output
    record = {"sampler": settings.sampler, "original": plan.original, "target": plan.target,
              "window": plan.window, "chunks": settings.chunks, "content": settings.content,
              "short_share": settings.short_share, "source_model": settings.model,
              **{k: summary.get(k) for k in ("steps", "final_loss", "eval_loss", "data_fingerprint",
                                             "tokens_per_step", "training", "lr", "seed")}}
    record["steps"] = record["steps"] or 0
    logs = {"train_log.jsonl": plan.partial / "log.jsonl", "run.json": plan.partial / "run.json"}
    # a LoRA run's last checkpoint is small: kept (the training stage names its files), so that --resume --steps
    # trains the output longer
    logs.update((f"checkpoint/{Path(p).name}", Path(p)) for p in summary.get("checkpoint_files", ()))
    tokenizer_source, config = plan.model.path, plan.config
    if plan.model.is_gguf:
        tokenizer_source = plan.partial / "tokenizer"
        write_tokenizer(plan.model.path, tokenizer_source)
        # the file's precision and block types, not those of the weights written here (`with_stored_dtype`)
        config = {k: v for k, v in config.items() if k not in ("torch_dtype", "gguf_quantization")}
    info = export_model(model, config, tokenizer_source, plan.output, save_weights=save_weights, record=record,
                        extra_files=logs, overwrite=plan.overwrite or plan.resume)
    shutil.rmtree(plan.partial, ignore_errors=True)
    if not info["mlx_lm_exact"]:
        print(f"warning: mlx-lm cannot express the '{extension.schedule}' schedule exactly; load {plan.output} with "
              "pose_mlx.load(path) (plain mlx_lm.load gets the closest config)", file=sys.stderr)
    if summary:
        eval_loss = f"{summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else "none"
        peak = summary["peak_memory_gb"]
        peak = f"{peak:.2f} GB" if peak >= 1 else f"{peak * 1024:.0f} MB"
        print(f"{trained(summary)}; final loss {summary['final_loss']:.4f}, last eval loss {eval_loss}, peak memory "
              f"{peak}; wrote {plan.output}", file=sys.stderr)
    else:
        print(f"wrote {plan.output} (no training: --sampler none)", file=sys.stderr)
    return plan.output


def trained(summary: dict) -> str:
    """What this invocation trained (`pose_mlx.training.stage.fine_tune`'s summary), and after a resume the run's
    whole: "trained 4 steps (5-8), 16,384 tokens in 55 s; 8 steps, 32,768 tokens in all"."""
    run, steps = summary["steps_run"], summary["steps"]
    if run == steps:
        return f"trained {counted(steps, 'step')}, {summary['tokens']:,} tokens in {summary['seconds']:.0f} s"
    return (f"trained {counted(run, 'step')} ({steps - run + 1}-{steps}), {summary['tokens_run']:,} tokens in "
            f"{summary['seconds']:.0f} s; {counted(steps, 'step')}, {summary['tokens']:,} tokens in all")


__all__ = ["candidate_configs", "copy_tokenizer_files", "export_config", "export_model", "export_run",
           "reproduces", "rope_response", "trained", "with_stored_dtype"]
