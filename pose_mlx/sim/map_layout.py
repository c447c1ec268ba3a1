"""What the factor map (`python -m pose_mlx.sim.map`) runs and where each piece lands under its --out: the
settings (`MapConfig`), the cells (one method at one factor with one seed: `cells`), the order of the blocks, and
the grid run behind each method. `pose_mlx.sim.map` runs the cells, `pose_mlx.sim.map_report` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import SimConfig
from .grid import Run, grid_runs

#: The map's methods (the real model's names) -> the grid's run that makes each.
GRID_NAMES = {"yarn": "only-yarn", "dynamic": "only-dynamic", "adapt-yarn": "adapt-yarn",
              "adapt-dynamic": "adapt-dynamic", "pose-yarn": "pose-yarn", "full-yarn": "full-yarn"}
METHODS = tuple(GRID_NAMES)
FACTORS = (2, 4, 8, 16)
SEEDS = (0, 1)
#: The committed grid whose runs the map's factor-8 cells must reproduce.
GRID_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim" / "results.json"


@dataclass(frozen=True)
class MapConfig:
    sim: SimConfig  # corpus, base, gates and the training recipe (the defaults, or --quick's sizes)
    factors: tuple[int, ...]
    seeds: tuple[int, ...]
    check_against: str | None  # the grid's results.json to reproduce at its factor (None: no check)
    report: str | None  # write results.json and the figures here from --out, running nothing

    def full_batch(self, factor: int) -> int:
        """Full-length sequences per update at `factor`: as many tokens as the window methods' B x Lc."""
        return self.sim.window_batch // factor

    def suffix(self, seed: int) -> str:
        """'' for the base's seed (the grid's own runs), '.s<seed>' for the others (the grid's naming)."""
        return "" if seed == self.sim.seed else f".s{seed}"


@dataclass(frozen=True)
class Cell:
    """One method at one factor with one seed: where its model is and where its evaluations go."""

    method: str
    factor: int
    seed: int
    folder: Path  # the model evaluated (adapt-*: the plain fine-tuning, extended at load)
    stage: str  # the stage that makes `folder` ('finetune <folder name>')
    ppl: Path  # perplexity JSON (the training-free methods: one per factor, shared by the seeds)
    passkey: Path

    @property
    def name(self) -> str:
        return self.passkey.name.removesuffix(".passkey.json")


def cells(config: MapConfig, out: Path, factor: int, seed: int) -> list[Cell]:
    """The six methods' cells at `factor` with `seed`."""
    found = []
    for method in METHODS:
        trained = method not in ("yarn", "dynamic")
        if method.startswith("adapt-"):
            folder = f"adapt{config.suffix(seed)}"
        else:
            folder = f"{method}-{factor}x" + (config.suffix(seed) if trained else "")
        name = f"{method}-{factor}x{config.suffix(seed)}"
        ppl = name if trained else f"{method}-{factor}x"
        found.append(Cell(method, factor, seed, out / "runs" / folder, f"finetune {folder}",
                          out / "eval" / f"{ppl}.ppl.json", out / "eval" / f"{name}.passkey.json"))
    return found


def blocks(config: MapConfig) -> list[tuple[int, int]]:
    """(seed, factor) in the order they run: the grid's factor with the first seed first (the reproduction check),
    then every factor of the first seed, then the other seeds'."""
    order = [(s, f) for s in config.seeds for f in config.factors]
    first = (config.seeds[0], config.sim.factor)
    return [first] + [b for b in order if b != first] if first in order else order


def grid_run(config: MapConfig, method: str) -> Run:
    return {r.name: r for r in grid_runs(config.sim.factor)}[GRID_NAMES[method]]


__all__ = ["FACTORS", "GRID_NAMES", "GRID_RESULTS", "METHODS", "SEEDS", "Cell", "MapConfig", "blocks", "cells",
           "grid_run"]
