"""Numbers that the README and docs/ quote from a committed record, checked against it: each claim is a sentence
template filled from the record, and the filled sentence must appear in the file (line breaks and runs of spaces
count as one space). A result that changes, or prose edited away from its record, fails here."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "benchmarks" / "results" / "real_model" / "results.json"


def _real() -> dict:
    return json.loads(REAL.read_text())


def count(run: str, length: int, results: dict | None = None) -> str:
    """A run's passkey as "k/n" at `length` (its confirmation numbers)."""
    r = (results or _real())["runs"][run]
    n = r["passkey_trials"][str(length)]
    return f"{round(r['passkey'][str(length)] * n)}/{n}"


def ppl(run: str, length: int) -> str:
    return f"{_real()['runs'][run]['ppl'][str(length)]:.2f}"


def tau(key: str, ablation: str | None = None) -> str:
    record = _real()["sim_agreement"]
    return f"{(record['ablations'][ablation] if ablation else record)[key]:.2f}"


#: (file, sentence with {} fields, the fields' values from the record)
CLAIMS = [
    ("docs/simulator.md",
     "Without both dynamic methods the other eight agree at {} on passkey and {} on perplexity",
     lambda: [tau("passkey_tau", "without dynamic, adapt-dynamic"), tau("ppl_tau", "without dynamic, adapt-dynamic")]),
    ("docs/simulator.md", "Kendall's tau is {} on perplexity at the target and {} on passkey",
     lambda: [tau("ppl_tau"), tau("passkey_tau")]),
    ("docs/evidence.md",
     "retrieves the passkey in {} trials at 16k (dynamic NTK and the screening's winner {}) and in {} at 32k",
     lambda: [count("adapt-dynamic", 16384), count("dynamic", 16384), count("adapt-dynamic", 32768)]),
    ("docs/evidence.md", "short context kept ({} at 4k, and {} at 8k where the base finds {})",
     lambda: [count("pose-yarn-lr3e-5", 4096), count("pose-yarn-lr3e-5", 8192), count("none", 8192)]),
    ("docs/evidence.md", "a 32k perplexity far below dynamic NTK's ({} against {})",
     lambda: [ppl("pose-yarn-lr3e-5", 32768), ppl("dynamic", 32768)]),
    ("docs/evidence.md", "ordinary fine-tuning with YaRN applied at load reaches {}",
     lambda: [ppl("adapt-yarn", 32768)]),
    ("docs/evidence.md", "(Kendall's tau {} on perplexity, {} on passkey; goal 0.7)",
     lambda: [tau("ppl_tau"), tau("passkey_tau")]),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("path,template,values", CLAIMS, ids=[f"{c[0]}:{c[1][:40]}" for c in CLAIMS])
def test_quoted_numbers_equal_their_record(path, template, values):
    expected = template.format(*values())
    assert expected in _flat((ROOT / path).read_text()), f"{path} should say: {expected}"


def test_a_stale_number_is_caught():
    """The check itself: a sentence filled from another record does not match."""
    results = _real()
    results["runs"]["adapt-dynamic"]["passkey"]["16384"] = 0.5
    assert count("adapt-dynamic", 16384, results) == "15/30" != count("adapt-dynamic", 16384)
