"""The factor map's results.json, figures and reproduction check, read from the evaluators' JSONs a map run
(`pose_mlx.sim.map`) leaves in its --out; unfinished cells are left out, so a report can be made at any time.

results.json: {"config", "base", "gates", "map": {factor: {method: {"passkey": mean over seeds, "ppl": mean,
"per_seed": {seed: {"ppl", "passkey", "passkey_trials"}}}}}, "ranking": {factor: {measure: methods best first}},
"agreement": {factor: `pose_mlx.sim.agreement.map_agreement` where the real model has that factor},
"reproduction", "complete", "stage_seconds", "wall_seconds"}; passkey is the accuracy at the target Lt = f Lc, ppl
the perplexity there.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from ..plots import heatmap, log_ticks
from .agreement import map_agreement, map_ranking, real_results
from .corpus import hf_tokenizer
from .grid import passkey_template_tokens
from .map_layout import GRID_NAMES, METHODS, Cell, MapConfig, cells

#: Largest relative difference of a perplexity that still reproduces (the grid's reruns agree to ~1e-8).
PPL_RTOL = 1e-4
#: Settings that may differ between the map and the grid it is checked against (they do not change these runs).
FREE = ("out", "pretrained", "seeds", "cost_steps", "ruler_samples")


def _json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def passkey_floor(out: Path) -> int:
    """The shortest length the passkey test fits in: its prompt without filler, in the run's tokenizer."""
    return passkey_template_tokens(hf_tokenizer(Path(out) / "corpus" / "tokenizer"))


def cell_scores(cell: Cell, window: int, floor: int) -> dict | None:
    """{"ppl", "passkey", "passkey_trials"} at the cell's target, or None while it is not measured (its
    perplexity, or its passkey where the target is at least `floor`, `passkey_floor`; passkey None where not)."""
    target = cell.factor * window
    ppl, passkey = _json(cell.ppl), _json(cell.passkey)
    if ppl is None or (passkey is None and target >= floor):
        return None
    row = {"ppl": next(r["ppl"] for r in ppl["results"] if r["length"] == target), "passkey": None,
           "passkey_trials": 0}
    if passkey is not None:
        (found,) = [a for a in passkey["accuracy"] if a["length"] == target]
        row.update(passkey=found["accuracy"], passkey_trials=found["trials"])
    return row


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def collect(config: MapConfig, out: Path) -> dict:
    """results.json's "map": every measured cell, means over the seeds measured so far."""
    table, floor = {}, passkey_floor(out)
    for factor in config.factors:
        column = {}
        for method in METHODS:
            per_seed = {}
            for seed in config.seeds:
                cell = next(c for c in cells(config, out, factor, seed) if c.method == method)
                scores = cell_scores(cell, config.sim.window, floor)
                if scores is not None:
                    per_seed[str(seed)] = scores
            if per_seed:
                column[method] = {"passkey": _mean([s["passkey"] for s in per_seed.values()]),
                                  "ppl": _mean([s["ppl"] for s in per_seed.values()]), "per_seed": per_seed}
        table[str(factor)] = column
    return table


def _grid_value(grid: dict, method: str, seed: int, measure: str):
    """The committed grid's number of `method` with `seed` at its target (None where it has none: the grid ran
    passkey, and the training-free and adapt runs, with its own seed only)."""
    c, name, target = grid["config"], GRID_NAMES[method], str(grid["config"]["target"])
    if seed == c["seed"]:
        return grid["runs"].get(name, {}).get(measure, {}).get(target)
    values = grid.get("ppl", {}).get(name, {}).get(target, {}).get("values", [])
    k = c["seeds"].index(seed) if seed in c["seeds"] else len(values)
    return values[k] if measure == "ppl" and k < len(values) else None


def _comparable(config: MapConfig, grid: dict, out: Path) -> str | None:
    """Why the grid's numbers are not the map's to reproduce (None: they are)."""
    theirs, mine = grid["config"], config.sim.to_dict()
    differ = sorted(k for k in set(theirs) | set(mine) if k not in FREE and theirs.get(k) != mine.get(k))
    if differ:
        return f"made with other settings ({', '.join(differ)})"
    if config.sim.factor not in config.factors:
        return f"the map has no factor {config.sim.factor}"
    base = _json(out / "pretrained" / "pretrain.json") or {}
    if base.get("made_with") != grid.get("pretrain", {}).get("made_with"):
        return "its base was made otherwise (settings or corpus)"
    return None


def _shown(path: Path) -> str:
    """`path` as the record names it: relative to the current folder when inside it (no machine's paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def reproduction(config: MapConfig, out: Path) -> dict:
    """The map's cells at the grid's factor against the grid's runs (`config.check_against`): a row per number
    both have; "reproduces" is True when every measured one matches (perplexity to `PPL_RTOL`, passkey
    exactly), None while none is measured or when there is nothing to compare."""
    against = None if config.check_against is None else _shown(Path(config.check_against))
    record = {"against": against, "factor": config.sim.factor, "target": config.sim.target,
              "rows": [], "reproduces": None}
    if config.check_against is None:
        return {**record, "why_not": "no grid to check against (--check-against none)"}
    grid = json.loads(Path(config.check_against).read_text())
    why_not = _comparable(config, grid, out)
    if why_not is not None:
        return {**record, "why_not": why_not}
    floor = passkey_floor(out)
    for seed in config.seeds:
        for cell in cells(config, out, config.sim.factor, seed):
            scores = cell_scores(cell, config.sim.window, floor) or {}
            for measure in ("ppl", "passkey"):
                theirs = _grid_value(grid, cell.method, seed, measure)
                if theirs is None:
                    continue
                mine = scores.get(measure)
                same = None if mine is None else (math.isclose(mine, theirs, rel_tol=PPL_RTOL)
                                                  if measure == "ppl" else mine == theirs)
                record["rows"].append({"method": cell.method, "seed": seed, "measure": measure, "grid": theirs,
                                       "map": mine, "matches": same})
    measured = [r["matches"] for r in record["rows"] if r["matches"] is not None]
    return {**record, "reproduces": all(measured) if measured else None}


def format_check(check: dict) -> str:
    """The reproduction check as printed lines: a verdict, then a row per number compared."""
    head = f"reproduction of {check['against']} at {check['factor']}x (Lt = {check['target']})"
    if "why_not" in check:
        return f"{head}: not checked, {check['why_not']}"
    rows = check["rows"]
    done = [r for r in rows if r["matches"] is not None]
    verdict = {None: "nothing measured yet", True: "REPRODUCES", False: "DOES NOT REPRODUCE"}[check["reproduces"]]
    lines = [f"{head}: {verdict} ({sum(r['matches'] for r in done)} of {len(done)} numbers measured so far match; "
             f"{len(rows)} to compare)"]
    for r in rows:
        mine = "-" if r["map"] is None else f"{r['map']:.6g}"
        mark = {None: "", True: "ok", False: "DIFFERS"}[r["matches"]]
        lines.append(f"  {r['method']:<14} seed {r['seed']}  {r['measure']:<8} grid {r['grid']:.6g}  map {mine}  "
                     f"{mark}")
    return "\n".join(lines)


def _grid(table: dict, config: MapConfig, measure: str) -> np.ndarray:
    """Methods x factors of `measure`'s means (NaN: not measured)."""
    values = [[table[str(f)].get(m, {}).get(measure) for f in config.factors] for m in METHODS]
    return np.array([[math.nan if v is None else v for v in row] for row in values], dtype=float)


def figures(results: dict, config: MapConfig, folder: Path) -> list[Path]:
    """passkey.png (accuracy at the target, 0-1) and ppl.png (perplexity at the target; the colour is its ratio
    to the best method at that factor, log scale, so each column reads as a ranking): methods by factors."""
    from matplotlib.colors import LogNorm

    table, c = results["map"], config.sim
    columns = [f"{f}x\n{f * c.window}" for f in config.factors]
    seeds = ", ".join(map(str, config.seeds))
    measured = sum(len(entry["per_seed"]) for column in table.values() for entry in column.values())
    total = len(config.factors) * len(METHODS) * len(config.seeds)
    unfinished = "" if results["complete"] else f"\n(unfinished: {measured} of {total} runs measured)"
    trials = c.passkey_trials * len(config.seeds)
    passkey = heatmap(folder / "passkey.png", _grid(table, config, "passkey"), METHODS, columns,
                      f"factor, target Lt (Lc = {c.window})", "method",
                      f"Passkey accuracy at the target: {c.passkey_trials} trials x seeds {seeds} = {trials} per "
                      f"cell{unfinished}", missing="not measured (or the prompt is longer than Lt)",
                      colorbar={"label": "accuracy"})
    ppl = _grid(table, config, "ppl")
    with np.errstate(invalid="ignore"):
        ratio = ppl / np.nanmin(np.where(np.isfinite(ppl), ppl, np.inf), axis=0, keepdims=True)
    text = [[f"{v:.2f}\nx{r:.2f}" if np.isfinite(v) else "" for v, r in zip(row, ratios)]
            for row, ratios in zip(ppl, ratio)]
    top = max(1.05, float(np.nanmax(ratio))) if np.isfinite(ratio).any() else 2.0
    figure = heatmap(folder / "ppl.png", ratio, METHODS, columns, f"factor, target Lt (Lc = {c.window})",
                     "method", f"Perplexity at the target ({c.eval_docs} test documents, windows {c.eval_stride} "
                     f"apart), mean of seeds {seeds}{unfinished}", missing="not measured", text=text,
                     norm=LogNorm(1.0, top), cmap="RdYlGn_r",
                     colorbar={"label": "perplexity / the best at that factor (log scale)",
                               "ticks": [t for t in log_ticks(1.0, top) if 1.0 <= t <= top], "format": "x{x:g}"})
    return [passkey, figure]


def _config(config: MapConfig) -> dict:
    c = config.sim
    return {"factors": list(config.factors), "seeds": list(config.seeds), "methods": list(METHODS),
            "window": c.window, "targets": {str(f): f * c.window for f in config.factors}, "steps": c.steps,
            "lr": c.lr, "finetune_retrieval": c.finetune_retrieval, "window_batch": c.window_batch,
            "tokens_per_update": c.window_batch * c.window,
            "full_batch": {str(f): config.full_batch(f) for f in config.factors},
            "passkey_trials_per_seed": c.passkey_trials, "eval_docs": c.eval_docs, "eval_stride": c.eval_stride,
            "grid_names": GRID_NAMES, "sim": {k: v for k, v in c.to_dict().items() if k != "out"}}


def write(config: MapConfig, out: Path, folder: Path, stages: list[str]) -> Path:
    """results.json and the two figures into `folder` from what `out` holds; returns results.json's path.
    `stages`: the run's stage names, whose recorded seconds (out/stage_seconds.json) go into the record."""
    folder.mkdir(parents=True, exist_ok=True)
    table = collect(config, out)
    times = _json(out / "stage_seconds.json") or {}
    results = {"config": _config(config), "base": _json(out / "pretrained" / "pretrain.json"),
               "gates": _json(out / "gates.json"), "map": table}
    real, agreement = real_results(), {}
    for factor in config.factors:  # the factors the real model was run at
        record = None if real is None else map_agreement(results, real, factor)
        if record is not None:
            agreement[str(factor)] = record
    results.update(
        ranking={str(f): map_ranking(results, f) for f in config.factors}, agreement=agreement,
        reproduction=reproduction(config, out),
        complete=all(len(table[str(f)].get(m, {}).get("per_seed", {})) == len(config.seeds)
                     for f in config.factors for m in METHODS),
        stage_seconds={n: times[n] for n in stages if n in times},
        wall_seconds=sum(times[n] for n in stages if n in times))
    figures(results, config, folder)
    path = folder / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


__all__ = ["PPL_RTOL", "cell_scores", "passkey_floor", "collect", "figures", "format_check", "reproduction", "write"]
