"""Vectorised rotary-angle histograms / DPRoPE factors vs a straightforward Python loop.

Setting: d = 128 (64 frequency pairs), b = 1e4, Lc = 4096, Lt = 131072, 360 bins. DPRoPE needs three
histogram sets (pre-training at Lc, extrapolation and interpolation at Lt). The loop version walks every
(dimension, position) pair in Python; it is timed on ``--loop-dims`` dimensions and extrapolated linearly to 64
(its cost is exactly proportional to the number of dimensions). Writes benchmarks/results/analysis.json.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from benchmarks.common import write_results
from pose_mlx.analysis import angle_histograms, dprope_factors, rope_inv_freq


def loop_histograms(inv_freq, length: int, bins: int) -> np.ndarray:
    """One Python iteration per (dimension, position): the straightforward implementation."""
    out = np.zeros((len(inv_freq), bins))
    two_pi = 2 * math.pi
    for i, theta in enumerate(inv_freq):
        row = [0] * bins
        for m in range(length):
            k = int((m * theta) % two_pi * bins / two_pi)
            row[min(k, bins - 1)] += 1
        out[i] = np.array(row) / length
    return out


def loop_dprope(theta, original: int, target: int, bins: int) -> np.ndarray:
    """KL(P_pre || P_candidate) per dimension, every bin's count floored at 2^-14 (the authors' rule)."""
    s = target / original
    floor = 2.0 ** -14
    pre = loop_histograms(theta, original, bins) + floor / original
    out = []
    for e, i, p in zip(loop_histograms(theta, target, bins), loop_histograms(theta / s, target, bins), pre):
        kl_e = sum(a * math.log(a / (b + floor / target)) for a, b in zip(p, e))
        kl_i = sum(a * math.log(a / (b + floor / target)) for a, b in zip(p, i))
        out.append(1.0 if kl_e <= kl_i else s)
    return np.array(out)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128, help="attention head dimension d (default 128)")
    parser.add_argument("--base", type=float, default=1e4, help="RoPE base b (default 1e4)")
    parser.add_argument("--original", type=int, default=4096, help="pre-training length Lc (default 4096)")
    parser.add_argument("--target", type=int, default=131072, help="target length Lt (default 131072)")
    parser.add_argument("--bins", type=int, default=360, help="histogram bins (default 360)")
    parser.add_argument("--loop-dims", type=int, default=4, help="dimensions the loop version runs on (default 4)")
    parser.add_argument("--repeats", type=int, default=7, help="best-of repeats of the vectorised runs (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/analysis.json)")
    args = parser.parse_args(argv)

    theta = rope_inv_freq(args.head_dim, args.base)
    pairs = len(theta)
    hist_fast = best_of(lambda: angle_histograms(theta, args.target, args.bins), args.repeats)
    dprope_fast = best_of(lambda: dprope_factors(theta, args.original, args.target, args.bins),
                          args.repeats)
    # the loop on the lowest- and highest-frequency dims (both ends of the spectrum), extrapolated to all pairs
    sub = theta[np.linspace(0, pairs - 1, args.loop_dims).round().astype(int)]
    start = time.perf_counter()
    loop_hist_sub = loop_histograms(sub, args.target, args.bins)
    hist_loop = (time.perf_counter() - start) * pairs / len(sub)
    start = time.perf_counter()
    loop_factors = loop_dprope(sub, args.original, args.target, args.bins)
    dprope_loop = (time.perf_counter() - start) * pairs / len(sub)
    fast_sub = angle_histograms(sub, args.target, args.bins)
    idx = np.linspace(0, pairs - 1, args.loop_dims).round().astype(int)
    results = {
        "setting": {"head_dim": args.head_dim, "base": args.base, "original_length": args.original,
                    "target_length": args.target, "bins": args.bins},
        "histograms_vectorised_s": hist_fast,
        "histograms_loop_s_extrapolated": hist_loop,
        "histograms_speedup": hist_loop / hist_fast,
        "dprope_vectorised_s": dprope_fast,
        "dprope_loop_s_extrapolated": dprope_loop,
        "dprope_speedup": dprope_loop / dprope_fast,
        "loop_note": f"loop timed on {len(sub)} of {pairs} dimension pairs and scaled linearly to {pairs}",
        "max_abs_histogram_difference": float(np.abs(loop_hist_sub - fast_sub).max()),
        "factors_agree_on_timed_dims": bool(np.array_equal(loop_factors, dprope_factors(
            theta, args.original, args.target, args.bins)[idx])),
        "vectorised_timing": f"best of {args.repeats}",
    }
    path = write_results("analysis", results, args.out)
    print(f"histograms: {hist_fast:.3f} s vs loop ~{hist_loop:.1f} s ({hist_loop / hist_fast:.0f}x); "
          f"dprope: {dprope_fast:.3f} s vs loop ~{dprope_loop:.1f} s ({dprope_loop / dprope_fast:.0f}x) -> {path}")


if __name__ == "__main__":
    main()
