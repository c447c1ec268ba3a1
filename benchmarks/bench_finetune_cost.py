"""Training cost of PoSE vs full-length fine-tuning against the extension ratio Lt / Lc (PoSE paper, Figure 3).

As in the paper, every step trains the same number of sequences (`--batch`): PoSE sequences have Lc tokens
with position ids up to Lt, full-length sequences have Lt tokens. Each configuration is a real
`pose_mlx.training.loop.train` run (full fine-tuning, linear schedule s = Lt / Lc) of a random-weight mlx-lm llama on a
synthetic corpus; its log gives seconds per step (first step, which compiles, left out) and
`mx.get_peak_memory()`; MLX's buffer cache is emptied before each run. Full-length stops at `--full-max` (its cost
grows with Lt), PoSE goes on to `--pose-max`. Each of `--rounds` rounds runs every full-length ratio once, and
before each of those runs a sweep over all PoSE ratios: PoSE runs are cheap, and this spreads them over the
whole benchmark, so that every ratio meets the same machine noise (this shared machine slows down by up to 20% in
phases of tens of seconds, whatever runs). Step time `step_s` is the fastest timed step over all runs of a
configuration (as `timeit` advises, the minimum is the cost of the step itself), `step_s_median` their median;
peak memory is the maximum.

Where the cost goes: after each run the model's attention alone is timed on the same shapes (`--layers` causal
`mx.fast.scaled_dot_product_attention` calls, forward and backward, on random queries, keys and values of
`--batch` x `--heads` x sequence x head size), its fastest of three passes recorded as `attention_s`;
attention's share of a step is attention_s / step_s. Its work grows with the square of the sequence, the rest of
the step (embeddings, projections, MLPs, loss, optimizer) linearly.
Writes benchmarks/results/finetune_cost.json (records {method, ratio, step_s, step_s_median, peak_bytes,
tokens_per_step}) and benchmarks/results/finetune_cost.png; `--plot-only` draws the PNG again from the JSON.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx

from pose_mlx import extend, use_positions
from pose_mlx.backend import status as blas_status
from pose_mlx.training.data import ExampleStream
from pose_mlx.plots import _pyplot, plain_log_axis
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config
from pose_mlx.training.loop import TrainConfig, train

from benchmarks.common import RESULTS_DIR, synthetic_corpus, write_results

VOCAB = 2048


def measure(args, corpus, method: str, ratio: int) -> dict:
    """One short training run; its per-step seconds (first left out) and peak memory."""
    mx.clear_cache()
    target = args.window * ratio
    steps = args.pose_steps if method == "pose" else args.steps
    config = model_config(VOCAB, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          max_position_embeddings=args.window)
    model = build_model(config, seed=0)
    extend(model, "linear", args.window, target)
    stream = ExampleStream(corpus, args.window, target, sampler=method, batch_size=args.batch, seed=ratio)
    with tempfile.TemporaryDirectory() as run_dir:
        train(model, stream, TrainConfig(steps=steps, lr=1e-4, warmup=1, progress=False), run_dir, use_positions)
        log = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
    del model, stream
    sequence = log[-1]["tokens"] // args.batch
    return {"step_s": [r["seconds"] for r in log[1:]],
            "peak_bytes": int(max(r["peak_memory_gb"] for r in log) * 2**30),
            "tokens_per_step": log[-1]["tokens"], **attention_cost(args, sequence)}


def attention_cost(args, sequence: int, passes: int = 3) -> dict:
    """Seconds (fastest of `passes`, after one warm-up) of the model's attention alone, forward and backward:
    `args.layers` chained causal SDPA calls on (batch, heads, sequence, head size) inputs."""
    head_dim = args.hidden // args.heads
    q, k, v = (mx.random.normal((args.batch, args.heads, sequence, head_dim)) for _ in range(3))
    mx.eval(q, k, v)

    def attention(q, k, v):
        for _ in range(args.layers):
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask="causal")
        return q.sum()

    grad = mx.grad(attention, argnums=(0, 1, 2))
    mx.eval(grad(q, k, v))
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        mx.eval(grad(q, k, v))
        seconds.append(time.perf_counter() - start)
    return {"attention_s": min(seconds)}


def plot(records: list[dict], path: Path, window: int) -> Path:
    """Seconds per step and peak memory against the ratio, log-log panels; one legend below both."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, scale in ((axes[0], "step_s", "seconds per step (s)", 1.0),
                                  (axes[1], "peak_bytes", "peak memory (MiB)", 2.0 ** -20)):
        for method, name in (("pose", f"PoSE (Lc = {window} tokens)"), ("full", "Full-length (Lt tokens)")):
            rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["ratio"])
            ax.plot([r["ratio"] for r in rows], [r[key] * scale for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ratios = sorted({r["ratio"] for r in records})
        ax.set_xticks(ratios, [f"{r}x" for r in ratios])
        ax.minorticks_off()
        ax.set_xlabel(f"extension ratio Lt / Lc (Lc = {window} tokens)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        ax.grid(True, alpha=0.3)
    rows = sorted((r for r in records if r["method"] == "full"), key=lambda r: r["ratio"])
    axes[0].plot([r["ratio"] for r in rows], [r["attention_s"] for r in rows], marker=".", linestyle="--",
                 color="C1", label="Full-length: its attention alone")
    fig.suptitle("Fine-tuning cost per step vs target length (cf. PoSE paper, Figure 3)")
    fig.tight_layout()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def replot(out: Path) -> Path:
    """The PNG beside `out` drawn again from its committed records, without measuring anything."""
    record = json.loads(out.read_text())
    return plot(record["records"], out.with_suffix(".png"), record["config"]["window"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=128, help="training window Lc (tokens; default 128)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step for both methods (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps per full-length run, the first not timed (default 6)")
    parser.add_argument("--pose-steps", type=int, default=6,
                        help="steps per PoSE run, the first not timed (default 6)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each runs every full-length ratio once, a PoSE sweep before each (default 3)")
    parser.add_argument("--full-max", type=int, default=16, help="largest ratio for full-length (default 16)")
    parser.add_argument("--pose-max", type=int, default=64, help="largest ratio for PoSE (default 64)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "finetune_cost.json"), help="JSON path (PNG beside it)")
    parser.add_argument("--plot-only", action="store_true",
                        help="only draw the PNG again from the JSON at --out (no measurement)")
    args = parser.parse_args()
    if args.plot_only:
        if not Path(args.out).is_file():
            parser.error(f"--plot-only: {args.out} does not exist")
        print(f"wrote {replot(Path(args.out))}")
        return
    if min(args.steps, args.pose_steps) < 2 or args.rounds < 1 or args.full_max < 2 or args.pose_max < 2:
        parser.error("--steps and --pose-steps must be >= 2, --rounds >= 1, --full-max and --pose-max >= 2")

    ratios = [2 ** k for k in range(1, int(np.log2(args.pose_max)) + 1)]
    full_ratios = [r for r in ratios if r <= args.full_max]
    schedule = [run for _ in range(args.rounds) for full_ratio in full_ratios
                for run in [*(("pose", r) for r in ratios), ("full", full_ratio)]]
    corpus = synthetic_corpus(VOCAB, docs=8, length=args.window * max(args.full_max, 2))
    runs = {("pose", r): [] for r in ratios} | {("full", r): [] for r in full_ratios}
    for i, (method, ratio) in enumerate(schedule):
        runs[(method, ratio)].append(measure(args, corpus, method, ratio))
        m = runs[(method, ratio)][-1]
        print(f"run {i + 1}/{len(schedule)} {method:>4} {ratio:>3}x: {statistics.median(m['step_s']):.4f} s/step, "
              f"peak {m['peak_bytes'] / 2**20:.1f} MiB", flush=True)
    records = [{"method": method, "ratio": ratio, "target": args.window * ratio,
                "step_s": min(s for m in ms for s in m["step_s"]),
                "step_s_median": statistics.median(s for m in ms for s in m["step_s"]),
                "peak_bytes": max(m["peak_bytes"] for m in ms), "tokens_per_step": ms[0]["tokens_per_step"],
                "attention_s": min(m["attention_s"] for m in ms)}
               for (method, ratio), ms in runs.items()]
    pose = [r for r in records if r["method"] == "pose"]
    full = {r["ratio"]: r for r in records if r["method"] == "full"}
    summary = {
        "pose_step_max_over_min": max(r["step_s"] for r in pose) / min(r["step_s"] for r in pose),
        "pose_step_median_max_over_min": (max(r["step_s_median"] for r in pose)
                                          / min(r["step_s_median"] for r in pose)),
        "pose_peak_max_over_min": max(r["peak_bytes"] for r in pose) / min(r["peak_bytes"] for r in pose),
        "full_over_pose": {str(k): {"step": f["step_s"] / next(p["step_s"] for p in pose if p["ratio"] == k),
                                    "peak": f["peak_bytes"] / next(p["peak_bytes"] for p in pose if p["ratio"] == k)}
                           for k, f in full.items()},
        "attention_share_of_step": {f"{r['method']} {r['ratio']}x": r["attention_s"] / r["step_s"] for r in records},
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
