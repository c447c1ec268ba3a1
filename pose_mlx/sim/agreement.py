"""The simulator's job: predict how the real model ranks the methods.

`agreement(sim, real)` takes the simulator's results.json and the real model's
(benchmarks/results/real_model/results.json) and returns Kendall's tau-b (`pose_mlx.analysis.stats.kendall_tau`)
between the two sides' scores of the methods both have measured, on perplexity and on passkey accuracy, each
side at its own target length (the simulator's Lt, the real model's `target`). tau-b compares every pair of
methods: (concordant - discordant) / sqrt((pairs - ties in x) (pairs - ties in y)); 1 is the same order, -1 the
reverse, None where one side scores every method alike. The goal is tau >= `GOAL` on both.

The real model's numbers are read from its `runs`: a run of the pre-registered protocol (`"stage":
"confirmation"`, experiments/bench_evidence.py) gives its confirmation numbers where it has the measure at the
target, else its `exploratory` ones; any other run its own (the exploratory stage, experiments/bench_real_model.py).
So a run added there, or a confirmation number that arrives, is picked up the next time this is computed.

The factor map (`pose_mlx.sim.map`) is compared one factor at a time: `map_agreement(map, real, f)` takes the
map's column f (each method's mean over seeds at Lt = f Lc) and the real model's block at the same factor
(`real_block`: its results.json itself at 4x, `results.json["factor_8x"]` at 8x, ...), over the map's methods.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..analysis.stats import kendall_tau

#: The simulator's run names -> the real model's method names, in the order the report lists them.
REAL_NAMES = {"original": "none", "only-linear": "linear", "only-ntk": "ntk", "only-yarn": "yarn",
              "only-dynamic": "dynamic", "adapt-yarn": "adapt-yarn", "adapt-dynamic": "adapt-dynamic",
              "pose-linear": "pose-linear", "pose-yarn": "pose-yarn", "pose-yarn-notemp": "pose-yarn-notemp"}
#: A method's runs in the real model's results.json, the first that has the number used (default: its name):
#: PoSE + YaRN is the protocol's run (lr 3e-5) once it has numbers, else the exploratory one (lr 1e-4).
REAL_RUNS = {"pose-yarn": ("pose-yarn-lr3e-5", "pose-yarn")}
MEASURES = ("ppl", "passkey")
LOWER_IS_BETTER = {"ppl": True, "passkey": False}
GOAL = 0.7  # Kendall's tau both rankings must reach
REAL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "real_model" / "results.json"


def sim_scores(sim: dict, measure: str) -> dict[str, float]:
    """{real-model name: the simulator run's `measure` at its target} (the run's own seed, as the real model's)."""
    target = str(sim["config"]["target"])
    scores = {}
    for name, real_name in REAL_NAMES.items():
        value = sim.get("runs", {}).get(name, {}).get(measure, {}).get(target)
        if value is not None:
            scores[real_name] = value
    return scores


def _stages(entry: dict):
    """(stage, numbers) of one real-model run, the confirmation stage's first."""
    if entry.get("stage") == "confirmation":
        yield "confirmation", entry
        entry = entry.get("exploratory") or {}
    yield "exploratory", entry


def real_scores(real: dict, measure: str, methods=None) -> tuple[dict[str, float], dict[str, str]]:
    """({method: `measure` at the real target}, {method: "<run> (<stage>)", where it came from}) for `methods`
    (default: `REAL_NAMES`'); `real`: a block {"target", "runs"} (the real model's results.json is its 4x one)."""
    target = str(real["target"])
    scores, source = {}, {}
    for method in methods or REAL_NAMES.values():
        found = ((run, stage, numbers[measure][target]) for run in REAL_RUNS.get(method, (method,))
                 for stage, numbers in _stages(real.get("runs", {}).get(run, {}))
                 if (numbers.get(measure) or {}).get(target) is not None)
        for run, stage, value in found:
            scores[method], source[method] = value, f"{run} ({stage})"
            break
    return scores, source


def _tau(x: list[float], y: list[float]) -> float | None:
    if len(x) < 2:
        return None
    tau = kendall_tau(x, y)
    return None if math.isnan(tau) else tau


def _compare(sim: dict[str, dict[str, float]], real: dict, methods, sim_target: int) -> dict:
    """The agreement record of the simulator's scores `sim` ({measure: {method: score}}) with the real block
    `real` over those of `methods` (in that order) both sides have on both measures."""
    sides = {m: (sim[m], *real_scores(real, m, methods)) for m in MEASURES}
    methods = [name for name in methods if all(name in s and name in r for s, r, _ in sides.values())]
    record = {f"{m}_tau": _tau([sides[m][0][n] for n in methods], [sides[m][1][n] for n in methods])
              for m in MEASURES}
    holds = all(record[f"{m}_tau"] is not None and record[f"{m}_tau"] >= GOAL for m in MEASURES)
    return {**record, "methods": methods, "goal": GOAL, "holds": holds,
            "sim_target": sim_target, "real_target": real["target"],
            "sim": {m: {n: sides[m][0][n] for n in methods} for m in MEASURES},
            "real": {m: {n: sides[m][1][n] for n in methods} for m in MEASURES},
            "real_source": {n: {m: sides[m][2][n] for m in MEASURES} for n in methods}}


def agreement(sim: dict, real: dict) -> dict:
    """results.json's `sim_agreement`: {"ppl_tau", "passkey_tau", "methods" (measured on both measures by both
    sides, in `REAL_NAMES` order), "goal", "holds" (both taus >= goal), "sim_target", "real_target", "sim" and
    "real" ({measure: {method: score}}), "real_source" ({method: {measure: stage}})}."""
    return _compare({m: sim_scores(sim, m) for m in MEASURES}, real, list(REAL_NAMES.values()),
                    sim["config"]["target"])


def map_scores(table: dict, factor: int, measure: str) -> dict[str, float]:
    """{method: mean over seeds of `measure` at the target} of the factor map's column `factor` (its results.json
    `map`; methods not measured there, or without the measure, left out)."""
    column = table["map"].get(str(factor), {})
    return {name: entry[measure] for name, entry in column.items() if entry.get(measure) is not None}


def map_ranking(table: dict, factor: int) -> dict[str, list[list[str]]]:
    """{measure: the map's methods at `factor`, best first, ties grouped (`ranking`)}."""
    return {m: ranking(map_scores(table, factor, m), m) for m in MEASURES}


def real_block(real: dict, factor: int) -> dict | None:
    """The real model's {"target", "runs"} at `factor` (target = factor x its window `original`): its results.json
    itself at the factor it was run at (4x: 8k -> 32k), else its key "factor_<f>x" (a block with "runs" and
    "target", or the runs alone); None where it has none."""
    if real["target"] == factor * real["original"]:
        return real
    block = real.get(f"factor_{factor}x")
    if block is None:
        return None
    if "runs" in block:
        return {"target": block.get("target", factor * real["original"]), "runs": block["runs"]}
    return {"target": factor * real["original"], "runs": block}


def map_agreement(table: dict, real: dict, factor: int) -> dict | None:
    """`agreement`'s record for the factor map's column `factor` against the real model's block at the same
    factor, over the map's methods (None where the real model has no such block)."""
    block = real_block(real, factor)
    if block is None:
        return None
    methods = table["config"]["methods"]
    sim = {m: map_scores(table, factor, m) for m in MEASURES}
    return _compare(sim, block, methods, table["config"]["targets"][str(factor)])


def ranking(scores: dict[str, float], measure: str) -> list[list[str]]:
    """Methods best first, tied methods grouped: [[best], [next, tied with it], ...]."""
    order = sorted(set(scores.values()), reverse=not LOWER_IS_BETTER[measure])
    return [[n for n in scores if scores[n] == value] for value in order]


def real_results(path: Path = REAL_RESULTS) -> dict | None:
    """The real model's results.json, None where it is not there (an installed package without benchmarks/)."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


__all__ = ["GOAL", "REAL_NAMES", "REAL_RESULTS", "agreement", "map_agreement", "map_ranking", "map_scores", "ranking",
           "real_block", "real_results", "real_scores", "sim_scores"]
