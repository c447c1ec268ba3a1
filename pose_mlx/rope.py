"""Frequency schedules for context-window extension of RoPE (NumPy only; never imports mlx).

RoPE rotates the dimension pair i of a query/key at position m by the angle m * theta_i with
theta_i = base ** (-2i / d), i = 0 .. d/2 - 1 (d = number of rotary dims; `rope_inv_freq`, the one place this
formula is written). A schedule maps the pre-training frequencies theta to new inverse frequencies for an
extension by s = factor = target / original (the two context lengths), plus an attention factor that
multiplies BOTH q and k (so attention logits are scaled by its square).

`scaled_inv_freq(schedule, ...)` dispatches to the function registered under `schedule` in `SCHEDULES`;
each function's keyword-only arguments are that schedule's parameters.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import numpy as np

from .angles import dprope_factors

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "dynamic_ntk_base", "rope_inv_freq", "scaled_inv_freq", "schedule_parameters"]

Schedule = Callable[..., "tuple[np.ndarray, float]"]


def rope_inv_freq(head_dim: int, base: float) -> np.ndarray:
    """Unscaled RoPE inverse frequencies theta_i = base ** (-2i/d), float64, shape (d/2,)."""
    if isinstance(head_dim, bool) or int(head_dim) != head_dim or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even integer >= 2, got {head_dim!r}")
    if not (math.isfinite(base) and base > 1):
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    return float(base) ** (-np.arange(0, int(head_dim), 2, dtype=np.float64) / int(head_dim))


def _ntk_exponent(head_dim: int) -> float:
    if head_dim <= 2:
        raise ValueError(f"head_dim must be > 2 for NTK scaling (exponent d/(d-2)), got {head_dim}")
    return head_dim / (head_dim - 2)


def dynamic_ntk_base(base: float, head_dim: int, factor: float, original: int, seq_len: int) -> float:
    """Base used by dynamic NTK for a sequence of `seq_len` tokens (Hugging Face's dynamic NTK rule).

    base' = base * (s * seq_len / L - (s - 1)) ** (d / (d - 2)) when seq_len > L = `original`, else base.
    """
    if seq_len <= original:
        return float(base)
    ratio = factor * seq_len / original - (factor - 1.0)
    return float(base) * ratio ** _ntk_exponent(head_dim)


def _none(head_dim, base, factor, original_length):
    """Extrapolation: RoPE of the paper's eq. (1) unchanged, theta_i' = theta_i; attention factor 1."""
    return rope_inv_freq(head_dim, base), 1.0


def _linear(head_dim, base, factor, original_length):
    """Position Interpolation (Chen et al., "Extending Context Window of Large Language Models via Positional
    Interpolation", arXiv 2306.15595: attention score a~(m) = a(m L / L'); PoSE paper sec. 2):
    position m -> m / s, i.e. theta_i' = theta_i / s."""
    return rope_inv_freq(head_dim, base) / factor, 1.0


def _ntk(head_dim, base, factor, original_length):
    """NTK-aware scaling (PoSE paper sec. 2, Peng & Quesnelle 2023): base' = base * lambda with
    lambda = s ** (d / (d - 2)), so the lowest frequency is exactly interpolated by s."""
    return rope_inv_freq(head_dim, base * factor ** _ntk_exponent(head_dim)), 1.0


def _dynamic(head_dim, base, factor, original_length):
    """Dynamic NTK (Hugging Face dynamic rule, see `dynamic_ntk_base`). At inference the RoPE module
    recomputes the base from the sequence length; as static frequencies (training with explicit
    positions) this returns the NTK frequencies at the full factor, base * s ** (d/(d-2))."""
    return _ntk(head_dim, base, factor, original_length)


def _yarn_correction_dim(num_rotations: float, head_dim: int, base: float, original_length: int) -> float:
    """Dimension index whose wavelength fits `num_rotations` times into L (YaRN eq. for r(d) = L / lambda_d):
    d * ln(L / (2 pi num_rotations)) / (2 ln base)."""
    return head_dim * math.log(original_length / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(head_dim, base, factor, original_length, *, beta_fast: float = 32.0, beta_slow: float = 1.0,
          truncate: bool = True, blend: str = "inv_freq", mscale: float = 1.0,
          attention_factor: float | None = None):
    """YaRN (Peng et al. 2023, "NTK-by-parts" ramp + temperature), in the Hugging Face / mlx-lm form.

    Correction dims low = dim(beta_fast), high = dim(beta_slow) (floor/ceil when truncate, clipped to
    [0, d-1], high += 0.001 when equal); gamma_i = 1 - clip((i - low) / (high - low), 0, 1) is 1 for
    high-frequency dims (extrapolate) and 0 for low-frequency dims (interpolate).
    blend="inv_freq": theta' = (1 - gamma) theta / s + gamma theta (YaRN / HF / mlx-lm);
    blend="wavelength": theta' = theta / ((1 - gamma) s + gamma) (the PoSE reference code).
    Attention factor sqrt(1/t) = 0.1 * mscale * ln(s) + 1 (1 when s == 1), unless `attention_factor` is given.
    """
    if not beta_fast > beta_slow > 0:
        raise ValueError(f"beta_fast must be > beta_slow > 0, got beta_fast={beta_fast}, beta_slow={beta_slow}")
    if blend not in ("inv_freq", "wavelength"):
        raise ValueError(f"blend must be 'inv_freq' or 'wavelength', got {blend!r}")
    low = _yarn_correction_dim(beta_fast, head_dim, base, original_length)
    high = _yarn_correction_dim(beta_slow, head_dim, base, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    gamma = 1.0 - ramp
    theta = rope_inv_freq(head_dim, base)
    if blend == "inv_freq":
        inv_freq = (1.0 - gamma) * theta / factor + gamma * theta
    else:
        inv_freq = theta / ((1.0 - gamma) * factor + gamma)
    if attention_factor is None:
        attention_factor = 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(attention_factor)


def _abf(head_dim, base, factor, original_length, *, beta: float | None = None):
    """Adjusted base frequency (Xiong et al., "Effective Long-Context Scaling of Foundation Models",
    arXiv 2309.16039: f^{RoPE+ABF}, theta_j = (beta b)^(-2j/d)): base' = base * beta.

    beta defaults to 50 (the value that paper trains with) for an extension (s > 1); with s == 1 and no
    explicit beta the base is left unchanged (no extension requested)."""
    if beta is None:
        beta = 50.0 if factor > 1 else 1.0
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    return rope_inv_freq(head_dim, base * beta), 1.0


def _llama3(head_dim, base, factor, original_length, *, low_freq_factor: float = 1.0,
            high_freq_factor: float = 4.0):
    """Llama 3.1 scaling (Meta's `apply_scaling`, as in mlx-lm's Llama3RoPE) with wavelength w_i = 2 pi / theta_i:
    w_i > L / low_freq_factor -> theta_i / s; w_i < L / high_freq_factor -> theta_i; in between
    theta_i * ((1 - g) / s + g) with g = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    if not high_freq_factor > low_freq_factor > 0:
        raise ValueError(f"high_freq_factor must be > low_freq_factor > 0, got high_freq_factor={high_freq_factor}, "
                         f"low_freq_factor={low_freq_factor}")
    theta = rope_inv_freq(head_dim, base)
    wavelength = 2 * math.pi / theta
    low_wavelength = original_length / low_freq_factor
    high_wavelength = original_length / high_freq_factor
    g = (original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = theta * ((1.0 - g) / factor + g)
    inv_freq = np.where(wavelength > low_wavelength, theta / factor, theta)
    medium = (wavelength > high_wavelength) & (wavelength < low_wavelength)
    return np.where(medium, smooth, inv_freq), 1.0


def _longrope(head_dim, base, factor, original_length, *, long_factor=None, attention_factor: float | None = None):
    """LongRoPE / Phi-3 "su" scaling: per-dimension rescale factors lambda_i, theta_i' = theta_i / lambda_i
    (lambda_i = s for all i by default). Attention factor sqrt(1 + ln s / ln L) (1 when s == 1), as in
    mlx-lm's SuScaledRoPE, unless `attention_factor` is given."""
    n = head_dim // 2
    lam = np.full(n, float(factor)) if long_factor is None else np.asarray(long_factor, dtype=np.float64)
    if lam.shape != (n,) or not np.all(np.isfinite(lam)) or not np.all(lam > 0):
        raise ValueError(f"long_factor must hold {n} positive finite numbers (head_dim // 2), got shape {lam.shape}")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_length)) if factor > 1 else 1.0
    return rope_inv_freq(head_dim, base) / lam, float(attention_factor)


def _dprope(head_dim, base, factor, original_length, *, bins: int = 360):
    """DPRoPE (Wu et al., "Extending Context Window of Large Language Models from a Distributional Perspective",
    arXiv 2410.01490): per dimension, interpolate (theta_i / s) or extrapolate (theta_i), whichever angle
    distribution over round(s * L) positions diverges less from the pre-trained one, KL(P_pre || P_candidate)
    over `bins` bins (`pose_mlx.angles.dprope_factors`; ties extrapolate)."""
    theta = rope_inv_freq(head_dim, base)
    return theta / dprope_factors(theta, original_length, int(round(factor * original_length)), bins), 1.0


SCHEDULES: dict[str, Schedule] = {
    "none": _none,
    "linear": _linear,
    "ntk": _ntk,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "abf": _abf,
    "llama3": _llama3,
    "longrope": _longrope,
    "dprope": _dprope,
}

#: How the docs and messages name each schedule ("PoSE + YaRN", "training-free dynamic NTK").
SCHEDULE_NAMES = {"yarn": "YaRN", "linear": "PI", "ntk": "NTK", "dynamic": "dynamic NTK", "abf": "ABF",
                  "llama3": "Llama 3", "longrope": "LongRoPE", "dprope": "DPRoPE"}


def schedule_parameters(schedule: str) -> dict:
    """{name: default} of a registered schedule's keyword parameters (what `--schedule-param` accepts)."""
    fn = SCHEDULES[schedule]
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


def _check_args(head_dim, base, factor, original_length) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even integer >= 2, got {head_dim!r}")
    if not (math.isfinite(base) and base > 1):
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"factor must be a finite number >= 1, got {factor!r}")
    if isinstance(original_length, bool) or not isinstance(original_length, (int, np.integer)) or original_length < 2:
        raise ValueError(f"original_length must be an integer >= 2, got {original_length!r}")


def scaled_inv_freq(schedule: str, head_dim: int, base: float, factor: float, original_length: int,
                    **params) -> tuple[np.ndarray, float]:
    """Inverse frequencies (float64, shape (head_dim // 2,)) and attention factor (multiplies q and k) of a schedule.

    head_dim: number of rotary dims d; base: RoPE base b; factor: s = target / original length (>= 1);
    original_length: pre-training context L; params: the schedule's keyword parameters (see SCHEDULES).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    _check_args(head_dim, base, factor, original_length)
    fn = SCHEDULES[schedule]
    allowed = schedule_parameters(schedule)
    for name in params:
        if name not in allowed:
            raise ValueError(f"unknown parameter {name!r} for schedule {schedule!r} (allowed: "
                             f"{', '.join(allowed) or 'none'})")
    inv_freq, attention_factor = fn(int(head_dim), float(base), float(factor), int(original_length), **params)
    return np.asarray(inv_freq, dtype=np.float64), float(attention_factor)
