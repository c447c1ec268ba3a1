"""The pre-registered evaluation protocols (`benchmarks/protocols/*.yaml`): loading, its schema, and the tests it
names, computed from a run's passkey trials.

`load_protocol(path)` returns the file as a dict after checking every key the benchmark reads (ValueError naming
the first one that is missing or of the wrong kind), with its amendments applied (`<name>.amendment-N.yaml` beside
it, in order: trial counts, the equivalence test, a corrected `power_checked`; `amendments` lists them and the
values they replaced are kept under `as_registered`). `difference_tests(protocol, runs)` gives, for every run of
role `pose` against every run of role `training-free` or `control` and every length of `test.lengths`, the
difference of passkey accuracies with Newcombe's 95% interval and the protocol's verdict; runs without trials at a
length are left out. `equivalence_tests(protocol, runs)` gives an amendment's equivalence test of PoSE against
each control (passkey: Newcombe's 90% interval inside the margin; perplexity: the ratio within the margin).
`discordant(a, b)` counts the matched trials one run gets right and the other wrong.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from benchmarks.common import ROOT
from pose_mlx.analysis.stats import Z90, difference_interval, equivalence, equivalence_power, power, verdict

PROTOCOLS = ROOT / "benchmarks" / "protocols"  # registered records: kept with the results that cite them by path
ROLES = ("base", "training-free", "control", "pose")


def _need(mapping: dict, key: str, kind, where: str):
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"protocol: {where}{key} must be a {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _lengths(mapping: dict, where: str) -> dict[int, int]:
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"protocol: {where} must map lengths to trial counts, got {mapping!r}")
    for length, n in mapping.items():
        if not (isinstance(length, int) and isinstance(n, int) and length > 0 and n > 0):
            raise ValueError(f"protocol: {where} must map positive lengths to positive counts, got {length}: {n}")
    return mapping


def amend(protocol: dict, amendment: dict) -> dict:
    """`protocol` with `amendment` applied: its passkey trial counts, equivalence test and corrected power line; the
    replaced values kept under `as_registered`, the amendment appended to `amendments`."""
    if amendment.get("amends") != protocol.get("name"):
        raise ValueError(f"protocol: amendment {amendment.get('name')!r} amends {amendment.get('amends')!r}, "
                         f"not {protocol.get('name')!r}")
    kept = protocol.setdefault("as_registered", {})
    trials = amendment.get("passkey", {}).get("trials", {})
    if trials:
        kept.setdefault("passkey_trials", dict(protocol["passkey"]["trials"]))
        protocol["passkey"]["trials"] = {**protocol["passkey"]["trials"], **_lengths(trials, "amendment trials")}
    if "power_checked_correction" in amendment:
        kept.setdefault("power_checked", protocol.get("power_checked"))
        protocol["power_checked"] = amendment["power_checked_correction"]
    for key in ("equivalence", "power", "curve"):
        if key in amendment:
            protocol[key] = amendment[key]
    protocol.setdefault("amendments", []).append(amendment["name"])
    return protocol


def load_protocol(path: str | Path) -> dict:
    """The protocol at `path` with its amendments applied (`amend`), its schema checked."""
    path = Path(path)
    protocol = yaml.safe_load(path.read_text())
    for found in sorted(path.parent.glob(f"{path.stem}.amendment-*.yaml"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        amend(protocol, yaml.safe_load(found.read_text()))
    for key in ("name", "registered", "model"):
        _need(protocol, key, str, "")
    for key in ("original", "target"):
        _need(protocol, key, int, "")
    runs = _need(protocol, "runs", dict, "")
    for name, run in runs.items():
        role = _need(run, "role", str, f"runs.{name}.")
        if role not in ROLES:
            raise ValueError(f"protocol: runs.{name}.role must be one of {ROLES}, got {role!r}")
        if role in ("control", "pose"):
            _need(_need(run, "train", dict, f"runs.{name}."), "sampler", str, f"runs.{name}.train.")
    if not any(r["role"] == "pose" for r in runs.values()):
        raise ValueError("protocol: runs needs at least one run of role pose")
    passkey = _need(protocol, "passkey", dict, "")
    _need(passkey, "seed", int, "passkey.")
    trials = _lengths(passkey.get("trials"), "passkey.trials")
    _lengths(passkey.get("trials_base"), "passkey.trials_base")
    test = _need(protocol, "test", dict, "")
    for length in _need(test, "lengths", list, "test."):
        if length not in trials:
            raise ValueError(f"protocol: test length {length} has no passkey trials")
    for key in ("target", "unseen"):
        _need(_need(protocol, "perplexity", dict, ""), key, dict, "perplexity.")
    ruler = _need(protocol, "ruler", dict, "")
    _need(ruler, "tasks", list, "ruler.")
    _need(ruler, "samples", int, "ruler.")
    _need(protocol, "goals", list, "")
    return protocol


def checked_power(protocol: dict) -> float:
    """The power the protocol states (`power_checked`), recomputed: the test's probability of finding PoSE better
    (or, with `direction: worse`, worse) at the stated true accuracies."""
    p = protocol["power_checked"]
    if p.get("direction", "better") == "worse":
        return power(p["control"], p["trials"], p["pose"], p["trials"])
    return power(p["pose"], p["trials"], p["control"], p["trials"])


def checked_equivalence_power(protocol: dict) -> dict:
    """An amendment's stated power of its equivalence test, recomputed: per length, at the assumed accuracy for both
    runs and the amended trial counts, and for the claim (every length equivalent: the product)."""
    margin, assumed = protocol["equivalence"]["margin"], protocol["power"]["assumed"]
    trials = protocol["passkey"]["trials"]
    lengths = {n: equivalence_power(assumed[n], trials[n], assumed[n], trials[n], margin, Z90)
               for n in protocol["equivalence"]["lengths"]}
    return {"lengths": lengths, "claim": math.prod(lengths.values())}


def difference_tests(protocol: dict, runs: dict) -> list[dict]:
    """The pre-registered tests over `runs` ({name: {"passkey": {length: accuracy}, "passkey_trials": {length: n}}},
    lengths as strings, as in results.json)."""
    roles = {name: r["role"] for name, r in protocol["runs"].items()}
    out = []
    for length in protocol["test"]["lengths"]:
        key = str(length)
        for pose in (n for n, role in roles.items() if role == "pose" and key in runs.get(n, {}).get("passkey", {})):
            for control in (n for n, role in roles.items() if role in ("training-free", "control")):
                if key not in runs.get(control, {}).get("passkey", {}):
                    continue
                counts = _counts(runs, pose, key) + _counts(runs, control, key)
                d, low, high = difference_interval(*counts)
                out.append({"length": length, "pose": pose, "control": control, "difference": d,
                            "ci95": [low, high], "verdict": verdict(low, high),
                            "counts": {pose: counts[:2], control: counts[2:]}})
    return out


def _counts(runs: dict, name: str, key: str) -> list[int]:
    n = runs[name]["passkey_trials"][key]
    return [round(runs[name]["passkey"][key] * n), n]


def equivalence_tests(protocol: dict, runs: dict) -> list[dict]:
    """The amendment's equivalence test of every run of role `pose` against every `control` (`runs` as for
    `difference_tests`): passkey at each of `equivalence.lengths` (Newcombe's 90% interval inside +-margin) and the
    target perplexity (PoSE / control within 1 +- its margin); [] without an equivalence test. Comparisons whose
    numbers are missing are left out."""
    spec = protocol.get("equivalence")
    if not spec:
        return []
    roles = {name: r["role"] for name, r in protocol["runs"].items()}
    out = []
    for pose in (n for n, role in roles.items() if role == "pose"):
        for control in (n for n, role in roles.items() if role == "control"):
            for length in spec["lengths"]:
                key = str(length)
                if all(key in runs.get(n, {}).get("passkey", {}) for n in (pose, control)):
                    counts = _counts(runs, pose, key) + _counts(runs, control, key)
                    d, low, high, said = equivalence(*counts, spec["margin"])
                    out.append({"measure": "passkey", "length": length, "pose": pose, "control": control,
                                "difference": d, "ci90": [low, high], "margin": spec["margin"], "verdict": said,
                                "counts": {pose: counts[:2], control: counts[2:]}})
            ppl = spec["perplexity"]
            a, b = (runs.get(n, {}).get("ppl", {}).get(str(ppl["length"])) for n in (pose, control))
            if a is not None and b is not None:
                ratio = a / b
                said = "equivalent" if 1 - ppl["margin"] <= ratio <= 1 + ppl["margin"] else "not shown equivalent"
                out.append({"measure": "perplexity", "length": ppl["length"], "pose": pose, "control": control,
                            "ppl": [a, b], "ratio": ratio, "margin": ppl["margin"], "verdict": said})
    return out


def discordant(a: list[dict], b: list[dict]) -> tuple[int, int]:
    """(a right and b wrong, a wrong and b right) over matched trials (the same index: same key, depth, filler)."""
    if len(a) != len(b):
        raise ValueError(f"matched trials need equal counts, got {len(a)} and {len(b)}")
    return (sum(1 for x, y in zip(a, b) if x["correct"] and not y["correct"]),
            sum(1 for x, y in zip(a, b) if y["correct"] and not x["correct"]))


def select_recipe(protocol: dict, screening: dict, base_ppl_unseen: float,
                  names: list[str] | None = None) -> str | None:
    """The recipe that wins the screening, by the protocol's `recipe.selection` rule, or None while the measured
    values leave it open. `screening` maps each candidate to {"passkey": {length: accuracy}, "ppl_unseen": float,
    "ppl": float} (lengths as ints). Qualified: passkey >= 0.95 at the shortest screened length and unseen-domain
    perplexity within 3% of the base's (`base_ppl_unseen`); among them the highest passkey at the longest screened
    length, ties broken by the lower target perplexity; with none qualified, the highest passkey at the shortest
    length (ties: the lower target perplexity). Deciding needs every candidate's short passkey and unseen
    perplexity, the pool's passkey at the deciding length and the target perplexity of those tied at its top; a
    value nothing else depends on cannot change the winner, so it is not waited for. `names`: choose among these
    instead of the screening's candidates (the headline: the confirmation's PoSE runs on their own trials)."""
    candidates = list(names or protocol["recipe"]["candidates"])
    lengths = sorted(protocol["recipe"]["screening"]["passkey_trials"])
    short, long = lengths[0], lengths[-1]

    def passkey(c: str, length: int) -> float | None:
        return screening.get(c, {}).get("passkey", {}).get(length)

    if any(passkey(c, short) is None or screening.get(c, {}).get("ppl_unseen") is None for c in candidates):
        return None
    qualified = [c for c in candidates if passkey(c, short) >= 0.95
                 and abs(screening[c]["ppl_unseen"] / base_ppl_unseen - 1) <= 0.03]
    pool, length = (qualified, long) if qualified else (candidates, short)
    if len(pool) == 1:
        return pool[0]
    if any(passkey(c, length) is None for c in pool):
        return None
    best = max(passkey(c, length) for c in pool)
    top = [c for c in pool if passkey(c, length) == best]
    if len(top) == 1:
        return top[0]
    if any(screening[c].get("ppl") is None for c in top):
        return None
    return min(top, key=lambda c: screening[c]["ppl"])
