"""Interpolation vs extrapolation bounds of Position Interpolation (Chen et al., "Extending Context Window of
Large Language Models via Positional Interpolation", arXiv 2306.15595, Theorem 2.1, eqs. 5-8).

a(s) = Re sum_{j<d/2} h_j exp(i s theta_j), theta_j = c^(-2j/d).
Interpolation (eq. 5): |a(s) - a_linear(s)| <= d max|h_j| (s - s1)(s2 - s) / (8 ln c).
Extrapolation (eq. 8): |a(s)| <= 2 max|h_j| B(s), B(s) = sum_{k=0}^{d/2-1} |A_{k+1}(s)|, A_k(s) = sum_{j<k} e^{i s theta_j}.
"""

from __future__ import annotations

import numpy as np

from ..rope import rope_inv_freq as _theta


def interpolation_bound(s, head_dim: int = 4096, base: float = 1e4, s1: float | None = None,
                        s2: float | None = None, h_max: float = 1.0) -> np.ndarray:
    """Eq. (5) at each s; s1, s2 default to floor(s), floor(s) + 1 (integer grid, so the product <= 1/4)."""
    _theta(head_dim, base)
    s = np.asarray(s, dtype=np.float64)
    lo = np.floor(s) if s1 is None else np.asarray(s1, dtype=np.float64)
    hi = lo + 1.0 if s2 is None else np.asarray(s2, dtype=np.float64)
    if np.any(s < lo) or np.any(s > hi):
        raise ValueError("s must lie in [s1, s2]")
    return head_dim * h_max * (s - lo) * (hi - s) / (8.0 * np.log(base))


def interpolation_denominator(base: float = 1e4) -> float:
    """Eq. (7)'s 32 ln c (294.73 for c = 1e4)."""
    return 32.0 * float(np.log(base))


def extrapolation_sum(s, head_dim: int = 128, base: float = 1e4) -> np.ndarray:
    """B(s) of eq. (8) at each s (any shape); |a(s)| <= 2 max|h_j| B(s)."""
    theta = _theta(head_dim, base)
    s = np.asarray(s, dtype=np.float64)
    phases = np.exp(1j * s[..., None] * theta)
    return np.abs(np.cumsum(phases, axis=-1)).sum(axis=-1)


def attention_score(s, h, base: float = 1e4) -> np.ndarray:
    """a(s) = Re sum_j h_j exp(i s theta_j) with d = 2 len(h)."""
    h = np.asarray(h)
    theta = _theta(2 * len(h), base)
    return np.real(np.exp(1j * np.asarray(s, dtype=np.float64)[..., None] * theta) @ h)
