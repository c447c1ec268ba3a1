"""Why is the simulator's PoSE further from full-length at Lt than the paper's (claim b)? Three fine-tunings of the
simulator's base (`--sim`, default out/sim: its pretrained model and corpus) at Lt = 8 Lc, PI (linear), 150
updates, lr 2e-4, 10% retrieval documents, as in the grid:

- `full`: full-length, 4 x Lt tokens per update (the grid's full-length run);
- `pose-equal-tokens`: PoSE, 32 x Lc tokens per update (the grid's PoSE run: as many tokens as `full`);
- `pose-equal-sequences`: PoSE, 4 x Lc tokens per update (the paper's protocol: as many sequences as `full`).

Each is scored with the grid's sliding-window perplexity at Lc ... Lt and with `pose_mlx.sim.gates.far_attention`
on the first Lt tokens of the same test documents: where the last Lc / 2 queries put their attention (the share on
distances >= Lc, unseen in PoSE's training windows too, and the largest logit there minus the largest at seen
distances). The base is scored the same way for reference.

    python -m experiments.sim_pose_gap [--sim out/sim] [--output benchmarks/results/sim_pose_gap.json]

Runs and evaluations are cached under <sim>/ablation/; writes benchmarks/results/sim_pose_gap.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import sim_pretrained, write_results

#: name: (sampler, sequences per update)
VARIANTS = {"full": ("full", 4), "pose-equal-tokens": ("pose", 32), "pose-equal-sequences": ("pose", 4)}


def main(argv=None) -> int:
    from pose_mlx.sim import finetune_data, gates  # pose_mlx first: it loads the optimized BLAS before MLX starts
    from mlx_lm import load
    from mlx_lm.utils import load_tokenizer
    from pose_mlx.sim.config import SimConfig
    from pose_mlx.sim.grid import Run, evaluate_perplexity, finetune_args, run_finetune
    from pose_mlx.training.data import required_length

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", default="out/sim", help="the simulator's --out folder (its pretrained model and corpus)")
    p.add_argument("--output", type=Path, default=None,
                   help="results JSON (default benchmarks/results/sim_pose_gap.json)")
    args = p.parse_args(argv)
    config, sim = SimConfig(), Path(args.sim)
    model, work = sim_pretrained(sim, "sim_pose_gap"), sim / "ablation"
    t0 = time.time()
    tokenizer = load_tokenizer(model)
    docs = gates.test_documents(sim / "corpus" / "test", tokenizer, sim / "cache", config.window)[: config.eval_docs]
    results = {}
    for name, (sampler, batch) in {"base": ("none", 0), **VARIANTS}.items():
        folder = model if name == "base" else work / "runs" / f"gap-{name}"
        if name != "base" and not (folder / "config.json").is_file():
            run = Run(name, name, sampler, "linear")
            length = required_length(config.window, config.target, sampler, run.content)
            data = finetune_data.build(work / "data" / f"r{config.finetune_retrieval:g}" / str(length),
                                       sim / "corpus" / "train", tokenizer, sim / "cache", length,
                                       config.finetune_retrieval, config.seed)
            command = finetune_args(run, model, data, sim / "cache", folder, window=config.window,
                                    factor=config.factor, steps=config.steps, cost_steps=config.steps,
                                    full_batch=1, lr=config.lr, seed=config.seed)
            command[command.index("--batch-size") + 1] = str(batch)
            run_finetune(command)
        output = work / f"gap-{name}.ppl.json"
        if not output.is_file():
            evaluate_perplexity(folder, sim / "corpus" / "test", config.lengths, config.eval_docs,
                                config.eval_stride, output)
        results[name] = {
            "sampler": sampler, "sequences_per_update": batch or None,
            "tokens_per_update": batch * (config.target if sampler == "full" else config.window) or None,
            "ppl": {str(r["length"]): r["ppl"] for r in json.loads(output.read_text())["results"]},
            "far_attention": gates.far_attention_over(load(str(folder))[0], docs, tokenizer.bos_token_id,
                                                      config.window, config.target)}
        print(name, json.dumps(results[name]), flush=True)
    full = results["full"]["ppl"]
    for name in ("pose-equal-tokens", "pose-equal-sequences"):
        results[name]["vs_full"] = {n: v / full[n] - 1 for n, v in results[name]["ppl"].items()}
    path = write_results("sim_pose_gap", {"sim": str(sim), "steps": config.steps, "lr": config.lr,
                                          "target": config.target, "variants": results,
                                          "wall_seconds": time.time() - t0}, args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
