"""Embedding granularity of PI vs ABF (Xiong et al., "Effective Long-Context Scaling of Foundation Models",
arXiv 2309.16039, Appendix B, Theorem 1).

C_d = (2/d) * sum_{j<d/2} sin(omega_j) with omega_j = alpha * b^(-2j/d) (PI) or (beta*b)^(-2j/d) (ABF):
the MEAN over the d/2 frequency pairs. The paper's numbers (alpha(log b)^-1 ~ 0.027 for alpha = 1/4, b = 1e4;
(log b + log beta)^-1 ~ 0.076 for beta = 50) are the d -> infinity limits of this mean; the paper's raw sum is
d/2 times larger and grows with d. For the sine similarity S(x) = sum_j (x_2j^2 + x_2j+1^2) sin(omega_j) / ||x||^2
each pair weight lies in [2 min_k x_k^2, 2 max_k x_k^2], so the bounds that hold are
    d min_k x_k^2 / ||x||^2 * C_d <= S(x) <= d max_k x_k^2 / ||x||^2 * C_d   (C_d the mean above).
The paper's statement (its raw sum, without this factor 2) drops the 2 from pair weights: its upper bound fails for
some x (see tests/test_analysis_granularity.py).
"""

from __future__ import annotations

import numpy as np

from ..rope import rope_inv_freq


def _frequencies(head_dim: int, base: float, alpha, beta) -> np.ndarray:
    """omega_j: alpha * theta_j (PI) or the frequencies of base beta * b (ABF)."""
    if (alpha is None) == (beta is None):
        raise ValueError("give exactly one of alpha (PI) or beta (ABF)")
    if alpha is not None:
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        return alpha * rope_inv_freq(head_dim, base)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    return rope_inv_freq(head_dim, float(beta) * base)


def granularity_constant(head_dim: int, base: float, alpha: float | None = None, beta: float | None = None) -> float:
    """C_d of Theorem 1 normalised as the mean over the d/2 pairs: (2/d) sum_j sin(omega_j)."""
    return float(np.mean(np.sin(_frequencies(head_dim, base, alpha, beta))))


def granularity_limit(base: float, alpha: float | None = None, beta: float | None = None) -> float:
    """The theorem's d -> infinity approximation: alpha / ln b (PI) or 1 / (ln b + ln beta) (ABF)."""
    if (alpha is None) == (beta is None):
        raise ValueError("give exactly one of alpha (PI) or beta (ABF)")
    return alpha / np.log(base) if alpha is not None else 1.0 / (np.log(base) + np.log(beta))


def limit_bounds(base: float, alpha: float | None = None, beta: float | None = None) -> tuple[float, float]:
    """Lower and upper bounds on lim C_d from the proof's last display (page 21)."""
    if alpha is not None and beta is None:
        b = float(base)
        lead = alpha / np.log(b)
        return lead * ((b - 1) / b - alpha / np.pi * (b * b - 1) / (b * b)), lead * (b - 1) / b
    if beta is not None and alpha is None:
        c = float(base) * beta
        lead = 1.0 / np.log(c)
        return lead * ((c - 1) / c - (c * c - 1) / (np.pi * c * c)), lead * (c - 1) / c
    raise ValueError("give exactly one of alpha (PI) or beta (ABF)")


def sine_similarity(x, head_dim: int, base: float, alpha: float | None = None, beta: float | None = None) -> float:
    """sin angle(f(x, n+1), f(x, n)) = sum_j (x_2j^2 + x_2j+1^2) sin(omega_j) / ||x||^2 (proof, page 20)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape != (head_dim,):
        raise ValueError(f"x must have shape ({head_dim},), got {x.shape}")
    pair = x[0::2] ** 2 + x[1::2] ** 2
    return float(pair @ np.sin(_frequencies(head_dim, base, alpha, beta)) / (x @ x))


def theorem1_bounds(x, head_dim: int, base: float, alpha: float | None = None,
                    beta: float | None = None) -> tuple[float, float]:
    """Theorem 1's (lower, upper) for this x, corrected for pair weights: d * min|max x_k^2 / ||x||^2 * C_d
    (= 2 * the paper's raw-sum bounds; see the module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    raw = head_dim * granularity_constant(head_dim, base, alpha, beta)
    norm = x @ x
    return float(np.min(x ** 2) / norm * raw), float(np.max(x ** 2) / norm * raw)


def helix(t, a: float) -> np.ndarray:
    """Figure 8's helix (cos t, sin t, sin a t), shape (len(t), 3)."""
    t = np.asarray(t, dtype=np.float64)
    return np.stack([np.cos(t), np.sin(t), np.sin(a * t)], axis=-1)
