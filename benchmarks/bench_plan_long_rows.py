"""The memory planner on long rows: checkpointed LoRA steps where attention scores and a large vocabulary dominate.

    python -m benchmarks.bench_plan_long_rows [--workdir DIR] [--runs INDICES] [--report-only]

bench_plan.py's runs have at most 4k rows and vocabularies of at most 2,048 pieces; the real model's cost curve
(bench_cost_curve.py) found the planner 20% low at full-length 8k, where a score matrix is 2.4 GB and a float32
logits array 1.6 GB. Here each configuration is bench_plan.py's measurement (a real `python -m pose_mlx.finetune
--steps 3` in its own process; measured = the largest `peak_memory_gb` of its log): LoRA rank 16 on every block,
gradient checkpointing, one full-length row of 2k-8k input tokens, on random llamas with SmolLM2-135M's block
(hidden 576, 9 query and 3 key-value heads, head dim 64, intermediate 1536, float32) at 2, 6 and 12 blocks, with a
512-piece vocabulary or SmolLM2's 49,152 (the same tokenizer; only the embedding grows), compiled and eager,
through MLX's own attention and loss (`--kernels mlx`: what `memory.COUNTS` models, and what every GPU but Metal
trains), and the same rows, with two of 16k, through pose_mlx's kernels on the CPU (`--kernels auto`: the fused C++
attention, RMSNorm and rotary kernels, the chunked loss; what `memory.training.FUSED_CPU_COUNTS` models).

Measurements are appended to `results/plan_long_rows.jsonl` as they finish (a run resumes from it). Predictions
are made afterwards by today's planner from each model's config.json alone, and the real model's measured
cost-curve records (`results/real_model/cost/*.json`: SmolLM2-135M-Instruct, Q4_1 GGUF) are planned again beside
them: none of them was used to fit `memory.COUNTS`. `--report-only` only predicts. Writes
`results/plan_long_rows.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from benchmarks import bench_plan
from experiments.bench_cost_curve import COST, finetune_args
from benchmarks.common import RESULTS_DIR, model_file, write_results
from pose_mlx import memory, toy
from pose_mlx import plan as planner

RAW = RESULTS_DIR / "plan_long_rows.jsonl"
BLOCK = dict(hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536)
LARGE_VOCAB = 49152
# (blocks, vocabulary, input tokens per row, compiled)
SHAPES = [
    (2, 512, 2048, True), (2, 512, 4096, True), (2, 512, 6144, True), (6, 512, 4096, True), (2, 512, 8192, True),
    (2, 512, 4096, False), (2, LARGE_VOCAB, 4096, True), (2, LARGE_VOCAB, 8192, True), (2, LARGE_VOCAB, 4096, False),
    (6, 512, 8192, True), (12, 512, 4096, True), (2, LARGE_VOCAB, 8192, False),
]
# (blocks, vocabulary, input tokens per row, compiled, --kernels)
RUNS = [(*s, "mlx") for s in SHAPES] + [(*s, "auto") for s in SHAPES] \
    + [(2, 512, 16384, True, "auto"), (2, LARGE_VOCAB, 16384, True, "auto")]
#: added once the runs above were seen (2026-11-29): the kernels' per-block slope changed between 2, 6 and 12
#: blocks, and the eager runs had one block count only
RUNS += [(24, 512, 4096, True, "auto"), (6, 512, 4096, False, "auto"), (12, 512, 4096, False, "auto")]


def model_folder(work: Path, blocks: int, vocab: int) -> Path:
    """A random llama with SmolLM2-135M's block: the 512-piece tokenizer trained once, shared by every folder."""
    folder = work / f"smol-{blocks}-v{vocab}"
    if (folder / "config.json").is_file():
        return folder
    first = work / "smol-2-v512"
    if vocab == 512:
        source = {"tokenizer_from": first} if (first / "config.json").is_file() else {"vocab_size": 512}
        return toy.make_model_folder(folder, num_layers=blocks, max_position_embeddings=8192, **BLOCK, **source)
    from pose_mlx.model.source import build_model

    small = model_folder(work, blocks, 512)
    config = {**json.loads((small / "config.json").read_text()), "vocab_size": vocab}
    folder.mkdir(parents=True)
    toy.copy_tokenizer(small, folder)
    return toy.save_model_folder(build_model(config, 0), config, folder, folder)


def flags(folder: Path, rows: int, compiled: bool, kernels: str, work: Path, index: int) -> list[str]:
    """finetune's flags: full-length rows of `rows` inputs (target rows + 1), LoRA rank 16, checkpointing."""
    run = (folder.name, 1024, rows + 1, "full", 1, False, True, compiled, ["--lora-rank", "16", "--kernels", kernels])
    return bench_plan.finetune_flags(folder, run, work, index)


def measure(work: Path, indices) -> None:
    """Run the configurations not yet in RAW, appending each measurement as it finishes."""
    done = {tuple(r["run"]) for r in raw_records()}
    for i in indices:
        if tuple(RUNS[i]) in done:
            continue
        blocks, vocab, rows, compiled, kernels = RUNS[i]
        folder = model_folder(work, blocks, vocab)
        argv = flags(folder, rows, compiled, kernels, work, i)
        assert planner.planned_run(argv)[3] == settings_of(rows, compiled, kernels), "the planner reads the flags otherwise"
        measured = bench_plan.measure_training(argv, work, i)
        config = json.loads((folder / "config.json").read_text())
        record = {"run": list(RUNS[i]), "config": config, **measured}
        with RAW.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[{i}] {blocks} blocks, vocabulary {vocab}, {rows} rows, compiled={compiled}, kernels {kernels}: "
              f"{memory.format_size(measured['measured_bytes'])} ({measured['seconds']} s)", flush=True)


def raw_records() -> list[dict]:
    """The measurements, each `run` as in RUNS (the first ones were recorded before --kernels was a column: mlx)."""
    records = [json.loads(line) for line in RAW.read_text().splitlines() if line.strip()] if RAW.is_file() else []
    return [{**r, "run": r["run"] + ["mlx"] * (len(r["run"]) == 4)} for r in records]


def settings_of(rows: int, compiled: bool, kernels: str) -> memory.TrainSettings:
    """The memory model's view of `flags`: what `pose_mlx.plan` derives from them."""
    return memory.TrainSettings(window=1024, target=rows + 1, sampler="full", lora_rank=16, grad_checkpoint=True,
                                compile=compiled, kernels=kernels)


def predicted_row(record: dict) -> dict:
    blocks, vocab, rows, compiled, kernels = record["run"]
    settings = settings_of(rows, compiled, kernels)
    estimate = memory.training_memory(record["config"], settings)
    return {"blocks": blocks, "vocab": vocab, "rows": rows, "compiled": compiled, "kernels": kernels,
            "config": record["config"], "settings": dataclasses.asdict(settings),
            "measured_bytes": record["measured_bytes"], "predicted_bytes": estimate.peak, "phase": estimate.phase,
            "error": estimate.peak / record["measured_bytes"] - 1,
            "score_matrix_bytes": estimate.details["score_matrix_bytes"],
            "logits_bytes": estimate.details["logits_bytes"],
            "seconds": record["seconds"]}


def real_model_rows() -> tuple[list[dict], list[dict]]:
    """The real model's cost-curve records planned again by today's planner (the flags they ran with): those
    measured, and those not run because the planner of their day said they do not fit."""
    measured, unmeasured = [], []
    for path in sorted(COST.glob("*.json")):
        for r in json.loads(path.read_text())["records"]:
            argv = finetune_args(r["method"], r["window"], model_file(), COST, COST, 3, r["grad_checkpoint"],
                                 r.get("kernels", "mlx"))
            _s, ref, config, settings = planner.planned_run(argv)
            arch = memory.loaded_architecture(config, ref, settings.backend)
            now = memory.training_memory(arch, settings).peak
            config = {**config, "torch_dtype": arch.dtype}  # as loaded: the GGUF file dequantized to float32
            assert memory.training_memory(config, settings).peak == now
            row = {"record": str(path.relative_to(RESULTS_DIR)), "method": r["method"], "window": r["window"],
                   "config": config, "settings": dataclasses.asdict(settings), "predicted_then": r["predicted_bytes"],
                   "predicted_bytes": now}
            if not r.get("peak_bytes"):
                unmeasured.append(row)
                continue
            measured.append({**row, "measured_bytes": r["peak_bytes"], "error": now / r["peak_bytes"] - 1,
                             "error_then": r["predicted_bytes"] / r["peak_bytes"] - 1})
    return measured, unmeasured


def report() -> Path:
    rows = [predicted_row(r) for r in raw_records()]
    real, unmeasured = real_model_rows() if model_file().is_file() else ([], [])
    errors = [r["error"] for r in rows + real]
    summary = {"runs": len(rows), "real_model_runs": len(real), "max_abs_error": max(map(abs, errors)),
               "lowest_error": min(errors), "within_10pct": sum(abs(e) <= 0.10 for e in errors)}
    path = write_results("plan_long_rows", {"description": __doc__.split("\n")[0], "raw": RAW.name,
                                            "runs": rows, "real_model": real, "real_model_unmeasured": unmeasured,
                                            "summary": summary})
    for r in rows:
        print(f"{r['blocks']:>2} blocks v{r['vocab']:<6} {r['rows']:>5} rows compiled={r['compiled']!s:5} "
              f"{r['kernels']:4}: predicted "
              f"{memory.format_size(r['predicted_bytes'])} ({r['phase']}), measured "
              f"{memory.format_size(r['measured_bytes'])}, {100 * r['error']:+.1f}%")
    for r in real:
        print(f"real model {r['method']} {r['window']}: {100 * r['error_then']:+.1f}% then, "
              f"{100 * r['error']:+.1f}% now")
    for r in unmeasured:
        print(f"real model {r['method']} {r['window']}, not measured: {r['predicted_then'] / 1e9:.0f} GB planned then, "
              f"{r['predicted_bytes'] / 1e9:.0f} GB now")
    print(json.dumps(summary), f"\nwrote {path}")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=None, help="where model folders and runs go (default: a temporary folder)")
    parser.add_argument("--runs", default=None, help="comma-separated indices of RUNS to measure (default: all)")
    parser.add_argument("--report-only", action="store_true", help="measure nothing: predict the recorded runs")
    args = parser.parse_args(argv)
    if not args.report_only:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plan-long-"))
        work.mkdir(parents=True, exist_ok=True)
        measure(work, [int(i) for i in args.runs.split(",")] if args.runs else range(len(RUNS)))
    report()


if __name__ == "__main__":
    main()
