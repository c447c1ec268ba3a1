"""The simulator's job: predict how the real model ranks the methods.

`agreement(sim, real)` takes the simulator's results.json and the real model's
(benchmarks/results/real_model/results.json) and returns Kendall's tau-b (`pose_mlx.analysis.stats.kendall_tau`)
between the two sides' scores of the methods both have measured, on perplexity and on passkey accuracy, each
side at its own target length (the simulator's Lt, the real model's `target`). tau-b compares every pair of
methods: (concordant - discordant) / sqrt((pairs - ties in x) (pairs - ties in y)); 1 is the same order, -1 the
reverse, None where one side scores every method alike. The goal is tau >= `GOAL` on both.

The real model's numbers come from `protocol_runs` (the pre-registered confirmation trials) where it has the
measure at the target, else from `runs` (the exploratory stage), so a run added to either is picked up the next
time this is computed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..analysis.stats import kendall_tau

#: The simulator's run names -> the real model's, in the order the report lists them.
REAL_NAMES = {"original": "none", "only-linear": "linear", "only-ntk": "ntk", "only-yarn": "yarn",
              "only-dynamic": "dynamic", "adapt-yarn": "adapt-yarn", "adapt-dynamic": "adapt-dynamic",
              "pose-linear": "pose-linear", "pose-yarn": "pose-yarn", "pose-yarn-notemp": "pose-yarn-notemp"}
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


def real_scores(real: dict, measure: str) -> tuple[dict[str, float], dict[str, str]]:
    """({method: `measure` at the real target}, {method: "protocol_runs" or "runs", where it came from})."""
    target = str(real["target"])
    scores, source = {}, {}
    for stage in ("runs", "protocol_runs"):  # the later stage wins
        for name, entry in (real.get(stage) or {}).items():
            value = (entry.get(measure) or {}).get(target)
            if value is not None:
                scores[name], source[name] = value, stage
    return scores, source


def _tau(x: list[float], y: list[float]) -> float | None:
    if len(x) < 2:
        return None
    tau = kendall_tau(x, y)
    return None if math.isnan(tau) else tau


def agreement(sim: dict, real: dict) -> dict:
    """results.json's `sim_agreement`: {"ppl_tau", "passkey_tau", "methods" (measured on both measures by both
    sides, in `REAL_NAMES` order), "goal", "holds" (both taus >= goal), "sim_target", "real_target", "sim" and
    "real" ({measure: {method: score}}), "real_source" ({method: {measure: stage}})}."""
    sides = {m: (sim_scores(sim, m), *real_scores(real, m)) for m in MEASURES}
    methods = [name for name in REAL_NAMES.values()
               if all(name in s and name in r for s, r, _ in sides.values())]
    record = {f"{m}_tau": _tau([sides[m][0][n] for n in methods], [sides[m][1][n] for n in methods])
              for m in MEASURES}
    holds = all(record[f"{m}_tau"] is not None and record[f"{m}_tau"] >= GOAL for m in MEASURES)
    return {**record, "methods": methods, "goal": GOAL, "holds": holds,
            "sim_target": sim["config"]["target"], "real_target": real["target"],
            "sim": {m: {n: sides[m][0][n] for n in methods} for m in MEASURES},
            "real": {m: {n: sides[m][1][n] for n in methods} for m in MEASURES},
            "real_source": {n: {m: sides[m][2][n] for m in MEASURES} for n in methods}}


def ranking(scores: dict[str, float], measure: str) -> list[list[str]]:
    """Methods best first, tied methods grouped: [[best], [next, tied with it], ...]."""
    order = sorted(set(scores.values()), reverse=not LOWER_IS_BETTER[measure])
    return [[n for n in scores if scores[n] == value] for value in order]


def real_results(path: Path = REAL_RESULTS) -> dict | None:
    """The real model's results.json, None where it is not there (an installed package without benchmarks/)."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


__all__ = ["GOAL", "REAL_NAMES", "REAL_RESULTS", "agreement", "ranking", "real_results", "real_scores",
           "sim_scores"]
