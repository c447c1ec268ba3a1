"""Rotary-angle distributions and DPRoPE's per-dimension choice (NumPy only; `pose_mlx.rope` builds on it).

Wu et al., "Extending Context Window of Large Language Models from a Distributional Perspective"
(arXiv 2410.01490), eqs. 5-7: the angle of dimension pair i at position m is Theta^i_m = m * theta_i mod 2*pi;
[0, 2*pi) is cut into b equal intervals (eq. 5) and P^i_L(k) = #{m in [0, L): Theta^i_m in interval k} / L
(eqs. 6-7) is the rotary-angle distribution of a context of L positions.

DPRoPE keeps, per dimension, the candidate frequency (extrapolation theta_i or interpolation theta_i / s) whose
angle distribution over the target length disturbs the pre-trained one least, measured as the authors' code
does: KL(P_pre || P_candidate) = sum_k P_pre(k) log(P_pre(k) / P_candidate(k)), every bin's count starting
from a tiny floor (`FLOOR`) so that no probability is 0; exact ties go to extrapolation.
"""

from __future__ import annotations

import numpy as np

#: The count every bin starts from (float16's smallest normal number, as in the authors' code): an empty bin of
#: a distribution over L positions has probability FLOOR / L instead of 0, so the KL divergence stays finite.
FLOOR = 2.0 ** -14


def _slow_counts(delta: float, length: int, bins: int) -> np.ndarray:
    """Exact counts for a pair advancing delta < 1 bins per position: positions m with j <= m*delta < j + 1 are
    m in [ceil(j/delta), ceil((j+1)/delta)), so count per unit interval j and fold j mod bins (O(L*delta) work)."""
    if delta == 0.0:
        out = np.zeros(bins)
        out[0] = length
        return out
    steps = int(np.ceil(length * delta))
    firsts = np.minimum(np.ceil(np.arange(steps + 1, dtype=np.float64) / delta), length)
    return np.bincount(np.arange(steps) % bins, weights=np.diff(firsts), minlength=bins)


def _fast_counts(delta: float, length: int, bins: int) -> np.ndarray:
    """Counts of floor(m * delta) mod bins for m in [0, length), by blocks m = q*B + r. With z_r = r*delta mod bins
    = n_r + g_r (integer + fraction) and block shift a_q = q*B*delta mod bins = c_q + f_q, position m lands in
    bin (n_r + c_q + [g_r >= 1 - f_q]) mod bins. One 2-D bincount over (rank of g_r among the thresholds 1 - f_q,
    n_r) and a cumulative sum give every block's histogram: O(B log Q + Q * bins) work instead of O(length).
    Equal to direct binning except for angles within float rounding of a bin edge."""
    block = int(min(length, max(1, np.sqrt(length * bins))))
    z = np.mod(np.arange(block, dtype=np.float64) * delta, bins)
    n = np.minimum(np.floor(z).astype(np.int64), bins - 1)
    g = z - n
    starts = np.arange(0, length - length % block, block, dtype=np.float64)  # full blocks
    out = np.zeros(bins)
    if starts.size:
        shift = np.mod(starts * delta, bins)
        whole = np.floor(shift).astype(np.int64)
        threshold = 1.0 - (shift - whole)  # r moves one bin up iff g_r >= threshold
        order = np.argsort(threshold)
        rank = np.searchsorted(threshold[order], g, side="right")  # thresholds <= g_r
        grid = np.bincount(rank * bins + n, minlength=(starts.size + 1) * bins).reshape(starts.size + 1, bins)
        stay_sorted = np.cumsum(grid, axis=0)[:-1]  # row i: #{r in bin n with g_r < i-th smallest threshold}
        stay = np.empty_like(stay_sorted)
        stay[order] = stay_sorted
        move = np.bincount(n, minlength=bins)[None, :] - stay
        per_block = stay + np.roll(move, 1, axis=1)
        rows = np.arange(bins)[None, :] - whole[:, None]  # roll each block's histogram by its whole shift
        out += per_block[np.arange(starts.size)[:, None], rows % bins].sum(axis=0)
    rest = length % block
    if rest:
        m = np.arange(length - rest, length, dtype=np.float64)
        out += np.bincount(np.floor(m * delta).astype(np.int64) % bins, minlength=bins)
    return out


def angle_histograms(inv_freq, length: int, bins: int = 360) -> np.ndarray:
    """P^i_L of eq. (7): float64 (d/2, bins), row i = fraction of positions m in [0, length) whose angle
    m * inv_freq[i] mod 2*pi falls in [2*pi*k/bins, 2*pi*(k+1)/bins). Rows sum to 1.

    With delta_i = inv_freq[i] * bins / (2*pi) the bin is floor(m * delta_i) mod bins. No angle array of size
    length is built: pairs crossing few bin edges (delta_i < 1, length*delta_i <= sqrt(length*bins)) are counted per
    edge crossing (``_slow_counts``), the others block-wise (``_fast_counts``)."""
    inv_freq = np.asarray(inv_freq, dtype=np.float64)
    if inv_freq.ndim != 1 or inv_freq.size == 0 or not np.all(np.isfinite(inv_freq)) or np.any(inv_freq < 0):
        raise ValueError(f"inv_freq must be a non-empty 1-D finite non-negative array, got {inv_freq!r:.80}")
    if int(length) != length or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    if int(bins) != bins or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    length, bins = int(length), int(bins)
    delta = inv_freq * (bins / (2.0 * np.pi))
    counts = np.zeros((inv_freq.size, bins))
    crossings = np.sqrt(length * bins)  # the cheaper method: O(length * delta) vs O(sqrt(length * bins) log)
    for i, step in enumerate(delta):
        slow = step < 1.0 and length * step <= crossings
        counts[i] = (_slow_counts if slow else _fast_counts)(float(step), length, bins)
    return counts / float(length)


def kl_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Row-wise KL(p || q) = sum_k p_k log(p_k / q_k) of distributions with no zero entry (see `floored`)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if np.any(p <= 0) or np.any(q <= 0):
        raise ValueError("kl_divergence needs strictly positive distributions; floor them first (`floored`)")
    return np.sum(p * np.log(p / q), axis=-1)


def floored(histograms: np.ndarray, length: int) -> np.ndarray:
    """Histograms of fractions (rows sum to 1 over `length` positions) with every bin's count raised by `FLOOR`."""
    return np.asarray(histograms, dtype=np.float64) + FLOOR / float(length)


def disturbances(candidates: dict[str, np.ndarray], inv_freq, original_length: int, target_length: int,
                 bins: int = 360) -> dict[str, np.ndarray]:
    """Per candidate (name -> its inverse frequencies, shape (d/2,)), the per-dimension disturbance
    KL(P_pre || P_candidate): P_pre over `original_length` positions at `inv_freq`, P_candidate over
    `target_length` positions at the candidate's frequencies. Candidates may be any schedule's frequencies."""
    if int(original_length) != original_length or original_length < 1:
        raise ValueError(f"original_length must be a positive integer, got {original_length!r}")
    if int(target_length) != target_length or target_length < original_length:
        raise ValueError(f"target_length must be an integer >= original_length, got {target_length!r}")
    pre = floored(angle_histograms(inv_freq, original_length, bins), original_length)
    return {name: kl_divergence(pre, floored(angle_histograms(f, target_length, bins), target_length))
            for name, f in candidates.items()}


def dprope_factors(inv_freq, original_length: int, target_length: int, bins: int = 360) -> np.ndarray:
    """DPRoPE's per-dimension factors, float64 (d/2,): 1.0 where extrapolation (theta_i) disturbs the pre-trained
    angle distribution no more than interpolation (theta_i / s) - exact ties included -, else
    s = target_length / original_length. The scheduled frequencies are inv_freq / factors."""
    theta = np.asarray(inv_freq, dtype=np.float64)
    s = target_length / original_length
    kl = disturbances({"extrapolation": theta, "interpolation": theta / s}, theta, original_length, target_length,
                      bins)
    return np.where(kl["extrapolation"] <= kl["interpolation"], 1.0, s)
