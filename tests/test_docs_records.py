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
    record = _real()["sim_agreement"]["grid"]
    return f"{(record['ablations'][ablation] if ablation else record)[key]:.2f}"


#: The rows of docs/simulator.md's 8x table: its label, the map's method.
MAP_ROWS = (("PoSE + YaRN (`pose-yarn`)", "pose-yarn"), ("YaRN, no training", "yarn"),
            ("full-length + YaRN", "full-yarn"), ("ordinary fine-tune, YaRN at load", "adapt-yarn"),
            ("dynamic NTK, no training", "dynamic"), ("ordinary fine-tune, dynamic NTK at load", "adapt-dynamic"))


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
    ("README.md", "the fine-tuning costs {:.0f} CPU-seconds, the 16k passkey trial {:.0f} and the question about a "
     "licence text {:.0f} (wall times {:.0f} s, {:.0f} s and {:.0f} s",
     lambda: [*(_quickstart()[k]["cpu_s"] for k in ("finetune", "passkey", "generate")),
              *(_quickstart()[k]["wall_s"] for k in ("finetune", "passkey", "generate"))]),
    ("docs/evidence.md", "first of the addendum's runs on both passkey ({:.2f}, against YaRN's {:.2f}) and perplexity "
     "({:.2f}, against {:.2f})",
     lambda: [_map8("pose-yarn", "passkey"), _map8("yarn", "passkey"), _map8("pose-yarn", "ppl"), _map8("yarn", "ppl")]),
    *[("docs/simulator.md", f"| {label} | {{:.2f}} | {{:.2f}} |",
       lambda m=m: [_map8(m, "passkey"), _map8(m, "ppl")]) for label, m in MAP_ROWS],
    ("docs/evidence.md", "(`evidence_full_length.joined_corpus`: {} pieces, {:.2f}M tokens)",
     lambda: [_joined()["pieces"], _joined()["tokens"] / 1e6]),
]


def _map8(method: str, measure: str) -> float:
    path = ROOT / "benchmarks" / "results" / "sim_map" / "results.json"
    return json.loads(path.read_text())["map"]["8"][method][measure]


def _quickstart() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "quickstart.json").read_text())["steps"]


def _joined() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "real_model" / "protocol_full" / "data.json").read_text())


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


def test_the_readme_results_table_is_generated_from_the_record():
    from benchmarks.evidence_summary import BEGIN, END, readme_block

    text = (ROOT / "README.md").read_text()
    start, end = text.index(BEGIN.split(" (")[0]), text.index(END) + len(END)
    assert text[start:end] == readme_block(_real()), "run python -m benchmarks.evidence_summary"


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    """Every relative link of the README and docs/ names a file that exists, and a heading that exists in it."""
    path = ROOT / doc
    broken = []
    for target, anchor in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        linked = (path.parent / target).resolve()
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor[1:] not in _anchors(linked):
            broken.append(target + anchor)
    assert not broken, f"{doc}: {broken}"
