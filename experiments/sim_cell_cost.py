"""Cells of the simulator's factor map trained both ways on this machine: before (`--kernels mlx`) and after (auto).

    python -m experiments.sim_cell_cost [--cells pose-yarn-8x,full-yarn-8x] [--steps 20] [--out DIR]

Each cell's fine-tuning stage is the map's (`pose_mlx.sim.map`: its run, batch, data, seed 0, on the default
simulator run's corpus and shipped base), with `--steps` updates instead of the map's, once through MLX's own
attention and loss and once through `pose_mlx.kernels`, one after the other. Each run's log gives the seconds per
update (median, the first update left out) and the peak memory; the projected stage is that times the map's
updates. The map's recorded stage time (benchmarks/results/sim_map/results.json, measured on another machine)
is kept beside it for reference. Writes benchmarks/results/sim_cell_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_results

MAP_RESULTS = RESULTS_DIR / "sim_map" / "results.json"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="pose-yarn-8x,full-yarn-8x", help="METHOD-Fx cells of the map")
    parser.add_argument("--steps", type=int, default=20, help="updates per run (the first is not timed)")
    parser.add_argument("--out", default="out/sim-cell-cost", help="the simulator's working folder")
    args = parser.parse_args(argv)
    wanted = [c.strip() for c in args.cells.split(",")]
    malformed = [c for c in wanted if not re.fullmatch(r"[a-z-]+-\d+x", c)]
    if malformed or args.steps < 2:
        parser.error(f"--cells: {', '.join(malformed)} is not METHOD-Fx (e.g. pose-yarn-8x)" if malformed else
                     "--steps: at least 2 (the first update is not timed)")

    import pose_mlx  # noqa: F401  (the fast BLAS before mlx.core)
    from pose_mlx.sim import map as sim_map
    from pose_mlx.sim.grid import cost, finetune_settings, run_finetune
    from pose_mlx.sim.map_layout import cells, grid_run
    from pose_mlx.sim.workspace import finetune_folder, start
    from pose_mlx.training.data import required_length

    factors = sorted({int(c.rsplit("-", 1)[1].rstrip("x")) for c in wanted})
    config = sim_map.parse_config(["--out", args.out, "--factors", ",".join(map(str, factors)), "--seeds", "0",
                                   "--check-against", "none"])
    ws, _gates = start(config.sim, sim_map.weights(config))
    recorded = json.loads(MAP_RESULTS.read_text())["stage_seconds"] if MAP_RESULTS.is_file() else {}
    c, results = config.sim, {}
    for factor in factors:
        for cell in cells(config, ws.out, factor, 0):
            if cell.name not in wanted:
                continue
            run = grid_run(config, cell.method)
            length = required_length(c.window, factor * c.window, run.sampler, run.content)
            folders = {n: finetune_folder(ws, n) for n in (c.window, factor * c.window)}  # as the map builds them
            data = folders.get(length, ws.data / "train")
            entry = {"map_updates": c.steps, "map_stage_seconds_recorded": recorded.get(cell.stage)}
            for kernels in ("mlx", "auto"):
                folder = ws.out / "cost" / f"{cell.name}-{kernels}"
                shutil.rmtree(folder, ignore_errors=True)
                invocation = finetune_settings(run, ws.model, data, ws.cache, folder, window=c.window, factor=factor,
                                               steps=args.steps, cost_steps=args.steps,
                                               full_batch=config.full_batch(factor), lr=c.lr, seed=0)
                settings = dataclasses.replace(invocation.settings, kernels=kernels)
                run_finetune(dataclasses.replace(invocation, settings=settings))
                measured = cost(folder)
                entry[kernels] = {**measured, "projected_stage_seconds": measured["seconds_per_step"] * c.steps}
                print(cell.name, kernels, json.dumps(entry[kernels]), flush=True)
            entry["speedup"] = entry["mlx"]["seconds_per_step"] / entry["auto"]["seconds_per_step"]
            results[cell.name] = entry
    missing = sorted(set(wanted) - set(results))
    if missing:
        parser.error(f"--cells: no such cell in the map: {', '.join(missing)}")
    print(write_results("sim_cell_cost", {"cells": results, "steps": args.steps}))


if __name__ == "__main__":
    main()
