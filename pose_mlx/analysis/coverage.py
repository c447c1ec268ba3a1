"""Coverage probability of relative distances by one training example (PoSE paper, Appendix B, Figure 5).

A distance r is *covered* by an example when two of its position ids differ by exactly r. For PoSE, chunk i holds
positions u_i + st_i .. u_i + st_i + l_i - 1, so the differences inside chunk i fill [0, l_i - 1] and those between
chunks i < j fill the interval [u_j - u_i + st_j - st_i - l_i + 1, u_j - u_i + st_j + l_j - 1 - st_i]: coverage is a
union of intervals. Samplers follow pose_mlx.training.positions (Figure 6's sequential chunk lengths, u_i ~ U{u_{i-1}..Lt-Lc}).
Every returned array has length ``target`` and is indexed by distance; index 0 (distance 0) is always 1.
"""

from __future__ import annotations

import math

import numpy as np

EXACT_SAMPLERS = ("pose", "pose-ref", "contiguous", "full")
MC_METHODS = ("pose", "pose-ref", "randpos")
MAX_LAYOUTS = 2_000_000


def _check(window: int, target: int, chunks: int) -> None:
    if int(window) != window or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    if int(target) != target or target < window:
        raise ValueError(f"target must be an integer >= window ({window}), got {target!r}")
    if int(chunks) != chunks or not 1 <= chunks <= window:
        raise ValueError(f"chunks must be an integer in [1, window], got {chunks!r}")


def _contiguous(length: int, target: int) -> np.ndarray:
    out = np.zeros(target)
    out[:length] = 1.0
    return out


def _two_chunk(window: int, target: int, first_max: int) -> np.ndarray:
    """N = 2, l_0 ~ U{1..first_max}, u_1 ~ U{0..R}: r >= 1 is covered iff r <= max(l_0, l_1) - 1 or
    u_1 + 1 <= r <= u_1 + Lc - 1; l_0 and u_1 are independent, so q(r) = P(M > r) + P(M <= r) P_u(r)."""
    room = target - window
    first = np.arange(1, first_max + 1)
    longest = np.maximum(first, window - first)  # M = max(l_0, l_1), each value with prob 1/first_max
    r = np.arange(target)
    p_m_gt = (longest[None, :] > r[:, None]).mean(axis=1)
    lo = np.maximum(0, r - window + 1)
    hi = np.minimum(room, r - 1)
    p_u = np.clip(hi - lo + 1, 0, None) / (room + 1)
    out = p_m_gt + (1.0 - p_m_gt) * p_u
    out[0] = 1.0
    return out


def _length_layouts(window: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """All chunk-length vectors of the sequential draw with their probabilities: (K, chunks), (K,)."""
    rows, probs = [np.zeros((1, 0), dtype=np.int64)], np.ones(1)
    layouts = rows[0]
    for i in range(chunks - 1):
        rest = window - layouts.sum(axis=1)
        high = rest - (chunks - 1 - i)
        new_rows, new_probs = [], []
        for row, p, h in zip(layouts, probs, high):
            vals = np.arange(1, h + 1)
            new_rows.append(np.column_stack([np.repeat(row[None], len(vals), 0), vals]))
            new_probs.append(np.full(len(vals), p / h))
        layouts, probs = np.concatenate(new_rows), np.concatenate(new_probs)
    last = window - layouts.sum(axis=1)
    return np.column_stack([layouts, last]), probs


def _bias_layouts(chunks: int, room: int) -> tuple[np.ndarray, np.ndarray]:
    """All skip-bias vectors u_0 = 0 <= u_1 <= ... <= room with their probabilities (sequential uniform draws)."""
    layouts, probs = np.zeros((1, 1), dtype=np.int64), np.ones(1)
    for _ in range(chunks - 1):
        prev = layouts[:, -1]
        counts = room - prev + 1
        idx = np.repeat(np.arange(len(prev)), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        layouts = np.column_stack([layouts[idx], prev[idx] + offsets])
        probs = probs[idx] / counts[idx]
    return layouts, probs


def _interval_ends(lengths: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Covered-distance intervals [lo, hi] of each layout row: (rows, n_intervals) each."""
    starts = np.cumsum(lengths, axis=1) - lengths
    los, his = [np.zeros_like(lengths)], [lengths - 1]
    n = lengths.shape[1]
    for i in range(n):
        for j in range(i + 1, n):
            base = biases[:, j] - biases[:, i] + starts[:, j] - starts[:, i]
            los.append((base - lengths[:, i] + 1)[:, None])
            his.append((base + lengths[:, j] - 1)[:, None])
    return np.concatenate(los, axis=1), np.concatenate(his, axis=1)


def _union_indicator(lo: np.ndarray, hi: np.ndarray, target: int, weights: np.ndarray | None = None) -> np.ndarray:
    """Per row, the 0/1 indicator over [0, target) of the union of intervals; summed with ``weights`` if given."""
    rows = lo.shape[0]
    diff = np.zeros((rows, target + 1), dtype=np.int32)
    row_idx = np.repeat(np.arange(rows), lo.shape[1])
    np.add.at(diff, (row_idx, np.clip(lo, 0, target).ravel()), 1)
    np.add.at(diff, (row_idx, np.clip(hi + 1, 0, target).ravel()), -1)
    covered = np.cumsum(diff[:, :target], axis=1) > 0
    return covered if weights is None else weights @ covered


def _enumerate_exact(window: int, target: int, chunks: int) -> np.ndarray:
    """Exact coverage for any N by summing over every (lengths, biases) layout with its probability."""
    # compositions of Lc into N parts times non-decreasing (u_1..u_{N-1}) in [0, R]
    total = math.comb(window - 1, chunks - 1) * math.comb(target - window + chunks - 1, chunks - 1)
    if total > MAX_LAYOUTS:
        raise ValueError(
            f"exact coverage for chunks={chunks} needs {total} layouts (> {MAX_LAYOUTS}); "
            "use coverage_monte_carlo for this (window, target, chunks)"
        )
    lengths, p_len = _length_layouts(window, chunks)
    biases, p_bias = _bias_layouts(chunks, target - window)
    li = np.repeat(np.arange(len(lengths)), len(biases))
    bi = np.tile(np.arange(len(biases)), len(lengths))
    out = np.zeros(target)
    for s in range(0, total, 20_000):
        sl = slice(s, s + 20_000)
        lo, hi = _interval_ends(lengths[li[sl]], biases[bi[sl]])
        out += _union_indicator(lo, hi, target, p_len[li[sl]] * p_bias[bi[sl]])
    return out


def coverage_probability(window: int, target: int, sampler: str = "pose", chunks: int = 2) -> np.ndarray:
    """Exact P(distance r is covered by one example), float64 of shape (target,), index r (index 0 = distance 0 = 1).

    sampler: "contiguous" (unextended, positions 0..Lc-1), "full" (0..Lt-1), "pose" (N = ``chunks``; N = 1, 2 in
    closed form, N >= 3 by exact enumeration of all layouts, ValueError above MAX_LAYOUTS), "pose-ref" (authors'
    code: N = 2, l_0 ~ U{1..ceil(Lc/2)}). RandPos has no exact routine here: use ``coverage_monte_carlo``.
    """
    _check(window, target, chunks)
    if sampler == "contiguous" or (sampler == "pose" and (chunks == 1 or target == window)):
        return _contiguous(window, target)
    if sampler == "full":
        return _contiguous(target, target)
    if sampler == "pose":
        if chunks == 2:
            return _two_chunk(window, target, window - 1)
        return _enumerate_exact(window, target, chunks)
    if sampler == "pose-ref":
        if window < 2:
            raise ValueError(f"window must be >= 2 for sampler='pose-ref', got {window}")
        return _two_chunk(window, target, (window + 1) // 2)
    raise ValueError(f"sampler must be one of {EXACT_SAMPLERS} for exact coverage, got {sampler!r}")


def sample_pose_batch(batch: int, window: int, target: int, chunks: int, rng: np.random.Generator,
                      reference: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` PoSE layouts at once: (lengths, biases), each int64 (batch, chunks), same law as
    pose_mlx.training.positions.pose_position_ids (``reference=True``: the pose-ref variant)."""
    room = target - window
    lengths = np.empty((batch, chunks), dtype=np.int64)
    biases = np.zeros((batch, chunks), dtype=np.int64)
    if reference:
        lengths[:, 0] = rng.integers(1, (window + 1) // 2, size=batch, endpoint=True)
        lengths[:, 1] = window - lengths[:, 0]
        biases[:, 1] = rng.integers(0, room, size=batch, endpoint=True)
        return lengths, biases
    rest = np.full(batch, window, dtype=np.int64)
    for i in range(chunks - 1):
        lengths[:, i] = rng.integers(1, rest - (chunks - 1 - i), endpoint=True)
        rest -= lengths[:, i]
        biases[:, i + 1] = rng.integers(biases[:, i], room, endpoint=True)
    lengths[:, -1] = rest
    return lengths, biases


def _randpos_covered(batch: int, window: int, target: int, rng: np.random.Generator) -> np.ndarray:
    """(batch, target) coverage indicators of RandPos examples via the autocorrelation of the position indicator."""
    keys = rng.random((batch, target))
    chosen = np.argpartition(keys, window - 1, axis=1)[:, :window]
    ind = np.zeros((batch, target))
    np.put_along_axis(ind, chosen, 1.0, axis=1)
    n = 1 << (2 * target - 1).bit_length()
    spec = np.fft.rfft(ind, n=n, axis=1)
    corr = np.fft.irfft(spec * np.conj(spec), n=n, axis=1)[:, :target]
    return corr > 0.5


def coverage_monte_carlo(window: int, target: int, sampler: str = "pose", chunks: int = 2, samples: int = 10_000,
                         rng=None, batch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo estimate of ``coverage_probability``: (mean, standard error), each float64 (target,).
    sampler: "pose" (any N), "pose-ref", "randpos" (``window`` distinct sorted positions from [0, target))."""
    _check(window, target, chunks)
    if sampler not in MC_METHODS:
        raise ValueError(f"sampler must be one of {MC_METHODS}, got {sampler!r}")
    if samples < 2:
        raise ValueError(f"samples must be >= 2, got {samples}")
    rng = np.random.default_rng(rng)
    total = np.zeros(target)
    done = 0
    while done < samples:
        b = min(batch, samples - done)
        if sampler == "randpos":
            covered = _randpos_covered(b, window, target, rng)
        else:
            n = 2 if sampler == "pose-ref" else chunks
            lengths, biases = sample_pose_batch(b, window, target, n, rng, reference=sampler == "pose-ref")
            covered = _union_indicator(*_interval_ends(lengths, biases), target)
        total += covered.sum(axis=0)
        done += b
    mean = total / samples
    return mean, np.sqrt(mean * (1.0 - mean) / (samples - 1))


def examples_to_cover(coverage: np.ndarray, p: float = 0.99) -> np.ndarray:
    """Per distance r, the fewest independent examples n with 1 - (1 - q_r)^n >= p; inf where q_r = 0.
    Its maximum over r is the number of examples after which every distance is covered with probability >= p
    (each distance separately)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    q = np.asarray(coverage, dtype=float)
    out = np.full(q.shape, np.inf)
    out[q >= 1.0] = 1.0
    mid = (q > 0.0) & (q < 1.0)
    out[mid] = np.ceil(np.log1p(-p) / np.log1p(-q[mid]))
    return out
