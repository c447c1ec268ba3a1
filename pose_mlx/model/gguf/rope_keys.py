"""The RoPE of a model as llama.cpp reads it from GGUF keys, and the keys that make llama.cpp rebuild a schedule
(NumPy only).

llama.cpp rotates pair i at position p by the angle p * theta_i with (ggml's ``rope_yarn``, llama.cpp's context
set-up; s = ``rope.scaling.factor``, b = ``rope.freq_base``, d the rotary dims, ff_i the ``rope_freqs`` tensor or 1):

- extrapolated theta_e = b^(-2i/d) / ff_i, interpolated theta_p = theta_e / s (linear and yarn; none: s = 1);
- yarn: theta_i = theta_p (1 - r_i) + theta_e r_i with the ramp r_i = 1 - clip((i - lo) / max(hi - lo, 0.001), 0, 1),
  lo = floor(c(32)), hi = ceil(c(1)) clipped to [0, d - 1], c(beta) = d ln(L / (2 pi beta)) / (2 ln b), L =
  ``rope.scaling.original_context_length`` (else ``context_length``). The betas 32 and 1 are fixed: llama.cpp reads
  ``rope.scaling.yarn_beta_fast/slow`` only for a few architectures (grok, mistral3), not llama or qwen2;
- cos and sin are multiplied by m = ``rope.scaling.attn_factor`` (default 1), times 1 + 0.1 ln s for yarn (the
  context cancels llama.cpp's own 0.1 ln s + 1 and the kernel applies it again), so q and k are both scaled by m:
  the attention factor of `pose_mlx.rope`.

That is the Hugging Face / mlx-lm YaRN (inverse-frequency blend) with the default betas; `rope_keys` turns a
schedule into these keys or says in one line why llama.cpp cannot run it, and `llamacpp_rope` recomputes what
llama.cpp will do with them, so that the exporter can check the file against the model before writing it.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import UserError
from ...rope import SCHEDULE_NAMES

#: YaRN's betas in llama.cpp for the llama and qwen2 architectures (not read from the file).
LLAMACPP_BETAS = (32.0, 1.0)
#: Schedules llama.cpp has no counterpart for, and why (the refusal's reason).
INEXPRESSIBLE = {
    "dynamic": "its RoPE base changes with the length of the sequence read, while llama.cpp fixes its frequencies "
               "when the file is loaded (export a static schedule instead: ntk, yarn or linear)",
    "dprope": "its per-dimension factors could reach llama.cpp only as a rope_freqs tensor, which GGUF readers "
              "(llama.cpp's converter, pose_mlx's reader) take for Llama 3's schedule; only llama3 is written so",
    "longrope": "llama.cpp's longrope is Phi-3's (two factor tables switched by length), not this static one, and "
                "its per-dimension factors could reach llama.cpp's llama only as a Llama 3 rope_freqs tensor",
}


def rope_keys(schedule: str, params: dict, factor: float, original: int, attention_factor: float,
              factors: list | None = None, arch: str = "llama") -> tuple[dict, np.ndarray | None]:
    """({key suffix: value} of the ``<arch>.rope.*`` scaling keys, the rope_freqs tensor or None) that make
    llama.cpp rotate as `schedule` does (its `params`, factor s, original window, attention factor and per-pair
    factors theta_i / inv_freq_i); UserError saying why when llama.cpp cannot. The base (``rope.freq_base``) and
    context length are the caller's: none/ntk/abf change only the base."""
    name = f"--schedule {schedule} ({SCHEDULE_NAMES.get(schedule, schedule)})"
    if schedule in INEXPRESSIBLE:
        raise UserError(f"{name} cannot be written to GGUF: {INEXPRESSIBLE[schedule]}")
    if schedule in ("none", "ntk", "abf"):
        return {}, None
    if schedule == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(factor)}, None
    if schedule == "llama3":
        if arch != "llama":
            raise UserError(f"{name} cannot be written to GGUF for {arch}: llama.cpp applies the rope_freqs tensor "
                            "that carries Llama 3's factors only to the llama architecture")
        return {}, np.asarray(factors, dtype=np.float32)
    if schedule == "yarn":
        _check_yarn(name, params)
        keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor),
                "rope.scaling.original_context_length": int(original)}
        if factor > 1:
            m = attention_factor / (1 + 0.1 * math.log(factor))
            if abs(m - 1) > 1e-7:
                keys["rope.scaling.attn_factor"] = float(m)
        return keys, None
    raise UserError(f"{name} cannot be written to GGUF: llama.cpp has no counterpart for it")


def _check_yarn(name: str, params: dict) -> None:
    """UserError when YaRN's parameters ask for what llama.cpp's YaRN does not do."""
    if params.get("blend", "inv_freq") != "inv_freq":
        raise UserError(f"{name} with blend={params['blend']} cannot be written to GGUF: llama.cpp's YaRN blends "
                        "inverse frequencies (blend=inv_freq), not wavelengths")
    betas = (float(params.get("beta_fast", 32.0)), float(params.get("beta_slow", 1.0)))
    if betas != LLAMACPP_BETAS:
        raise UserError(f"{name} with beta_fast={betas[0]:g}, beta_slow={betas[1]:g} cannot be written to GGUF: "
                        "llama.cpp's llama and qwen2 read no YaRN beta from the file and always use 32 and 1")
    if not params.get("truncate", True):
        raise UserError(f"{name} with truncate=False cannot be written to GGUF: llama.cpp always rounds YaRN's "
                        "correction range to whole dimensions")


def llamacpp_rope(metadata: dict, arch: str, dims: int, rope_freqs: np.ndarray | None = None
                  ) -> tuple[np.ndarray, float]:
    """(theta_i per pair, the scale m of q and k) that llama.cpp computes from a file's metadata (see the module
    docstring; float64, so that a comparison with a model shows the keys' error, not llama.cpp's float32)."""

    def key(suffix, default=None):
        return metadata.get(f"{arch}.{suffix}", default)

    base = float(key("rope.freq_base", 10000.0))
    kind = key("rope.scaling.type", "linear")
    factor = float(key("rope.scaling.factor", 0.0) or 1.0)
    scale = 1.0 if kind == "none" else 1.0 / factor
    extrapolated = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    if rope_freqs is not None:
        extrapolated = extrapolated / np.asarray(rope_freqs, dtype=np.float64)
    theta = extrapolated * scale
    m = float(key("rope.scaling.attn_factor", 1.0))
    if kind == "yarn":
        original = int(key("rope.scaling.original_context_length", 0) or key("context_length"))
        lo, hi = (_correction_dim(beta, dims, base, original) for beta in LLAMACPP_BETAS)
        lo, hi = max(0.0, math.floor(lo)), min(dims - 1.0, math.ceil(hi))
        ramp = 1 - np.clip((np.arange(dims // 2) - lo) / max(0.001, hi - lo), 0, 1)
        theta = theta * (1 - ramp) + extrapolated * ramp
        m *= 1 + 0.1 * math.log(1 / scale)
    return theta, m


def _correction_dim(beta: float, dims: int, base: float, original: int) -> float:
    return dims * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(base))


__all__ = ["INEXPRESSIBLE", "LLAMACPP_BETAS", "llamacpp_rope", "rope_keys"]
