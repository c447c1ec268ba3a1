"""What the project measured, in one line, for the extension factor a run asks for (`pose_mlx.plan` prints it).

The evidence is the real-model benchmark's record, `RECORD` (benchmarks/results/real_model/results.json, with the
protocol it names): its top level is one block, measured at factor target / original, and a key `factor_<N>x`
holds another block of the same schema (e.g. `factor_8x`, target 65536). `summarize(record, protocols)` reduces
each block to what the line says, in the package's `evidence.json` (written by `python -m experiments.evidence_summary`;
a test checks it equals the record's summary):

- `training_free`: the best training-free run and how it retrieved the passkey against the headline PoSE run in
  the registered tests at every length: "as well as" (no test tells them apart), "better than" or "less well
  than" (some test does, all one way), "differently from" (some each way);
- `lowest_perplexity`: among the headline and the runs no test finds it better than (those that retrieved as
  well or better), the one with the lowest perplexity at the target.

`pointer(factor)` picks the block whose factor is closest to `factor` in ratio (|log f - log f_block|, so 6x is
nearer 8x than 4x) and words it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from .rope import SCHEDULE_NAMES

#: The committed record, relative to the repository root, and the page that explains it.
RECORD = "benchmarks/results/real_model/results.json"
PAGE = "docs/evidence.md"
#: The summary shipped with the package.
SHIPPED = Path(__file__).with_name("evidence.json")
_FACTOR_KEY = re.compile(r"factor_(\d+(?:\.\d+)?)x")


def summarize(record: dict, protocols: Path) -> dict:
    """The shipped summary of `record` (results.json); `protocols` is the folder its `protocol` path is relative
    to (the repository root), for the runs' schedules."""
    blocks = [record] + [record[k] for k in sorted(record) if _FACTOR_KEY.fullmatch(k)]
    return {"record": RECORD, "page": PAGE, "blocks": [_block(b, protocols) for b in blocks if _measured(b)]}


def _measured(block: dict) -> bool:
    """A block says something once its headline and its best training-free run are named and the headline's
    perplexity at the target is in (a registered block waiting for its trials does not)."""
    headline, free = block.get("headline"), block.get("best_training_free")
    return bool(headline and free) and str(block["target"]) in block["runs"].get(headline, {}).get("ppl", {})


def _block(block: dict, root: Path) -> dict:
    import yaml

    protocol = yaml.safe_load((root / block["protocol"]).read_text())
    specs = {**protocol.get("recipe", {}).get("candidates", {}), **protocol["runs"]}
    headline, free, target = block["headline"], block["best_training_free"], block["target"]
    tests = [t for t in block["tests"] if t["pose"] == headline]
    verdicts = {t["verdict"] for t in tests if t["control"] == free}
    relation = {frozenset({"not distinguishable"}): "as well as"}.get(frozenset(verdicts))
    if relation is None:
        relation = ("differently from" if {"better", "worse"} <= verdicts
                    else "better than" if "worse" in verdicts else "less well than")
    beaten = {t["control"] for t in tests if t["verdict"] == "better"}
    retrieving = [headline] + sorted({t["control"] for t in tests} - beaten)
    lowest = min(retrieving, key=lambda run: block["runs"][run]["ppl"][str(target)])
    return {"factor": target / block["original"], "model": _model_name(block["model"]),
            "original": block["original"], "target": target, "headline": _label(headline, specs),
            "training_free": _label(free, specs), "relation": relation, "lowest_perplexity": _label(lowest, specs)}


def _model_name(name: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a hub id -> its name."""
    return re.sub(r"(\.[QF]\d\w*)?\.gguf$", "", name.rsplit("/", 1)[-1], flags=re.IGNORECASE)


def _label(run: str, specs: dict) -> str:
    """How a protocol run reads: 'PoSE + YaRN', 'training-free dynamic NTK', 'fine-tuning without PoSE + YaRN'."""
    spec = specs[run]
    role = spec.get("role", "pose")
    if role == "base":
        return "the base model"
    schedule = spec["train"]["schedule"] if role == "pose" else spec["schedule"]
    name = SCHEDULE_NAMES.get(schedule, schedule)
    return {"pose": "PoSE + ", "training-free": "training-free ", "control": "fine-tuning without PoSE + "}[role] + name


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def pointer(factor: float, summary: dict | None = None) -> str:
    """One line: what was measured at the recorded factor closest to `factor` (target / original), and where."""
    summary = summary or json.loads(SHIPPED.read_text())
    block = min(summary["blocks"], key=lambda b: (abs(math.log(factor / b["factor"])), b["factor"]))
    nearest = "" if math.isclose(factor, block["factor"]) else f" (the measured factor nearest {factor:g}x)"
    return (f"evidence{nearest}: at {block['factor']:g}x ({block['model']}, {_k(block['original'])} -> "
            f"{_k(block['target'])}) {block['training_free']} retrieved the passkey {block['relation']} "
            f"{block['headline']}; {block['lowest_perplexity']} gave the lowest {_k(block['target'])} perplexity "
            f"among the runs that retrieved as well - {summary['page']}")


__all__ = ["PAGE", "RECORD", "SHIPPED", "pointer", "summarize"]
