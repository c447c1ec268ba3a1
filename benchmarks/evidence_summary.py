"""What spans the real model's protocol and its addenda: `python -m benchmarks.evidence_summary`.

Writes into `results/real_model/results.json`:
  - `addenda`: the committed addenda (benchmarks/protocols/real_model_*.yaml), in order;
  - `cost`: every cost-curve record (`bench_cost_curve`, one file per device) as {"method", "window", "peak_bytes",
    "seconds_per_update", "predicted_bytes", "device"} (a configuration not measured on a device is left out);
writes the package's `pose_mlx/evidence.json` (the summary whose one line `finetune` and `plan` print at start:
`pose_mlx.evidence`; tests/test_evidence.py fails until it equals the record's), and draws
`results/real_model/pareto.png`: passkey accuracy against perplexity at the target, one point per method,
one panel per extension factor (4x: 8k -> 32k, the protocol's confirmation numbers, exploratory ones hollow; 8x:
8k -> 64k, the addendum's). The upper left is better on both; a method no other beats on both axes is on the front
(`front`, also in results.json as `pareto`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import REAL_MODEL, ROOT, write_results
from benchmarks.protocol import PROTOCOLS
from pose_mlx import evidence
from pose_mlx.plots import plain_log_axis

RESULTS = REAL_MODEL / "results.json"


def points(runs: dict, target: int) -> dict[str, dict]:
    """{run: {"passkey", "ppl", "stage"}} of every run with both measures at `target`: its confirmation numbers,
    else its exploratory ones (marked so). An entry named "<run> (<what>)" is an earlier stage of another run under
    its own name and is left out."""
    key = str(target)
    out = {}
    for name, entry in runs.items():
        if " (" in name:
            continue
        for stage, numbers in ((entry.get("stage") or "exploratory", entry), ("exploratory", entry.get("exploratory") or {})):
            pk, ppl = (numbers.get(m, {}).get(key) for m in ("passkey", "ppl"))
            if pk is not None and ppl is not None:
                out[name] = {"passkey": pk, "ppl": ppl, "stage": stage}
                break
    return out


def front(pts: dict[str, dict]) -> list[str]:
    """The confirmed runs no other confirmed run beats on both measures (at least as good on both, better on one);
    exploratory numbers (fewer trials) are shown, not ranked."""
    pts = {n: p for n, p in pts.items() if p["stage"] == "confirmation"}
    def beats(a, b):
        return (a["passkey"] >= b["passkey"] and a["ppl"] <= b["ppl"]
                and (a["passkey"] > b["passkey"] or a["ppl"] < b["ppl"]))
    return [n for n, p in pts.items() if not any(beats(q, p) for m, q in pts.items() if m != n)]


def panels(results: dict) -> list[tuple[str, dict]]:
    """(title, points) of each factor measured so far: 4x from `runs`, 8x from `factor_8x`."""
    out = [(f"4x: 8k -> {results['target'] // 1024}k", points(results["runs"], results["target"]))]
    block = results.get("factor_8x") or {}
    if block.get("runs"):
        out.append((f"8x: 8k -> {block['target'] // 1024}k", points(block["runs"], block["target"])))
    return out


def plot_pareto(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False)
    for ax, (title, pts) in zip(axes[0], shown + [("8x: 8k -> 64k", {})] * (2 - len(shown))):
        on_front = set(front(pts))
        for name, p in sorted(pts.items()):
            hollow = p["stage"] != "confirmation"
            ax.scatter([p["ppl"]], [p["passkey"]], s=45, facecolors="none" if hollow else
                       ("tab:blue" if "pose" in name else "tab:gray"), edgecolors="tab:blue" if "pose" in name else "tab:gray")
            ax.annotate(name + (" *" if name in on_front else ""), (p["ppl"], p["passkey"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points", color="dimgray" if hollow else "black")
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis)
        ax.set_ylim(-0.05, 1.08)
        ax.set_xlabel("perplexity at the target (log; left is better)")
        ax.set_ylabel("passkey accuracy at the target")
        ax.set_title(title + ("" if pts else " (not measured yet)"), fontsize=10)
        if not pts:
            ax.text(0.5, 0.5, "registered, waiting for a GPU", ha="center", va="center", transform=ax.transAxes)
            ax.set_xlim(1, 10)
    fig.suptitle("SmolLM2-135M: retrieval against reading, one point per method (* on the front; hollow: "
                 "exploratory stage, fewer trials)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cost_records() -> list[dict]:
    keys = ("method", "window", "peak_bytes", "seconds_per_update", "predicted_bytes", "device", "grad_checkpoint")
    return [{k: r.get(k) for k in keys} for f in sorted((REAL_MODEL / "cost").glob("*.json"))
            for r in json.loads(f.read_text())["records"] if "peak_bytes" in r]


def summarize() -> dict:
    results = json.loads(RESULTS.read_text())
    results["addenda"] = [str(p.relative_to(ROOT)) for p in sorted(PROTOCOLS.glob("real_model_*.yaml"))]
    results["cost"] = cost_records()
    results["pareto"] = {title: front(pts) for title, pts in panels(results)}
    write_results("real_model", {k: v for k, v in results.items() if k != "benchmark"}, RESULTS)
    evidence.SHIPPED.write_text(json.dumps(evidence.summarize(results, ROOT), indent=1) + "\n")
    plot_pareto(results, REAL_MODEL / "pareto.png")
    return results


def main() -> int:
    results = summarize()
    print(f"addenda: {results['addenda']}; cost records: {len(results['cost'])}; fronts: {results['pareto']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
