"""Training cost of PoSE vs full-length fine-tuning against the extension ratio Lt / Lc (PoSE paper, Figure 3).

As in the paper, every step trains the same number of sequences (`--batch`): PoSE sequences have Lc tokens
with position ids up to Lt, full-length sequences have Lt tokens. Each configuration is a real
`pose_mlx.train.train` run (full fine-tuning, linear schedule s = Lt / Lc) of a random-weight mlx-lm llama on a
synthetic corpus; its log gives seconds per step (median, first step left out) and `mx.get_peak_memory()`.
Configurations are interleaved over `--rounds` rounds (machine noise hits all alike); step time is the median
over rounds, peak memory the maximum. Full-length stops at `--full-max` (its cost grows with Lt), PoSE goes on
to `--pose-max`.

Where the cost goes: a full-length step at ratio r costs about c0 + c1 r + c2 r^2 seconds (the r^2 term is
attention over Lt x Lt scores); the fit of these three coefficients is written beside the measurements.
Writes benchmarks/results/finetune_cost.json (records {method, ratio, step_s, peak_bytes, tokens_per_step})
and benchmarks/results/finetune_cost.png.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import pose_mlx  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx

from pose_mlx import extend
from pose_mlx.backend import status as blas_status
from pose_mlx.data import ExampleStream
from pose_mlx.plots import _pyplot
from pose_mlx.toy import build_model, model_config
from pose_mlx.train import TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, synthetic_corpus, write_results  # noqa: E402

VOCAB = 2048


def measure(args, corpus, method: str, ratio: int) -> dict:
    """One short training run; its per-step seconds (first left out) and peak memory."""
    target = args.window * ratio
    config = model_config(VOCAB, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          max_position_embeddings=args.window)
    model = build_model(config, seed=0)
    extend(model, "linear", args.window, target)
    stream = ExampleStream(corpus, args.window, target, method=method, batch_size=args.batch, seed=ratio)
    with tempfile.TemporaryDirectory() as run_dir:
        train(model, stream, TrainConfig(steps=args.steps, lr=1e-4, warmup=1, progress=False), run_dir)
        log = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
    return {"step_s": statistics.median(r["seconds"] for r in log[1:]),
            "peak_bytes": int(max(r["peak_memory_gb"] for r in log) * 2**30),
            "tokens_per_step": log[-1]["tokens"]}


def fit_full(records: list[dict]) -> dict:
    """Least-squares step_s = c0 + c1 r + c2 r^2 over the full-length records, and the r^2 share per ratio."""
    full = [r for r in records if r["method"] == "full"]
    ratios = np.array([r["ratio"] for r in full], dtype=float)
    seconds = np.array([r["step_s"] for r in full])
    c0, c1, c2 = np.linalg.lstsq(np.stack([ratios ** 0, ratios, ratios ** 2], axis=1), seconds, rcond=None)[0]
    return {"c0": c0, "c1": c1, "c2": c2,
            "quadratic_share": {str(int(r)): float(c2 * r * r / (c0 + c1 * r + c2 * r * r)) for r in ratios}}


def plot(records: list[dict], path: Path, window: int) -> Path:
    from matplotlib.ticker import FuncFormatter

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, scale in ((axes[0], "step_s", "seconds per step", 1.0),
                                  (axes[1], "peak_bytes", "peak memory (MiB)", 2.0 ** -20)):
        for method, name in (("pose", f"PoSE (Lc = {window} tokens)"), ("full", "Full-length (Lt tokens)")):
            rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["ratio"])
            ax.plot([r["ratio"] for r in rows], [r[key] * scale for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ratios = sorted({r["ratio"] for r in records})
        ax.set_xticks(ratios, [f"{r}x" for r in ratios])
        ax.set_xlabel("extension ratio Lt / Lc")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Fine-tuning cost per step vs target length (cf. PoSE paper, Figure 3)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=128, help="training window Lc (tokens; default 128)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step for both methods (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run, the first not timed (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all configurations (default 3)")
    parser.add_argument("--full-max", type=int, default=16, help="largest ratio for full-length (default 16)")
    parser.add_argument("--pose-max", type=int, default=64, help="largest ratio for PoSE (default 64)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "finetune_cost.json"), help="JSON path (PNG beside it)")
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.full_max < 2 or args.pose_max < 2:
        parser.error("--steps must be >= 2, --rounds >= 1, --full-max and --pose-max >= 2")

    ratios = [2 ** k for k in range(1, int(np.log2(args.pose_max)) + 1)]
    configs = [("pose", r) for r in ratios] + [("full", r) for r in ratios if r <= args.full_max]
    corpus = synthetic_corpus(VOCAB, docs=8, length=args.window * max(args.full_max, 2))
    runs = {c: [] for c in configs}
    for round_ in range(args.rounds):
        for method, ratio in configs:
            runs[(method, ratio)].append(measure(args, corpus, method, ratio))
            m = runs[(method, ratio)][-1]
            print(f"round {round_ + 1}/{args.rounds} {method:>4} {ratio:>3}x: {m['step_s']:.4f} s/step, "
                  f"peak {m['peak_bytes'] / 2**20:.1f} MiB", flush=True)
    records = [{"method": method, "ratio": ratio, "target": args.window * ratio,
                "step_s": statistics.median(m["step_s"] for m in ms),
                "peak_bytes": max(m["peak_bytes"] for m in ms), "tokens_per_step": ms[0]["tokens_per_step"]}
               for (method, ratio), ms in runs.items()]
    pose = [r for r in records if r["method"] == "pose"]
    full = {r["ratio"]: r for r in records if r["method"] == "full"}
    summary = {
        "pose_step_max_over_min": max(r["step_s"] for r in pose) / min(r["step_s"] for r in pose),
        "pose_peak_max_over_min": max(r["peak_bytes"] for r in pose) / min(r["peak_bytes"] for r in pose),
        "full_over_pose": {str(k): {"step": f["step_s"] / next(p["step_s"] for p in pose if p["ratio"] == k),
                                    "peak": f["peak_bytes"] / next(p["peak_bytes"] for p in pose if p["ratio"] == k)}
                           for k, f in full.items()},
        "full_step_fit": fit_full(records),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(records, out.with_suffix(".png"), args.window)
    path = write_results("finetune_cost", {
        "records": records, "summary": summary, "png": png.name, "device": str(mx.default_device()),
        "blas": blas_status.get("library"), "config": {k: v for k, v in vars(args).items() if k != "out"}}, out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
