"""`python -m pose_mlx.sim.map`: the simulator's factor map, resumable.

Six methods, under the real model's names, at each factor f of `--factors` (Lt = f Lc) with each seed of
`--seeds`, on the default simulator run's corpus, base and gates (`pose_mlx.sim.workspace`: the shipped base is
copied, not re-trained, when it was made alike):

- `yarn`, `dynamic`: the schedule alone, no training (the grid's `only-yarn`, `only-dynamic`: a `--sampler none`
  run exported with the schedule at target f);
- `adapt-yarn`, `adapt-dynamic`: ONE ordinary fine-tuning per seed (the grid's `adapt`: `--sampler plain
  --schedule none`, positions 0 .. Lc-1; it does not depend on f), extended at load by the evaluators with
  `--schedule yarn|dynamic --target <f>x`;
- `pose-yarn`: PoSE + YaRN fine-tuning to target f Lc; `full-yarn`: full-length + YaRN fine-tuning to f Lc.

The training recipe is the grid's (`SimConfig`: 150 updates, lr 2e-4, 10% retrieval documents of each method's
example length, full fine-tuning), with the window methods (PoSE, plain) at a fixed B = `window_batch`
(32) sequences of Lc tokens per update at every factor, and full-length at the same tokens per update,
B / f sequences of Lt. At the grid's factor (8) this is the grid's setting, so the seed-0 numbers there must equal
the grid's (`pose_mlx.sim.map_report.reproduction`, printed as soon as they are measured, first of all).

Evaluations at Lt only: the grid's perplexity (token-weighted sliding windows Lc / 2 apart over the first
`eval_docs` test documents; it does not depend on the seed for the training-free methods, so they are scored
once per factor) and passkey with `passkey_trials` trials per seed (the trials' seed is the run's seed). The
passkey evaluator draws the trials of its lengths in order from one generator, so the run asks it for the grid's
lengths (those of Lc .. Lt the prompt fits) and keeps Lt's: its trials are then exactly the grid's at that
length, for a few seconds of short prompts. Every stage is cached in --out; results.json, passkey.png and ppl.png
are written there at the end (`--report DIR` writes them from what --out holds, running nothing).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from . import map_report
from .config import QUICK, SimConfig, validate
from .grid import evaluate_passkey, evaluate_perplexity, finetune_settings, load_schedule, run_finetune
from .map_layout import FACTORS, GRID_RESULTS, SEEDS, Cell, MapConfig, blocks, cells, grid_run
from .workspace import Workspace, finetune_folder, start
from ..errors import ArgumentParser, UserError, command
from ..places import check_output
from ..training.data import required_length

#: --quick's factors: its window methods train on 8 sequences per update, so full-length has 8 / f of them.
QUICK_FACTORS = (2, 4, 8)


def _attention(factor: int) -> float:
    """Cost of a full-length token at Lt = f Lc relative to the grid's at 8x (measured there: 2.6x a window
    token's), growing with the keys attended."""
    return (1 + 0.2 * factor) / 2.6


def weights(config: MapConfig) -> dict[str, float]:
    """Estimated work of each stage, in the grid's units (`pose_mlx.sim.__main__._weights`: about 1.6e-4 s per
    trained token, the same per evaluation unit), in the order the stages run: ETA = seconds per unit x units."""
    c = config.sim
    tokens = config.sim.window_batch * c.window * c.steps
    w = {"corpus": 0.002 * c.pretrain_steps * c.pretrain_batch * c.window + 1,
         "pretrain": c.pretrain_steps * c.pretrain_batch * c.window,
         "gates": 1.5 * c.test_docs * c.test_tokens + 1}
    for seed, factor in blocks(config):
        target = factor * c.window
        for length in (c.window, target):
            w.setdefault(f"finetune data {length}", c.finetune_retrieval * c.steps * length + 1)
        for cell in cells(config, Path(), factor, seed):
            sampler = grid_run(config, cell.method).sampler
            work = 1 if sampler == "none" else tokens * (2.6 * _attention(factor) if sampler == "full" else 1)
            w.setdefault(cell.stage, work)
            scored = c.eval_docs * c.test_tokens * target / c.eval_stride / 2 * 2.6 * _attention(factor)
            passkey = c.passkey_trials * 2 * target
            w[f"evaluate {cell.name}"] = passkey + (scored if cell.seed == config.seeds[0] or sampler != "none"
                                                    else 0)
    return w


def _finished(path: Path) -> bool:
    """An evaluation's JSON is there whole."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _train(ws: Workspace, config: MapConfig, cell: Cell, data: dict[int, Path]) -> None:
    """The stage that makes `cell.folder`: a grid run with the map's batch (`finetune_settings` gives the window
    methods full_batch x factor sequences: B; full-length full_batch: B / f)."""
    if cell.stage in ws.stages.done:  # shared: adapt by every factor, a training-free export by every seed
        return
    c, run = config.sim, grid_run(config, cell.method)
    factor = c.factor if run.sampler == "plain" else cell.factor  # plain: no schedule trained; f applied at load
    length = required_length(c.window, factor * c.window, run.sampler, run.content)
    settings = finetune_settings(run, ws.model, data.get(length, ws.data / "train"), ws.cache, cell.folder,
                                 window=c.window, factor=factor, steps=c.steps, cost_steps=c.cost_steps,
                                 full_batch=config.full_batch(factor), lr=c.lr, seed=cell.seed)
    ws.stages.run(cell.stage, lambda: (cell.folder / "config.json").is_file(), lambda: run_finetune(settings))


def _evaluate(ws: Workspace, config: MapConfig, cell: Cell, template: int) -> None:
    """Perplexity at Lt (unless the shared JSON of a training-free method is there) and the passkey at the grid's
    lengths from `template` tokens up (none at a target shorter than the prompt)."""
    c = config.sim
    target = cell.factor * c.window
    extend = load_schedule(grid_run(config, cell.method), cell.factor)
    lengths = [n for n in replace(c, factor=cell.factor).lengths if n >= template]

    def evaluate() -> None:
        if not _finished(cell.ppl):
            evaluate_perplexity(cell.folder, ws.data / "test", [target], c.eval_docs, c.eval_stride, cell.ppl,
                                extend)
        if lengths and not _finished(cell.passkey):
            evaluate_passkey(cell.folder, lengths, c.passkey_trials, cell.seed, cell.passkey, extend)

    ws.stages.run(f"evaluate {cell.name}", lambda: _finished(cell.ppl) and (not lengths or _finished(
        cell.passkey)), evaluate)


def run_map(ws: Workspace, config: MapConfig, template: int) -> None:
    """Every block's fine-tuning data, fine-tunings and evaluations; the reproduction check printed after the
    first block when it is the grid's factor."""
    c, data = config.sim, {}
    for index, (seed, factor) in enumerate(blocks(config)):
        for length in (c.window, factor * c.window):
            if length not in data:
                data[length] = finetune_folder(ws, length)
        for cell in cells(config, ws.out, factor, seed):
            _train(ws, config, cell, data)
            _evaluate(ws, config, cell, template)
        if index == 0 and factor == c.factor:
            print(map_report.format_check(map_report.reproduction(config, ws.out)), flush=True)


def _csv(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag}: a comma-separated list of integers, got {text!r}") from None
    if len(set(values)) != len(values):
        raise UserError(f"{flag}: {text} lists a value twice")
    return values


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m pose_mlx.sim.map", description=(
        "The simulator's factor map: yarn, dynamic, adapt-yarn, adapt-dynamic, pose-yarn and full-yarn at "
        "each factor and seed, on the default simulator run's corpus and base, scored at the target (perplexity "
        "and passkey). Every stage is cached in --out; rerun the same command to resume."))
    p.add_argument("--out", help="working folder: every stage's output, results.json, passkey.png, ppl.png "
                                 "(default out/sim-map; with --quick out/sim-map-quick)")
    default, quick = (",".join(map(str, f)) for f in (FACTORS, QUICK_FACTORS))
    p.add_argument("--factors", help="extension factors f (target f x Lc), comma-separated; each must divide "
                                     "the window methods' sequences per update (default "
                                     f"{default}; with --quick {quick})")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                   help="fine-tuning and passkey seeds, comma-separated (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="toy sizes (the simulator's --quick): the whole map in "
                                                        "about a minute, for tests")
    p.add_argument("--check-against", default=None,
                   help="the grid's results.json that the map's cells at its factor must reproduce (default: "
                        "benchmarks/results/sim/results.json when it is there; 'none': no check)")
    p.add_argument("--report", default=None,
                   help="write results.json, passkey.png and ppl.png into this folder from what --out holds "
                        "(unfinished cells left out), running nothing")
    return p


def parse_config(argv=None) -> MapConfig:
    """Flags -> MapConfig, every setting checked before anything is created."""
    args = build_parser().parse_args(argv)
    out = args.out or ("out/sim-map-quick" if args.quick else "out/sim-map")
    sim = SimConfig(**{**(QUICK if args.quick else {}), "out": out})
    validate(sim)
    factors = _csv("--factors", args.factors or ",".join(map(str, QUICK_FACTORS if args.quick else FACTORS)))
    seeds = _csv("--seeds", args.seeds)
    for f in factors:
        if f < 2 or sim.window_batch % f:
            raise UserError(f"--factors: {f} must be >= 2 and divide the {sim.window_batch} window sequences "
                            "per update (full-length trains on that many / f sequences of f x Lc tokens)")
        if f * sim.window > sim.test_tokens:
            raise UserError(f"--factors: {f} x {sim.window} is longer than the test documents' "
                            f"{sim.test_tokens} tokens")
    if any(not 0 <= s < 2**32 for s in seeds):
        raise UserError(f"--seeds: each must be between 0 and {2**32 - 1}, got {args.seeds}")
    check = args.check_against
    if check is None:
        check = str(GRID_RESULTS) if GRID_RESULTS.is_file() else "none"
    if check != "none" and not Path(check).is_file():
        raise UserError(f"--check-against {check}: no such file (or 'none')")
    if args.report is not None:
        check_output("--report", args.report, folder=True)
        if not (Path(out) / "corpus" / "corpus.json").is_file():
            raise UserError(f"--report: {out} holds no map run yet (run without --report first)")
    return MapConfig(sim, tuple(sorted(factors)), seeds, None if check == "none" else check, args.report)


@command("pose_mlx.sim.map")
def main(argv=None) -> int:
    config = parse_config(argv)
    if config.report is not None:
        path = map_report.write(config, Path(config.sim.out), Path(config.report), list(weights(config)))
        print(f"wrote {path} and its figures from {config.sim.out}")
        return 0
    ws, _gates = start(config.sim, weights(config))
    run_map(ws, config, map_report.passkey_floor(ws.out))
    path = map_report.write(config, ws.out, ws.out, list(weights(config)))
    print(map_report.format_check(json.loads(path.read_text())["reproduction"]))
    print(f"wrote {path}, {ws.out / 'passkey.png'} and {ws.out / 'ppl.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
