"""Why does the simulator's PoSE model lose the passkey (claim c)? PoSE fine-tuning of the simulator's base model
(`--sim`, default out/sim: its pretrained model and corpus) with one setting changed at a time — the schedule, the
share of retrieval documents in the fine-tuning data, the number of updates, the learning rate — and passkey
accuracy at Lc ... Lt (20 trials per length, the grid's seed) of each. Two controls fine-tune full-length at
Lt = 2 Lc with the same data, updates and tokens per update, once without position scaling and once with PI:
if the first keeps the passkey at Lc and the second loses it, the fine-tuning recipe does not erase retrieval,
the interpolated positions do.

    python -m experiments.sim_passkey_ablation [--sim out/sim] [--only NAME ...]

Every PoSE variant is `pose_mlx.finetune --full --sampler pose` as in the grid (32 x 128 tokens per update,
warm-up a tenth of the updates); the controls use 16 x 256 tokens. Each is followed by `pose_mlx.passkey`; both are
cached under <sim>/ablation/, so a rerun resumes. Writes benchmarks/results/sim_passkey_ablation.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, sim_pretrained, write_results

#: name: (schedule, retrieval share of the fine-tuning documents, updates, peak lr, sampler, target / Lc), each one
#: change from the grid's PoSE runs (pose-linear, pose-yarn: 0.1, 150, 2e-4), whose passkey is read from <sim>/eval.
VARIANTS = {
    "linear-r0.3": ("linear", 0.3, 150, 2e-4, "pose", None),
    "linear-600": ("linear", 0.1, 600, 2e-4, "pose", None),
    "linear-lr5e-5": ("linear", 0.1, 150, 5e-5, "pose", None),
    "yarn-r0.3": ("yarn", 0.3, 150, 2e-4, "pose", None),
    "control-full-none-2x": ("none", 0.1, 150, 2e-4, "full", 2),
    "control-full-linear-2x": ("linear", 0.1, 150, 2e-4, "full", 2),
}


def main(argv=None) -> int:
    from pose_mlx.sim import finetune_data  # pose_mlx first: it loads the optimized BLAS before MLX starts
    from mlx_lm.utils import load_tokenizer
    from pose_mlx.sim.config import SimConfig
    from pose_mlx.sim.grid import Run, evaluate_passkey, finetune_args, run_finetune
    from pose_mlx.training.data import required_length

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", default="out/sim", help="the simulator's --out folder (its pretrained model and corpus)")
    p.add_argument("--only", action="append", choices=list(VARIANTS), help="run only these variants (repeatable)")
    p.add_argument("--trials", type=int, default=20, help="passkey trials per length (default 20)")
    args = p.parse_args(argv)
    config, sim = SimConfig(), Path(args.sim)
    model, work = sim_pretrained(sim, "sim_passkey_ablation"), sim / "ablation"
    lengths = config.lengths
    output_json = RESULTS_DIR / "sim_passkey_ablation.json"
    t0 = time.time()  # variants not run this time keep their recorded results
    recorded = json.loads(output_json.read_text()) if output_json.is_file() else {}
    results = {name: {"sampler": "pose", "target": config.target, **v}  # recorded before the controls existed
               for name, v in recorded.get("variants", {}).items()}
    for name in ("pose-linear", "pose-yarn"):
        own = sim / "eval" / f"{name}.passkey.json"
        if own.is_file():
            results[name] = {"schedule": name.split("-")[1], "retrieval_share": config.finetune_retrieval,
                             "steps": config.steps, "lr": config.lr, "grid_run": True,
                             "passkey": {str(a["length"]): a["accuracy"]
                                         for a in json.loads(own.read_text())["accuracy"]}}
    for name in args.only or list(VARIANTS):
        schedule, share, steps, lr, sampler, factor = VARIANTS[name]
        run = Run(name, name, sampler, schedule, factor=factor)
        length = required_length(config.window, (factor or config.factor) * config.window, sampler, run.content)
        data = finetune_data.build(work / "data" / f"r{share:g}" / str(length), sim / "corpus" / "train",
                                   load_tokenizer(model), sim / "cache", length, share, config.seed)
        folder, output = work / "runs" / name, work / f"{name}.passkey.json"
        if not (folder / "config.json").is_file():  # full-length: as many tokens per update as PoSE's 32 x Lc
            run_finetune(finetune_args(run, model, data, sim / "cache", folder, window=config.window,
                                       factor=config.factor, steps=steps, cost_steps=steps,
                                       full_batch=config.full_batch * config.factor // (factor or config.factor),
                                       lr=lr, seed=config.seed))
        if not output.is_file():
            evaluate_passkey(folder, lengths, args.trials, config.seed, output)
        log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
        results[name] = {"schedule": schedule, "retrieval_share": share, "steps": steps, "lr": lr,
                         "sampler": sampler, "target": (factor or config.factor) * config.window,
                         "final_loss": log[-1]["loss"],
                         "passkey": {str(a["length"]): a["accuracy"]
                                     for a in json.loads(output.read_text())["accuracy"]}}
        print(name, results[name]["passkey"], flush=True)
    path = write_results("sim_passkey_ablation", {"sim": str(sim), "trials": args.trials, "variants": results,
                                                  "wall_seconds": recorded.get("wall_seconds", 0) + time.time() - t0},
                         output_json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
