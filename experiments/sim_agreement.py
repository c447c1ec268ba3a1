"""Bring the simulator's agreement with the real model up to date from the committed numbers.

`python -m experiments.sim_agreement` recomputes `sim_agreement` (`pose_mlx.sim.agreement`: Kendall's tau-b between
the simulator's and the real model's rankings of the methods on perplexity and passkey at each one's target) from
benchmarks/results/sim/results.json and benchmarks/results/real_model/results.json (its `runs` and
`protocol_runs`), and writes it into both files (the real model's under `sim_agreement.grid`, with the taus without
the methods where the rankings part, `ablations`) and into the simulator's report.md (its "Agreement with the real
model" section), leaving everything else as it was (it updates those records, so it does not write through
`common.write_results`). bench_evidence runs it after each write of the real model's results, so new real-model
runs are picked up; `python -m pose_mlx.sim` computes the same when it assembles its report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import REAL_MODEL, RESULTS_DIR
from pose_mlx.analysis.stats import kendall_tau
from pose_mlx.sim.agreement import agreement
from pose_mlx.sim.report import AGREEMENT_HEADING, agreement_section

SIM = RESULTS_DIR / "sim"
REAL = REAL_MODEL / "results.json"


def _with_key(results: dict, value: dict, after: str | None) -> dict:
    """`results` with sim_agreement = value: in its place when present, else after key `after` (or at the end)."""
    if "sim_agreement" in results or after not in results:
        return {**results, "sim_agreement": value}
    out = {}
    for key, item in results.items():
        out[key] = item
        if key == after:
            out["sim_agreement"] = value
    return out


def replace_section(report: str, section: list[str]) -> str:
    """report.md with its agreement section replaced by `section` (inserted before "## Perplexity" if absent)."""
    text = "\n".join(section) + "\n" if section else ""
    start = report.find(AGREEMENT_HEADING + "\n")
    if start < 0:
        at = report.index("## Perplexity\n")
        return report[:at] + text + report[at:]
    end = report.find("\n## ", start + len(AGREEMENT_HEADING))
    return report[:start] + text + report[end + 1:]


#: In the real model's results.json, `sim_agreement` holds this record under "grid" beside the factor map's agreement
#: at each factor ("4x", "8x": experiments.evidence_summary).
GRID_NOTE = "the simulator's grid at its 8x (Lt = 1024) against the real model at 4x (8k -> 32k)"

#: The methods left out in the agreement's ablations: where the two rankings part (docs/simulator.md).
ABLATIONS = {"without dynamic, adapt-dynamic": ("dynamic", "adapt-dynamic"), "without adapt-yarn": ("adapt-yarn",)}


def ablations(record: dict) -> dict:
    """{name: {"ppl_tau", "passkey_tau", "methods"}}: the agreement over `record`'s methods less those `ABLATIONS`
    names (both sides' scores as measured; Kendall's tau-b)."""
    out = {}
    for name, dropped in ABLATIONS.items():
        methods = [m for m in record["methods"] if m not in dropped]
        taus = {f"{m}_tau": kendall_tau([record["sim"][m][x] for x in methods], [record["real"][m][x] for x in methods])
                for m in ("ppl", "passkey")}
        out[name] = {**taus, "methods": methods}
    return out


def refresh(sim: Path = SIM, real: Path = REAL) -> dict:
    """Recompute and write the agreement (both results.json files, the report); returns it."""
    sim_results, real_results = (json.loads(p.read_text()) for p in (sim / "results.json", real))
    record = agreement(sim_results, real_results)
    sim_results = _with_key(sim_results, record, "claims")
    (sim / "results.json").write_text(json.dumps(sim_results, indent=1) + "\n")
    by_factor = real_results.get("sim_agreement") if "grid" in real_results.get("sim_agreement", {}) else {}
    grid = {**record, "what": GRID_NOTE, "ablations": ablations(record)}
    real.write_text(json.dumps(_with_key(real_results, {**by_factor, "grid": grid}, None), indent=2) + "\n")
    report = sim / "report.md"
    report.write_text(replace_section(report.read_text(), agreement_section(sim_results)))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", type=Path, default=SIM, help="the simulator's result folder (default %(default)s)")
    p.add_argument("--real", type=Path, default=REAL, help="the real model's results.json (default %(default)s)")
    args = p.parse_args(argv)
    record = refresh(args.sim, args.real)
    tau = {k: "n/a" if record[k] is None else f"{record[k]:.2f}" for k in ("ppl_tau", "passkey_tau")}
    print(f"sim_agreement over {', '.join(record['methods'])}: perplexity tau {tau['ppl_tau']}, passkey tau "
          f"{tau['passkey_tau']}; goal >= {record['goal']:g} {'holds' if record['holds'] else 'does not hold'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
