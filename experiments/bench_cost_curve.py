"""The cost curve on the real model (the PoSE paper's Fig. 3a/b): full-length against PoSE fine-tuning of
SmolLM2-135M, as addendum A registers it (benchmarks/protocols/real_model_full_length.yaml, `cost`).

    python -m experiments.bench_cost_curve [--configs full:8192,pose:1024,...] [--steps 3] [--grad-checkpoint]
                                          [--budget SECONDS] [--plot-only]

Each configuration is a real `python -m pose_mlx.finetune` run of the GGUF model with the headline's LoRA (rank 16,
every block) and rows (1 per update), `--steps` updates on the joined 32k documents of addendum A
(`evidence_full_length.joined_corpus`): full-length at a window of W tokens (`--sampler full`, target W; the
original window is set to W / 2 for W <= 8k, since the cost of an update does not depend on the scaling it
learns), PoSE at a window of W (target 32k). Its log gives the peak memory (MLX's peak, the maximum over the
updates) and the seconds of each update after the first (median); `python -m pose_mlx.plan --json` with the same
flags gives the prediction. A configuration the planner says does not fit in this machine's memory is recorded as
such, not run; `--skip-recorded` leaves out what this device's file already records (how `experiments.gpu_jobs` runs
it, with checkpointing, slot after slot). When `--budget` runs out during a configuration that has logged two or
more updates, those are its record (marked `stopped_early`) and the later configurations wait for the next run.
Records go to `results/real_model/cost/<device>.json` (one file per device, records of earlier runs on that device
kept unless re-measured), and `--plot-only` draws `results/real_model/cost.png` from every device's file: memory
and seconds per update by target, full-length against PoSE.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import (DOCS, REAL_MODEL, OutOfTime, child_env, log_peak_bytes, log_updates, model_file,
                               run_logged, set_budget, write_results)
from experiments.evidence_full_length import joined_corpus
from experiments.evidence_runs import device

COST = REAL_MODEL / "cost"
DEFAULT_CONFIGS = "pose:1024,pose:2048,full:8192,full:16384,full:32768"
POSE_TARGET = 32768


def parse_configs(text: str) -> list[tuple[str, int]]:
    """"full:8192,pose:1024" -> [("full", 8192), ("pose", 1024)]."""
    out = []
    for item in text.split(","):
        method, _, window = item.strip().partition(":")
        if method not in ("full", "pose") or not window.isdigit():
            raise SystemExit(f"--configs: {item!r} is not full:WINDOW or pose:WINDOW")
        out.append((method, int(window)))
    return out


def finetune_args(method: str, window: int, gguf: Path, data: Path, work: Path, steps: int,
                  checkpoint: bool, kernels: str = "auto") -> list[str]:
    """The flags shared by the run and its plan (a record without `kernels` ran before pose_mlx.kernels existed,
    through MLX's own attention and loss: "mlx")."""
    original = 8192 if method == "pose" or window > 8192 else window // 2
    target = POSE_TARGET if method == "pose" else window
    return ["--model", str(gguf), "--original", str(original), "--target", str(target), "--window",
            str(1024 if method == "full" else window), "--sampler", method, "--schedule", "yarn", "--lora-rank", "16",
            "--batch-size", "1", "--steps", str(steps), "--warmup", "1", "--lr", "3e-5", "--data", str(data),
            "--cache-dir", str(work / "cache"), "--kernels", kernels, *(["--grad-checkpoint"] if checkpoint else [])]


def predicted(argv: list[str]) -> dict:
    """`pose_mlx.plan --json` of a run's flags (plan takes finetune's): {"predicted_bytes", "fits"}."""
    out = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *argv, "--json"], capture_output=True, text=True,
                         env=child_env())
    if out.returncode:
        raise SystemExit(f"pose_mlx.plan failed: {out.stderr.strip()}")
    plan = json.loads(out.stdout)
    return {"predicted_bytes": plan["peak_bytes"], "fits": plan["fits"]}


def log_record(log: Path) -> dict | None:
    """What a training log measured: the largest peak (bytes), the median seconds of the updates after the first,
    how many were timed, the tokens of an update; None before two updates were logged."""
    updates = log_updates(log)
    if len(updates) < 2:
        return None
    return {"peak_bytes": log_peak_bytes(updates),
            "seconds_per_update": statistics.median(e["seconds"] for e in updates[1:]),
            "updates_timed": len(updates) - 1, "tokens_per_update": updates[-1]["tokens"]}


def measure(method: str, window: int, gguf: Path, data: Path, work: Path, steps: int, checkpoint: bool) -> dict:
    """One configuration's record: measured (peak bytes, median seconds per update after the first) or why not.
    When the budget stops the run after two or more updates, what they measured is the record, marked
    `stopped_early`; before that, `OutOfTime` goes on up."""
    argv = finetune_args(method, window, gguf, data, work, steps, checkpoint)
    record = {"method": method, "window": window, "grad_checkpoint": checkpoint, "kernels": "auto", "device": device(),
              **predicted(argv)}
    if not record["fits"]:
        record["not_measured"] = "the planner predicts it does not fit in this machine's memory"
        return record
    out = work / "cost" / f"{method}-{window}"
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        run_logged(["pose_mlx.finetune", *argv, "--output", str(out), "--no-progress", "--save-every", "0"],
                   work / "logs" / f"cost.{method}-{window}.log")
        record.update(log_record(out / "train_log.jsonl"))
    except OutOfTime:
        measured = log_record(partial / "log.jsonl")
        if measured is None:
            raise
        record.update(measured, stopped_early=f"the budget ran out after {measured['updates_timed'] + 1} updates")
    shutil.rmtree(out, ignore_errors=True)  # only the record is kept: a fused 135M model is 0.5 GB
    shutil.rmtree(partial, ignore_errors=True)
    return record


def recorded(records: list[dict], method: str, window: int, checkpoint: bool) -> bool:
    """Whether `records` hold this configuration whole: measured to the end, or planned not to fit."""
    return any((r["method"], r["window"], r["grad_checkpoint"]) == (method, window, checkpoint)
               and ("not_measured" in r or ("peak_bytes" in r and "stopped_early" not in r)) for r in records)


def gpu_pending(configs: str = DEFAULT_CONFIGS) -> str | None:
    """Why the cost curve is pending on a GPU (gpu_jobs): the configurations no GPU's file records whole."""
    gpu = [r for path in sorted(COST.glob("*.json")) for r in json.loads(path.read_text())["records"]
           if "Device(gpu" in r.get("device", "")]
    missing = [f"{m}:{w}" for m, w in parse_configs(configs) if not recorded(gpu, m, w, True)]
    return f"not measured on a GPU: {', '.join(missing)}" if missing else None


def device_file() -> Path:
    """results/real_model/cost/<kind>-<model>.json, e.g. cpu-amd-epyc.json, from `device()`."""
    found = re.match(r"Device\((\w+), \d+\)\s*(.*)", device().split(" on ")[0])
    name = f"{found.group(1)}-{found.group(2)}" if found else device()
    return COST / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json")


def plot(path: Path) -> Path | None:
    """Memory (measured, filled; the planner's prediction, hollow) and seconds per update by target: full-length
    trains on the target, PoSE's cost does not depend on it (a horizontal line per window); one marker per device."""
    records = [r for f in sorted(COST.glob("*.json")) for r in json.loads(f.read_text())["records"]]
    if not any("peak_bytes" in r for r in records):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pose_mlx.plots import plain_log_axis

    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4))
    windows = sorted({r["window"] for r in records if r["method"] == "full"} | {8192, 16384, 32768})
    paths = {"mlx": "MLX's attention and loss", "auto": "pose_mlx.kernels"}
    groups = sorted({(r["device"], r.get("kernels", "mlx")) for r in records})
    for i, ((d, kernels), marker) in enumerate(zip(groups, "os^D")):
        name = re.sub(r"^Device[(]\w+, \d+[)] ", "", d.split(" on ")[0])
        short = f"{name}, {paths.get(kernels, kernels)}"
        mine = [r for r in records if (r["device"], r.get("kernels", "mlx")) == (d, kernels)]
        full = sorted((r for r in mine if r["method"] == "full"), key=lambda r: r["window"])
        axes[0].plot([r["window"] for r in full], [r["predicted_bytes"] / 1e9 for r in full], color="tab:red",
                     marker=marker, fillstyle="none", linestyle=":", label=f"full-length, planner ({short})")
        done = [r for r in full if "peak_bytes" in r]
        for ax, key, scale in ((axes[0], "peak_bytes", 1e9), (axes[1], "seconds_per_update", 1)):
            ax.plot([r["window"] for r in done], [r[key] / scale for r in done], color="tab:red", marker=marker,
                    label=f"full-length, measured ({short})")
            for r in (r for r in mine if r["method"] == "pose" and "peak_bytes" in r):
                ax.plot([windows[0], windows[-1]], [r[key] / scale] * 2, color="tab:blue", linestyle="--",
                        linewidth=1, marker=marker, markevery=[1])
                ax.annotate(f"PoSE, {r['window'] // 1024}k window", (windows[0] if i % 2 == 0 else windows[1],
                            r[key] / scale), fontsize=7, xytext=(2, 3), textcoords="offset points", color="tab:blue")
    for ax, label in ((axes[0], "peak memory per update (GB)"), (axes[1], "seconds per update")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        ax.set_xticks(windows, [f"{w // 1024}k" for w in windows])
        ax.set_xlabel("target context (full-length trains on it)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Fine-tuning SmolLM2-135M: full-length against PoSE (LoRA rank 16, 1 row per update)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"method:window list (default {DEFAULT_CONFIGS})")
    p.add_argument("--steps", type=int, default=3, help="updates per configuration; the first is not timed (default 3)")
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations (both methods alike)")
    p.add_argument("--work", type=Path, default=Path("out/real_model"), help="corpus, token cache and logs")
    p.add_argument("--docs", type=Path, default=DOCS, help="the reST sources (default %(default)s)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: stop the running configuration when spent (recorded from its updates, two or more)")
    p.add_argument("--plot-only", action="store_true", help="only draw cost.png from the committed records")
    p.add_argument("--skip-recorded", action="store_true",
                   help="leave out the configurations this device's file already records (measured, or planned not to "
                        "fit): a run that a budget stopped goes on with the rest")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the first update is not timed")
    if not args.plot_only:
        set_budget(args.budget)
        gguf = model_file()
        data = joined_corpus(args.docs, gguf, args.work, 32768)
        path = device_file()
        kept = json.loads(path.read_text())["records"] if path.is_file() else []
        for method, window in parse_configs(args.configs):
            if args.skip_recorded and recorded(kept, method, window, args.grad_checkpoint):
                continue
            try:
                record = measure(method, window, gguf, data, args.work, args.steps, args.grad_checkpoint)
            except OutOfTime as stop:
                print(stop, file=sys.stderr)
                break
            kept = [r for r in kept if (r["method"], r["window"], r["grad_checkpoint"]) !=
                    (method, window, args.grad_checkpoint)] + [record]
            write_results("cost_curve", {"records": kept}, path)
            print(json.dumps(record), flush=True)
            if "stopped_early" in record:
                break
    drawn = plot(REAL_MODEL / "cost.png")
    print(f"drew {drawn}" if drawn else "nothing measured yet to draw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
