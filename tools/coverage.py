"""Plots and numbers of pose_mlx.analysis (PoSE coverage, rotary-angle distributions / DPRoPE, PI vs ABF
granularity, PI's bounds). NumPy + matplotlib (Agg) only. Defaults: the papers' 2k -> 16k, d = 128, b = 1e4.

Writes into --out: coverage.png/.csv, angle_histograms.png, dprope_kl.png, dprope.json, helices.png,
granularity.png/.csv, bounds.png/.csv, summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from pose_mlx.analysis import (angle_histograms, coverage_monte_carlo, coverage_probability, disturbances,
                               dprope_factors, examples_to_cover, extrapolation_sum, granularity_constant,
                               granularity_limit, helix, interpolation_bound, rope_inv_freq)
from pose_mlx.angles import FLOOR
from pose_mlx.errors import ArgumentParser, UserError, command
from pose_mlx.plots import mark_tick, plain_log_axis


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_coverage(args, out: Path) -> dict:
    lc, lt = args.window, args.target
    curves = {"original (no extension)": coverage_probability(lc, lt, "contiguous"),
              "PoSE N=1": coverage_probability(lc, lt, "pose", 1),
              "PoSE N=2 (exact)": coverage_probability(lc, lt, "pose", 2)}
    rng = np.random.default_rng(args.seed)
    n3, _ = coverage_monte_carlo(lc, lt, "pose", 3, samples=args.samples, rng=rng)
    curves["PoSE N=3 (Monte Carlo)"] = n3
    rp, _ = coverage_monte_carlo(lc, lt, "randpos", samples=max(2, args.samples // 10), rng=rng)
    curves["RandPos (Monte Carlo)"] = rp
    r = np.arange(lt)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, (label, q) in enumerate(curves.items()):
        style = {"ls": "--", "lw": 2.5, "alpha": 0.6} if k == 0 else {"lw": 1.2}
        ax.plot(r[1:], q[1:], label=label, **style)
    ax.axvline(lc, color="grey", ls=":", lw=0.8, label=f"original window Lc = {lc}")
    ax.set_xlabel("relative distance r (tokens)")
    ax.set_ylabel("P(r covered by one example)")
    ax.set_title(f"Coverage of relative distances, {lc} -> {lt} tokens")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the data
    mark_tick(ax, lc)
    _save(fig, out / "coverage.png")
    header = "distance," + ",".join(curves)
    np.savetxt(out / "coverage.csv", np.column_stack([r] + list(curves.values())), delimiter=",", header=header,
               comments="", fmt=["%d"] + ["%.6g"] * len(curves))
    needed = {name: float(examples_to_cover(q[1:], 0.99).max()) for name, q in curves.items()}
    return {name: (n if np.isfinite(n) else None) for name, n in needed.items()}  # None: some r never covered


def plot_angles(args, out: Path) -> dict:
    theta = rope_inv_freq(args.head_dim, args.base)
    s = args.target / args.window
    cands = {"extrapolation": theta, "interpolation": theta / s}
    kl = disturbances(cands, theta, args.window, args.target, args.bins)
    factors = dprope_factors(theta, args.window, args.target, args.bins)
    dims = [int(d) for d in args.dims]
    pre = angle_histograms(theta[dims], args.window, args.bins)
    ext = angle_histograms(theta[dims], args.target, args.bins)
    inter = angle_histograms(theta[dims] / s, args.target, args.bins)
    centres = (np.arange(args.bins) + 0.5) * 360.0 / args.bins
    plt = _pyplot()
    fig, axes = plt.subplots(len(dims), 3, figsize=(10, 2.2 * len(dims) + 0.6), sharex=True, squeeze=False)
    for row, dim in enumerate(dims):
        for col, (name, h) in enumerate([(f"pre-trained (L={args.window})", pre), ("extrapolation", ext),
                                         ("interpolation", inter)]):
            ax = axes[row, col]
            ax.bar(centres, h[row], width=360.0 / args.bins, color=f"C{col}")
            title = name if col == 0 else f"{name}, KL={kl[name][dim]:.3g}"
            ax.set_title(f"pair {dim}: {title}", fontsize=8)
            ax.set_ylabel("fraction" if col == 0 else "")
    for ax in axes[-1]:
        ax.set_xlabel("rotary angle (degrees)")
    fig.suptitle(f"Rotary-angle distributions, {args.window} -> {args.target}, d={args.head_dim}, b={args.base:g}",
                 fontsize=10)
    _save(fig, out / "angle_histograms.png")

    fig, ax = plt.subplots(figsize=(9, 3.8))
    idx = np.arange(len(theta))
    ax.semilogy(idx, kl["extrapolation"] + 1e-12, "o-", ms=3, label="KL, extrapolation")
    ax.semilogy(idx, kl["interpolation"] + 1e-12, "s-", ms=3, label="KL, interpolation")
    chosen = factors > 1
    ax.scatter(idx[chosen], np.full(chosen.sum(), ax.get_ylim()[1] * 0.5), marker="v", color="C3",
               label=f"DPRoPE picks interpolation (x{s:g})")
    ax.set_xlabel("frequency pair i (theta_i = b^(-2i/d))")
    ax.set_ylabel("KL(P_pretrained || P_candidate) (nats)")
    plain_log_axis(ax.yaxis)
    ax.set_title("Per-dimension disturbance and DPRoPE's choice")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the data
    _save(fig, out / "dprope_kl.png")
    record = {"scale": s, "factors": factors.tolist(), "kl_extrapolation": kl["extrapolation"].tolist(),
              "kl_interpolation": kl["interpolation"].tolist(), "bins": args.bins,
              "kl_direction": "KL(pre-trained || candidate)", "bin_count_floor": FLOOR}
    (out / "dprope.json").write_text(json.dumps(record, indent=1) + "\n")
    return {"interpolated_pairs": int(chosen.sum()), "pairs": len(theta)}


def plot_helices(args, out: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    t_dense = np.linspace(0, 10, 800)
    t_int = np.arange(11.0)
    a = 2.0
    variants = [("(a) RoPE", 1.0, a), ("(b) RoPE+PI", args.alpha, a), ("(c) RoPE+ABF", 1.0, 2 * a)]
    plt = _pyplot()
    fig = plt.figure(figsize=(11, 3.8))
    for k, (name, speed, freq) in enumerate(variants):
        ax = fig.add_subplot(1, 3, k + 1, projection="3d")
        line = helix(speed * t_dense, freq)
        pts = helix(speed * t_int, freq)
        ax.plot(*line.T, color="black", lw=0.8)
        ax.scatter(*pts.T, color="red", s=14)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("Re f_0", fontsize=7)
        ax.set_ylabel("Im f_0", fontsize=7)
        ax.set_zlabel("Re f_j", fontsize=7)
        for axis in (ax.xaxis, ax.yaxis, ax.zaxis):  # three round ticks an axis: the labels do not overlap
            axis.set_major_locator(MaxNLocator(nbins=2, steps=[1, 2, 5, 10]))
        ax.tick_params(labelsize=7)
    fig.suptitle(f"Fig. 8 of Xiong et al. (arXiv 2309.16039), analogue: x=cos t, y=sin t, z=sin(a t); PI scales t by alpha={args.alpha:g}, "
                 "ABF doubles a", fontsize=9)
    fig.savefig(out / "helices.png", dpi=110)
    plt.close(fig)


def plot_granularity(args, out: Path) -> dict:
    alphas = np.linspace(0.02, 1.0, 50)
    betas = np.geomspace(1, 1e4, 50)
    c_pi = [granularity_constant(args.head_dim, args.base, alpha=a) for a in alphas]
    c_abf = [granularity_constant(args.head_dim, args.base, beta=b) for b in betas]
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(alphas, c_pi, label=f"C_d (mean over d/2), d={args.head_dim}")
    ax1.plot(alphas, [granularity_limit(args.base, alpha=a) for a in alphas], "--", label="alpha / ln b")
    ax1.set_xlabel("PI factor alpha")
    ax1.set_ylabel("granularity C_d")
    ax1.set_title("RoPE + PI")
    ax1.legend(fontsize=8)
    ax2.semilogx(betas, c_abf, label=f"C_d (mean over d/2), d={args.head_dim}")
    ax2.semilogx(betas, [granularity_limit(args.base, beta=b) for b in betas], "--", label="1 / (ln b + ln beta)")
    ax2.set_xlabel("ABF factor beta")
    plain_log_axis(ax2.xaxis)
    ax2.set_ylabel("granularity C_d")
    ax2.set_title("RoPE + ABF")
    ax2.legend(fontsize=8)
    _save(fig, out / "granularity.png")
    rows = np.column_stack([alphas, c_pi, betas, c_abf])
    np.savetxt(out / "granularity.csv", rows, delimiter=",", header="alpha,C_pi,beta,C_abf", comments="")
    return {"C_pi_alpha_0.25": granularity_constant(args.head_dim, args.base, alpha=0.25),
            "C_abf_beta_50": granularity_constant(args.head_dim, args.base, beta=50.0),
            "limit_pi_alpha_0.25": float(granularity_limit(args.base, alpha=0.25)),
            "limit_abf_beta_50": float(granularity_limit(args.base, beta=50.0))}


def plot_bounds(args, out: Path) -> dict:
    s = np.arange(0, args.bound_range, 0.5)
    b = extrapolation_sum(s, args.head_dim, args.base)
    interp = interpolation_bound(s + 0.5, args.head_dim, args.base, s1=s, s2=s + 1)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.semilogy(s, 2 * b, lw=0.6, label="extrapolation bound 2 B(s) (eq. 8)")
    ax.semilogy(s, np.full_like(s, 2 * args.head_dim), "k--", lw=1, label="2 d (paper: B(s) >= d)")
    ax.semilogy(s, interp, lw=1.5, label="interpolation bound, midpoint (eq. 5)")
    ax.set_xlabel("relative distance s (tokens)")
    ax.set_ylabel("bound / max|h_j|")
    plain_log_axis(ax.yaxis)
    ax.set_title(f"PI bounds, d={args.head_dim}, c={args.base:g}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the data
    _save(fig, out / "bounds.png")
    np.savetxt(out / "bounds.csv", np.column_stack([s, b, interp]), delimiter=",",
               header="s,B(s),interpolation_bound_midpoint", comments="")
    below = s[b < args.head_dim]
    return {"B_min": float(b.min()), "B_min_at": float(s[b.argmin()]),
            "first_s_with_B_below_d": float(below[0]) if below.size else None}


def parse_args(argv=None):
    p = ArgumentParser(prog="python tools/coverage.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/coverage"), help="output folder (default out/coverage)")
    p.add_argument("--window", type=int, default=2048, help="training window = original length (default 2048)")
    p.add_argument("--target", type=int, default=16384, help="target length (default 16384)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head dimension d (default 128)")
    p.add_argument("--base", type=float, default=1e4, help="RoPE base b (default 1e4)")
    p.add_argument("--bins", type=int, default=360, help="angle histogram bins (default 360)")
    p.add_argument("--dims", type=int, nargs="+", default=[0, 24, 40, 63],
                   help="frequency pairs whose angle histograms are drawn (default 0 24 40 63)")
    p.add_argument("--samples", type=int, default=4000,
                   help="Monte Carlo examples for PoSE N=3 (RandPos uses a tenth) (default 4000)")
    p.add_argument("--alpha", type=float, default=0.25, help="PI factor of the helix figure (default 0.25)")
    p.add_argument("--bound-range", type=float, default=10000.0,
                   help="largest distance s of the bound curves (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the Monte Carlo runs (default 0)")
    args = p.parse_args(argv)
    checks = [
        (args.window >= 3 and args.target >= args.window, "--window must be >= 3 and --target >= --window"),
        (args.target <= 1 << 24, f"--target {args.target} is too large for this tool (at most 16M positions)"),
        (args.head_dim >= 2 and args.head_dim % 2 == 0, f"--head-dim must be a positive even integer, got "
                                                        f"{args.head_dim}"),
        (math.isfinite(args.base) and args.base > 1, f"--base must be a finite number > 1, got {args.base:g}"),
        (1 <= args.bins <= 100_000, f"--bins must be between 1 and 100000, got {args.bins}"),
        (2 <= args.samples <= 10_000_000, f"--samples must be between 2 and 10^7, got {args.samples}"),
        (0 < args.alpha <= 1, f"--alpha must lie in (0, 1], got {args.alpha:g}"),
        (math.isfinite(args.bound_range) and args.bound_range >= 1,
         f"--bound-range must be a finite number >= 1, got {args.bound_range:g}"),
        (all(0 <= d < args.head_dim // 2 for d in args.dims), f"--dims must lie in [0, {args.head_dim // 2})"),
        (args.seed >= 0, f"--seed must be >= 0, got {args.seed}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--out: cannot create {args.out}: {error.strerror}") from None
    return args


def run(args) -> dict:
    """Every figure and table; returns the summary written to summary.json."""
    summary = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "examples_for_p99_each_distance": plot_coverage(args, args.out),
               "dprope": plot_angles(args, args.out),
               "granularity": plot_granularity(args, args.out),
               "bounds": plot_bounds(args, args.out)}
    plot_helices(args, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {len(list(args.out.iterdir()))} files to {args.out}")
    return summary


@command("coverage.py")
def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
