"""The pre-registered evaluation protocols (`benchmarks/protocols/*.yaml`): loading, its schema, and the tests it
names, computed from a run's passkey trials.

`load_protocol(path)` returns the file as a dict after checking every key the benchmark reads (ValueError naming
the first one that is missing or of the wrong kind). `difference_tests(protocol, runs)` gives, for every run of
role `pose` against every run of role `training-free` or `control` and every length of `test.lengths`, the
difference of passkey accuracies with Newcombe's 95% interval and the protocol's verdict; runs without trials at a
length are left out. `discordant(a, b)` counts the matched trials one run gets right and the other wrong.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.common import ROOT
from pose_mlx.analysis.stats import difference_interval, power, verdict

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


def load_protocol(path: str | Path) -> dict:
    """The protocol at `path`, its schema checked."""
    protocol = yaml.safe_load(Path(path).read_text())
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
    at the stated true accuracies."""
    p = protocol["power_checked"]
    return power(p["pose"], p["trials"], p["control"], p["trials"])


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
                counts = []
                for name in (pose, control):
                    n = runs[name]["passkey_trials"][key]
                    counts += [round(runs[name]["passkey"][key] * n), n]
                d, low, high = difference_interval(*counts)
                out.append({"length": length, "pose": pose, "control": control, "difference": d,
                            "ci95": [low, high], "verdict": verdict(low, high),
                            "counts": {pose: counts[:2], control: counts[2:]}})
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
