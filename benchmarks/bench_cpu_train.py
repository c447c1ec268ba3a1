"""CPU fine-tuning of SmolLM2-135M: `python -m pose_mlx.finetune` against `mlx_lm lora`, side by side, one run.

    python -m benchmarks.bench_cpu_train [--configs pose-1k,pose-2k,full-8k,full-16k] [--budget SECONDS]
                                         [--report-only]

Both tools run as their real command lines in child processes (`benchmarks.common.run_tool`: the same BLAS, loaded
by `import pose_mlx` in both, its fp32 matmul rate probed in each child) on the same model folder (the GGUF
dequantized to float32 by `python -m pose_mlx.convert`), the same documents (an mlx-lm data folder of Python's
reST documentation joined into ~20k-token documents) and the same rows (1 per update, LoRA rank 8, scale 20, in
every block). The configurations:

    pose-1k / pose-2k   PoSE at a window of 1,024 / 2,048 tokens (8k -> 32k, YaRN); mlx-lm trains rows of the
                        same length at positions 0 .. L-1. No gradient checkpointing in either.
    full-8k / full-16k  one full-length row of 8,192 / 16,384 tokens (`--sampler full`, target = the row, original
                        half of it: the cost does not depend on the scaling); mlx-lm the same row length. Gradient
                        checkpointing in both. mlx-lm runs only where `pose_mlx.plan --kernels mlx` (MLX's own
                        attention and loss, what mlx-lm computes) says the row fits in this machine's memory.
                        mlx-lm validates on no batch here (`--val-batches 0`): it validates before update 1 and
                        within the last, outside the timed span, and one full-length forward costs minutes.

Rounds are interleaved (pose_mlx, mlx-lm, then mlx-lm first in the next round). An update's seconds are the wall
time between consecutive updates' reports, for updates 2 .. steps-1 (the first holds compilation, the last
mlx-lm's final save), median over every timed update of the configuration (pose_mlx's own log's seconds of
those updates are kept beside them, `own_seconds`); tokens/s = row inputs / that; MFU
(PaLM's convention, as bench_mfu) = (6 P T + 12 layers hidden S T) / seconds / peak, T the row's inputs, S its
length, P the parameters (tied embeddings once), peak the fp32 matmul rate this process measures before and after
each configuration (their mean). Peak memory: pose_mlx's log (largest over the updates); mlx-lm's
`mx.get_peak_memory()` at the end of its run; beside pose_mlx's, the peak `pose_mlx.plan` predicts for its command
line (today's planner, at report time). Losses: each tool's per-update training loss.

Each finished (configuration, round, tool) is appended to `results/cpu_train.jsonl` as it completes: a stopped run
(`--budget`, Ctrl-C, a kill) continues where it stopped; `--report-only` rebuilds the record and the plot from it.
Runs added after their configuration's results were seen carry a `stage` label (and later round numbers): they are
summarized apart, under `stages` in the record, and never pooled with the registered rounds.
Writes results/cpu_train.json and results/cpu_train.png.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pose_mlx  # noqa: F401  (the fast BLAS before mlx.core: this process measures the matmul peak)
from benchmarks.common import (DOCS, PEAK, RESULTS_DIR, ROOT, OutOfTime, child_env, matmul_gflops, model_file,
                               periods, run_tool, set_budget, time_left, write_between, write_results)

RAW = RESULTS_DIR / "cpu_train.jsonl"
WORK = Path(tempfile.gettempdir()) / "pose_mlx_bench_cpu_train"
#: name -> (sampler, row tokens, grad checkpoint, steps per run, rounds)
CONFIGS = {
    "pose-1k": ("pose", 1024, False, 6, 3),
    "pose-2k": ("pose", 2048, False, 5, 2),
    "full-8k": ("full", 8192, True, 3, 1),  # one timed update: mlx-lm's took 1,000 s here
    "full-16k": ("full", 16384, True, 3, 1),  # one timed update: about a quarter of an hour
}
RANK, SCALE, DOC_CHARS = 8, 20.0, 90_000
#: stage label -> what it is: runs added after the registered rounds' results were seen
STAGES = {"later-1k": "pose-1k run again 40 minutes after the registered rounds, on the same code, once the machine "
                      "had become faster; not pooled with them"}
MLX_LM_LOSS = re.compile(r"^\s*(\d+)\s+([\d.]+)\s*[\u25bc\u25b2]")


def inputs(work: Path) -> tuple[Path, Path]:
    """The float32 model folder and the mlx-lm data folder (train.jsonl, valid.jsonl), made once."""
    model, data = work / "model", work / "data"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "pose_mlx.convert", str(model_file()), str(model)], check=True,
                       env=child_env())
    if not (data / "train.jsonl").is_file():
        text = "\n\n".join(p.read_text(errors="replace") for p in sorted(Path(DOCS).rglob("*.txt")))
        docs = [text[i:i + DOC_CHARS] for i in range(0, len(text) - DOC_CHARS, DOC_CHARS)][:40]
        data.mkdir(parents=True, exist_ok=True)
        for name, part in (("train", docs[:32]), ("valid", docs[32:])):
            (data / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return model, data


def pose_argv(config: str, model: Path, data: Path, work: Path, kernels: str = "auto") -> list[str]:
    sampler, row, checkpoint, steps, _ = CONFIGS[config]
    original = 8192 if sampler == "pose" else row // 2
    target = 32768 if sampler == "pose" else row
    return ["--model", str(model), "--data", str(data), "--original", str(original), "--target", str(target),
            "--window", str(row if sampler == "pose" else 1024), "--sampler", sampler, "--schedule", "yarn",
            "--lora-rank", str(RANK), "--lora-scale", str(SCALE), "--lora-layers", "-1", "--batch-size", "1",
            "--steps", str(steps), "--warmup", "1", "--lr", "1e-5", "--save-every", "0", "--kernels", kernels,
            "--output", str(work / "pose_out"), "--cache-dir", str(work / "cache"), "--overwrite",
            *(["--grad-checkpoint"] if checkpoint else [])]


def mlx_lm_argv(config: str, model: Path, data: Path, work: Path) -> list[str]:
    _, row, checkpoint, steps, _ = CONFIGS[config]
    (work / "lora.yaml").write_text(f"lora_parameters:\n  rank: {RANK}\n  scale: {SCALE}\n  dropout: 0.0\n")
    return ["--model", str(model), "--train", "--data", str(data), "--fine-tune-type", "lora", "--num-layers", "-1",
            "--batch-size", "1", "--max-seq-length", str(row), "--iters", str(steps), "--learning-rate", "1e-5",
            "--steps-per-report", "1", "--steps-per-eval", "1000000", "--val-batches", "1" if row <= 2048 else "0",
            "--save-every", "1000000",
            "--adapter-path", str(work / "mlx_lm_out"), "--config", str(work / "lora.yaml"),
            *(["--grad-checkpoint"] if checkpoint else [])]


def planned(config: str, model: Path, data: Path, work: Path, kernels: str) -> dict:
    """`pose_mlx.plan --json` for the configuration's command line: its peak and whether it fits here."""
    out = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *pose_argv(config, model, data, work, kernels),
                          "--json"], capture_output=True, text=True, env=child_env())
    if out.returncode:
        raise SystemExit(f"pose_mlx.plan failed: {out.stderr.strip()}")
    plan = json.loads(out.stdout)
    return {"predicted_bytes": plan["peak_bytes"], "fits": plan["fits"]}


def mlx_lm_fits(config: str, model: Path, data: Path, work: Path) -> dict:
    """The plan with `--kernels mlx`: MLX's own attention and loss, as mlx-lm trains."""
    return planned(config, model, data, work, "mlx")


class _Args:
    threads = 0  # BLAS threads left as the library sets them: both tools use the whole machine


def one_run(tool: str, config: str, model: Path, data: Path, work: Path) -> dict:
    """Run `tool` on `config` once; its update seconds, CPU seconds, peak bytes and losses."""
    from benchmarks.common import DRIVER

    steps = CONFIGS[config][3]
    argv = pose_argv(config, model, data, work) if tool == "pose_mlx" else mlx_lm_argv(config, model, data, work)
    result = run_tool([sys.executable, "-c", DRIVER, tool, *argv], tool, _Args(), timeout=time_left(),
                      log=work / "logs" / f"{config}-{tool}.log")
    spans = periods(result["marks"], steps)
    record = {"seconds": spans["wall"], "cpu_seconds": spans["cpu"], "blas_gflops": result["probe"]["gflops"],
              "blas": result["probe"]["library"]}
    if tool == "pose_mlx":
        log = [json.loads(line) for line in (work / "pose_out" / "train_log.jsonl").read_text().splitlines()]
        record.update(peak_bytes=max(r["peak_memory_gb"] for r in log) * 2**30, losses=[r["loss"] for r in log],
                      tokens=log[-1]["tokens"], own_seconds=[r["seconds"] for r in log if 1 < r["step"] < steps])
    else:
        peaks = [int(line[len(PEAK):]) for line in result["stdout"].splitlines() if line.startswith(PEAK)]
        losses = [float(m.group(2)) for m in map(MLX_LM_LOSS.match, result["stdout"].splitlines()) if m]
        record.update(peak_bytes=peaks[-1] if peaks else None, losses=losses)
    return record


def done_runs() -> list[dict]:
    return [json.loads(line) for line in RAW.read_text().splitlines() if line.strip()] if RAW.exists() else []


def by_stage(runs: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """(the registered runs, {stage label: its runs}): a run with a `stage` is never pooled with the registered ones."""
    later: dict[str, list[dict]] = {}
    for run in runs:
        if "stage" in run:
            later.setdefault(run["stage"], []).append(run)
    return [r for r in runs if "stage" not in r], dict(sorted(later.items()))


def measure(configs: list[str], work: Path) -> None:
    """Run what `RAW` does not hold yet, appending each finished run."""
    model, data = inputs(work)
    done = {(r["config"], r["round"], r["tool"]) for r in done_runs()}
    for config in configs:
        fits = mlx_lm_fits(config, model, data, work)
        tools = ["pose_mlx", "mlx_lm"] if fits["fits"] else ["pose_mlx"]
        for round_ in range(CONFIGS[config][4]):
            order = tools if round_ % 2 == 0 else tools[::-1]
            for tool in order:
                if (config, round_, tool) in done:
                    continue
                before = matmul_gflops()
                record = one_run(tool, config, model, data, work)
                record.update(config=config, round=round_, tool=tool, peak_gflops=(before + matmul_gflops()) / 2,
                              mlx_lm_plan=fits)
                with open(RAW, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"{config} round {round_} {tool}: {statistics.median(record['seconds']):.2f} s per update, "
                      f"peak {record['peak_bytes'] / 2**30 if record['peak_bytes'] else float('nan'):.2f} GiB",
                      flush=True)


def model_flops(config: str, model: Path) -> tuple[float, int]:
    """(PaLM's FLOPs of one update, row inputs T) of the model folder's config."""
    import pose_mlx  # noqa: F401
    from pose_mlx.memory import architecture

    arch = architecture(json.loads((model / "config.json").read_text()))
    params = arch.parameter_counts()["total"]
    row = CONFIGS[config][1]
    tokens = row - 1
    return 6 * params * tokens + 12 * arch.layers * arch.hidden * tokens * tokens, tokens


def summary(runs: list[dict], model: Path) -> dict:
    """Per configuration and tool: seconds per update, tokens/s, MFU, peak, losses; and the ratios."""
    out = {}
    for config in CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        flops, tokens = model_flops(config, model)
        entry = {"tokens_per_update": tokens, "flops_per_update": flops}
        for tool in ("pose_mlx", "mlx_lm"):
            theirs = [r for r in mine if r["tool"] == tool]
            if not theirs:
                why = ("not measured: the benchmark was stopped before it (a re-run continues)"
                       if all(r["mlx_lm_plan"]["fits"] for r in mine) else
                       "does not fit: mlx-lm's row needs more than this machine's memory (pose_mlx.plan --kernels mlx)")
                entry[tool] = {"not_run": why} if tool == "mlx_lm" else None
                continue
            seconds = statistics.median(s for r in theirs for s in r["seconds"])
            peak = statistics.mean(r["peak_gflops"] for r in theirs) * 1e9
            entry[tool] = {"seconds_per_update": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak,
                           "peak_gflops": peak / 1e9, "peak_bytes": max((r["peak_bytes"] or 0) for r in theirs) or None,
                           "losses": [r["losses"] for r in theirs], "runs": len(theirs)}
            cpu = [s for r in theirs for s in (r["cpu_seconds"] or [])]
            entry[tool]["cpu_seconds_per_update"] = statistics.median(cpu) if cpu else None
            own = [s for r in theirs for s in r.get("own_seconds", [])]
            entry[tool]["own_seconds_per_update"] = statistics.median(own) if own else None
            entry[tool]["notes"] = [r["note"] for r in theirs if r.get("note")]
        if entry["pose_mlx"]:
            plan = planned(config, model, model, Path(tempfile.gettempdir()), "auto")["predicted_bytes"]
            entry["pose_mlx"].update(planned_bytes=plan, plan_error=plan / entry["pose_mlx"]["peak_bytes"] - 1)
        if isinstance(entry.get("mlx_lm"), dict) and "seconds_per_update" in entry["mlx_lm"]:
            entry["speedup"] = entry["mlx_lm"]["seconds_per_update"] / entry["pose_mlx"]["seconds_per_update"]
        out[config] = entry
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for i, tool in enumerate(("pose_mlx", "mlx_lm")):
        x = [j + (i - 0.5) * 0.38 for j in range(len(configs))]
        for ax, key, scale in ((axes[0], "seconds_per_update", 1), (axes[1], "mfu", 100),
                               (axes[2], "peak_bytes", 2**-30)):
            values = [(results[c].get(tool) or {}).get(key) for c in configs]
            ax.bar([a for a, v in zip(x, values) if v], [v * scale for v in values if v], width=0.38,
                   label="pose_mlx" if tool == "pose_mlx" else "mlx_lm lora")
    for ax, title in zip(axes, ("seconds per update (log)", "MFU, % of the matmul peak", "peak memory, GiB")):
        ax.set_title(title)
        ax.set_xticks(range(len(configs)), configs)
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M LoRA fine-tuning on this CPU: pose_mlx vs mlx_lm lora (no bar: not run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: dict) -> str:
    """docs/cpu-training.md's table: each configuration, both tools."""
    lines = ["| configuration | pose_mlx s/update | mlx_lm lora s/update | speed-up | pose_mlx tokens/s | MFU pose_mlx / "
             "mlx_lm | peak memory pose_mlx / mlx_lm | pose_mlx.plan's peak |", "|---|---|---|---|---|---|---|---|"]
    for config, entry in results.items():
        ours, theirs = entry["pose_mlx"], entry["mlx_lm"]
        ran = "seconds_per_update" in theirs
        own = ours.get("own_seconds_per_update") if ours.get("notes") else None
        own = own if own and abs(own / ours["seconds_per_update"] - 1) > 0.05 else None  # only where they differ
        lines.append("| " + " | ".join([
            config, f"{ours['seconds_per_update']:,.1f}" + (f" ({own:,.1f} alone)" if own else "")
            + ("*" if ours.get("notes") else ""),
            f"{theirs['seconds_per_update']:,.1f}" if ran else theirs["not_run"].split(":")[0],
            f"**{entry['speedup']:.2f}x**" if ran else "",
            f"{ours['tokens_per_s']:,.0f}",
            f"{ours['mfu']:.0%} / {theirs['mfu']:.0%}" if ran else f"{ours['mfu']:.0%} / -",
            f"{ours['peak_bytes'] / 2**30:.2f} / {theirs['peak_bytes'] / 2**30:.2f} GiB" if ran
            else f"{ours['peak_bytes'] / 2**30:.2f} GiB / -",
            f"{ours['planned_bytes'] / 2**30:.2f} GiB ({ours['plan_error']:+.0%})"]) + " |")
    notes = [f"{config}: {note}" for config, entry in results.items() for note in entry["pose_mlx"].get("notes", [])]
    return "\n".join(lines + [""] + [f"\\* {note}" for note in notes]) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    parser.add_argument("--budget", type=float, help="stop (keeping what finished) after this many seconds")
    parser.add_argument("--work", type=Path, default=WORK, help="model, data and run folders (kept for a re-run)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the record and plot from the .jsonl")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",")]
    if unknown := [c for c in configs if c not in CONFIGS]:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    set_budget(args.budget)
    if not args.report_only:
        try:
            measure(configs, args.work)
        except (OutOfTime, TimeoutError) as stopped:
            print(f"stopped: {stopped}; run again to continue", file=sys.stderr)
    model, _ = inputs(args.work)
    registered, later = by_stage(done_runs())
    results = summary(registered, model)
    stages = {label: {"about": STAGES.get(label, ""), "configs": summary(runs, model)} for label, runs in later.items()}
    from pose_mlx.kernels import build

    build.load()
    kernels = {k: v for k, v in build.status.items() if k != "path"}  # a record names no folder of this machine
    print(write_results("cpu_train", {"configs": results, "stages": stages, "kernels": kernels, "rank": RANK,
                                      "scale": SCALE}))
    plot(results, RESULTS_DIR / "cpu_train.png")
    write_between(ROOT / "docs" / "cpu-training.md", "cpu-train", markdown(results))


if __name__ == "__main__":
    main()
