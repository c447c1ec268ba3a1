"""Peak memory of training steps on `pose_mlx.kernels`' path, over many small shapes: the data the planner's
counts for that path are fitted to (`pose_mlx.memory.training.BLOCKED_COUNTS`).

Each run is its own process: a random-weight llama of the run's shape (`pose_mlx.toy.model_config`), PoSE-extended
8x, LoRA rank 8 on every block or all weights trained, then 3 updates of `pose_mlx.training.loop.make_update` on
random rows, evaluated as the training loop evaluates them; measured = MLX's peak over the 3 updates (as the
training log records it), with the bytes of the weights and the optimizer state beside it. The shapes are drawn
with a fixed seed: 1-12 blocks, hidden 32-512, windows 128-4096, batch 1-4 (at most 8k tokens an update), vocabularies 256-32768, GQA or not,
every (LoRA, compiled, checkpointed) mode. `--report-only` compares the recorded runs with today's planner.

Appends to results/plan_sweep.jsonl (one line per run, resumable); writes results/plan_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, child_env, write_between, write_results

RAW = RESULTS_DIR / "plan_sweep.jsonl"

CHILD = r"""
import json, sys
import numpy as np
import pose_mlx
import mlx.core as mx
from pose_mlx import extend, use_positions
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config
from pose_mlx.training.lora import LoraSpec, add_lora
from pose_mlx.training.loop import TrainConfig, _enable_grad_checkpoint, make_optimizer, make_update

run = json.loads(sys.argv[1])
config = model_config(run["vocab"], hidden_size=run["hidden"], num_layers=run["layers"], num_heads=run["heads"],
                      num_kv_heads=run["kv_heads"], intermediate_size=run["intermediate"],
                      max_position_embeddings=run["window"])
model = build_model(config, seed=0)
extend(model, "yarn", run["window"], 8 * run["window"])
if run["lora"]:
    add_lora(model, LoraSpec(rank=8, scale=20.0, num_layers=-1), seed=0)
else:
    model.unfreeze()
mx.eval(model.parameters())
train = TrainConfig(steps=3, warmup=1, compile=run["compile"], grad_checkpoint=run["checkpoint"], progress=False)
if run["checkpoint"]:
    _enable_grad_checkpoint(model)
optimizer = make_optimizer(train)
update = make_update(model, optimizer, train, use_positions)

class Batch:
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        rows, length = run["batch"], run["window"] - 1
        tokens = rng.integers(0, run["vocab"], size=(rows, length + 1)).astype(np.int32)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.mask = np.ones((rows, length), np.float32)
        self.positions = np.sort(rng.choice(8 * run["window"], size=(rows, length), replace=False), axis=1)

weights = mx.get_active_memory()
mx.reset_peak_memory()
for step in range(train.steps):
    update(iter([Batch(step)]))
print(json.dumps({"peak_bytes": mx.get_peak_memory(), "weights_bytes": weights}))
"""


def shapes(count: int, seed: int) -> list[dict]:
    """`count` runs of random shapes (module docstring), every mode in turn."""
    rng = random.Random(seed)
    modes = [(lora, compiled, checkpoint) for lora in (True, False) for compiled in (True, False)
             for checkpoint in (False, True)]
    runs = []
    for i in range(count):
        lora, compiled, checkpoint = modes[i % len(modes)]
        heads = rng.choice([2, 4, 6, 8])
        head_dim = rng.choice([16, 32, 64])
        hidden = heads * head_dim
        runs.append({
            "index": i, "lora": lora, "compile": compiled, "checkpoint": checkpoint,
            "layers": rng.choice([1, 2, 4, 8, 12]), "hidden": hidden, "heads": heads,
            "kv_heads": rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
            "intermediate": rng.choice([2, 3, 4]) * hidden, "vocab": rng.choice([256, 2048, 8192, 32768]),
            "window": rng.choice([128, 256, 512, 1024, 2048, 4096]), "batch": rng.choice([1, 2, 4]),
        })
        runs[-1]["batch"] = max(1, min(runs[-1]["batch"], 8192 // runs[-1]["window"]))  # at most 8k tokens a row
    return runs


def measure(run: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(run)], capture_output=True, text=True,
                         env=child_env())
    if out.returncode:
        return {**run, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return {**run, **json.loads(out.stdout.strip().splitlines()[-1])}


def predicted(run: dict) -> int:
    from pose_mlx import memory
    from pose_mlx.toy import model_config

    config = model_config(run["vocab"], hidden_size=run["hidden"], num_layers=run["layers"], num_heads=run["heads"],
                          num_kv_heads=run["kv_heads"], intermediate_size=run["intermediate"],
                          max_position_embeddings=run["window"])
    settings = memory.TrainSettings(window=run["window"], target=8 * run["window"], batch_size=run["batch"],
                                    lora=run["lora"], grad_checkpoint=run["checkpoint"], compile=run["compile"])
    return memory.training_memory(config, settings).peak


def records() -> list[dict]:
    return [json.loads(line) for line in RAW.read_text().splitlines() if line.strip()] if RAW.exists() else []


def markdown(rows: list[dict]) -> str:
    """docs/memory.md's table: per mode, the runs and the planner's errors on them."""
    lines = ["| training | compiled | checkpointing | runs | median error | largest errors |", "|---|---|---|---|---|---|"]
    for lora in (True, False):
        for compiled in (True, False):
            for checkpoint in (False, True):
                errors = sorted(r["error"] for r in rows
                                if (r["lora"], r["compile"], r["checkpoint"]) == (lora, compiled, checkpoint))
                if not errors:
                    continue
                lines.append(f"| {'LoRA' if lora else 'full'} | {'yes' if compiled else 'no'} | "
                             f"{'on' if checkpoint else 'off'} | {len(errors)} | "
                             f"{statistics.median(abs(e) for e in errors):.1%} | {errors[0]:+.1%} .. {errors[-1]:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=96, help="runs (every mode in turn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-only", action="store_true", help="measure nothing: predict the recorded runs")
    args = parser.parse_args(argv)
    if not args.report_only:
        done = {r["index"] for r in records()}
        for run in shapes(args.count, args.seed):
            if run["index"] in done:
                continue
            result = measure(run)
            with open(RAW, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)
    rows = [r for r in records() if "peak_bytes" in r]
    for r in rows:
        r["predicted_bytes"] = predicted(r)
        r["error"] = r["predicted_bytes"] / r["peak_bytes"] - 1
    errors = [abs(r["error"]) for r in rows]
    summary = {"runs": len(rows), "within_10_percent": sum(e <= 0.10 for e in errors),
               "median_abs_error": statistics.median(errors) if errors else None,
               "worst": max(rows, key=lambda r: abs(r["error"])) if rows else None}
    print(write_results("plan_sweep", {"summary": summary, "runs": rows}))
    write_between(ROOT / "docs" / "memory.md", "blocked-plan", markdown(rows))


if __name__ == "__main__":
    main()
