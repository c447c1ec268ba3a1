"""The 8x addendum (`benchmarks/protocols/real_model_8x.yaml`): SmolLM2-135M-Instruct, 8k -> 64k.

    python -m experiments.evidence_8x [--stage train|decisive|eval|report|all|status] [--only RUN]
                                     [--max-length N] [--jobs N] [--budget SECONDS]

Runs what the addendum registers with the project's own commands (`experiments.evidence_runs`): the one new
fine-tuning (`pose-yarn-64k`, the 4x headline's recipe with target 65,536) and the committed plain fine-tuning
of real_model-v1 (`adapt`, scaled 8x at load); evaluations cheapest first (unseen-domain perplexity at 2k,
passkey at 16k, 32k, 64k, perplexity at 64k on CPython's NEWS, RULER at 64k), each a record in
`results/real_model/protocol_8x/eval/` that names its device, resumable from its partial record. `decisive` runs
first what the goal is judged on (`decisive_evaluations`: the passkey and perplexity at 64k of PoSE + YaRN, then
of each training-free run, then of each control). The base's 16k
and 32k passkey trials are real_model-v1's (the same model and trials), read from its records. `--budget` stops
the running evaluation (SIGTERM: it keeps its finished trials) and starts no other when the time is spent.
The report stage writes `factor_8x` into `results/real_model/results.json` (the 4x block's schema: `runs`,
`tests`; plus the perplexity tests and the goal), and `protocol_8x/report.md`, `passkey.png`, `tests.png`.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from experiments.bench_evidence import EVAL as EVAL_4X
from benchmarks.common import (REAL_MODEL, OutOfTime, corpus, model_file, passkey_command, perplexity_command,
                               ruler_command, set_budget, write_results)
from experiments.evidence_runs import (addendum_arguments, addendum_settings, cell, collect, device, ensure_trained,
                                      model_args, plot_passkey, plot_tests, record_state, records, run_all,
                                      run_recorded, trials, unseen_corpus)
from experiments.protocol import PROTOCOLS, difference_tests, discordant

PROTOCOL = PROTOCOLS / "real_model_8x.yaml"
OUT = REAL_MODEL / "protocol_8x"
EVAL = OUT / "eval"
#: The base's passkey lengths whose records are real_model-v1's (the same model, seed and trial counts).
BASE_FROM_4X = (16384, 32768)


def evaluations(protocol: dict, max_length: int | None = None) -> list[tuple[str, str, int]]:
    """(run, kind, length) of every evaluation this addendum runs, cheapest first."""
    runs, target = protocol["runs"], protocol["target"]
    order = [(n, "ppl_unseen", protocol["perplexity"]["unseen"]["length"]) for n in runs]
    for length in sorted(protocol["passkey"]["trials"]):
        order += [(n, "passkey", length) for n in runs if not (runs[n]["role"] == "base" and length in BASE_FROM_4X)]
    order += [(n, "ppl", target) for n in runs]
    order += [(n, "ruler", length) for length in protocol["ruler"]["lengths"] for n in runs]
    return [t for t in order if max_length is None or t[2] <= max_length]


def decisive_evaluations(protocol: dict) -> list[tuple[str, str, int]]:
    """(run, kind, length) of what the goal is judged on: the passkey and perplexity at the target of every run of
    role pose, then training-free, then control (each role in the protocol's order), each run's passkey first."""
    runs, target = protocol["runs"], protocol["target"]
    ordered = [n for role in ("pose", "training-free", "control") for n in runs if runs[n]["role"] == role]
    return [(n, kind, target) for n in ordered for kind in ("passkey", "ppl")]


def news_corpus(protocol: dict, work: Path) -> Path:
    """A folder holding the target perplexity's text, CPython's NEWS, decompressed (one document)."""
    folder = work / "news"
    target = folder / "NEWS.txt"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with gzip.open(protocol["perplexity"]["target"]["source"], "rt", encoding="utf-8") as f:
            target.write_text(f.read())
    return folder


def evaluate(name: str, kind: str, length: int, protocol: dict, gguf: Path, work: Path) -> Path:
    """One evaluation's record (run when missing)."""
    path = EVAL / f"{name}.{kind}.{length}.json"
    if path.is_file():
        return path
    spec = protocol["runs"][name]
    args = model_args(name, spec, protocol, gguf, work)
    if kind == "passkey":
        cmd = passkey_command(args, length, records(name, kind, length, protocol), protocol["passkey"]["seed"])
    elif kind == "ppl_unseen":
        u = protocol["perplexity"]["unseen"]
        cmd = perplexity_command(args, unseen_corpus(protocol, work), length, u["stride"], len(u["files"]), u["span"])
    elif kind == "ppl":  # consecutive windows of BOS + (length - 1) tokens over the one document
        windows = protocol["perplexity"]["target"]["windows"]
        cmd = perplexity_command(args, news_corpus(protocol, work), length, length - 1, 1, windows * (length - 1))
    else:
        r = protocol["ruler"]
        cmd = ruler_command(args, str(length), ",".join(r["tasks"]), r["samples"], r["seed"])
    return run_recorded(cmd, path, work / "logs" / f"protocol_8x.{name}.{kind}.{length}.log")


def gather(protocol: dict) -> dict:
    """The runs' numbers from this addendum's records, the base's 16k and 32k passkey from real_model-v1's."""
    runs = collect(protocol, EVAL)
    base = next(n for n, r in protocol["runs"].items() if r["role"] == "base")
    for length in BASE_FROM_4X:
        found = trials(EVAL_4X, base, "passkey", length)
        if found is not None:
            entry = runs[base]
            entry.setdefault("passkey", {})[str(length)] = sum(t["correct"] for t in found) / len(found)
            entry.setdefault("passkey_trials", {})[str(length)] = len(found)
            entry.setdefault("devices", {})[f"passkey.{length}"] = "real_model-v1's record"
    return runs


def passkey_trials(name: str, length: int, protocol: dict) -> list[dict] | None:
    base = protocol["runs"][name]["role"] == "base" and length in BASE_FROM_4X
    return trials(EVAL_4X if base else EVAL, name, "passkey", length)


def perplexity_tests(protocol: dict, runs: dict) -> list[dict]:
    """PoSE's target perplexity against every training-free run and control: the ratio and the registered
    verdict (better at most `better_below` x the other's, worse at least `worse_above` x)."""
    rule = protocol["test"]["perplexity"]
    key = str(rule["length"])
    out = []
    for pose in (n for n, r in protocol["runs"].items() if r["role"] == "pose"):
        for other in (n for n, r in protocol["runs"].items() if r["role"] in ("training-free", "control")):
            a, b = (runs.get(n, {}).get("ppl", {}).get(key) for n in (pose, other))
            if a is None or b is None:
                continue
            ratio = a / b
            verdict = ("better" if ratio <= rule["better_below"] else "worse" if ratio >= rule["worse_above"]
                       else "not distinguishable")
            out.append({"length": rule["length"], "pose": pose, "control": other, "ppl": [a, b], "ratio": ratio,
                        "verdict": verdict})
    return out


def goal(protocol: dict, tests: list[dict], ppl_tests: list[dict]) -> dict:
    """The registered goal at the target: for every training-free run and control, PoSE better on passkey or on
    perplexity and not worse on the other. `held` is None while a comparison is unmeasured."""
    target = protocol["target"]
    others = [n for n, r in protocol["runs"].items() if r["role"] in ("training-free", "control")]
    rows = {}
    for other in others:
        pk = next((t["verdict"] for t in tests if t["control"] == other and t["length"] == target), None)
        pp = next((t["verdict"] for t in ppl_tests if t["control"] == other), None)
        held = None if pk is None or pp is None else ("better" in (pk, pp) and "worse" not in (pk, pp))
        rows[other] = {"passkey": pk, "ppl": pp, "held": held}
    states = [r["held"] for r in rows.values()]
    return {"text": protocol["goals"][0], "against": rows,
            "held": None if None in states else all(states)}


def best_training_free(protocol: dict, runs: dict) -> str | None:
    """The training-free run with the most passkey keys at the target, ties to the lower target perplexity; None
    until every training-free run has both."""
    key = str(protocol["target"])
    free = [n for n, r in protocol["runs"].items() if r["role"] == "training-free"]
    numbers = {n: (runs.get(n, {}).get("passkey", {}).get(key), runs.get(n, {}).get("ppl", {}).get(key)) for n in free}
    if any(None in pair for pair in numbers.values()):
        return None
    return min(free, key=lambda n: (-numbers[n][0], numbers[n][1]))


def report(protocol: dict) -> dict:
    """`factor_8x` in results.json, and protocol_8x/report.md with its plots."""
    runs = gather(protocol)
    tests = difference_tests(protocol, runs)
    for t in tests:
        a, b = (passkey_trials(t[k], t["length"], protocol) for k in ("pose", "control"))
        if a is not None and b is not None and len(a) == len(b):
            t["discordant"] = dict(zip(("pose_only", "control_only"), discordant(a, b)))
    ppl_tests = perplexity_tests(protocol, runs)
    block = {"model": protocol["model"], "original": protocol["original"], "target": protocol["target"],
             "protocol": str(PROTOCOL.relative_to(REAL_MODEL.parents[2])), "runs": runs, "tests": tests,
             "headline": next(n for n, r in protocol["runs"].items() if r["role"] == "pose"),
             "best_training_free": best_training_free(protocol, runs), "perplexity_tests": ppl_tests,
             "goal": goal(protocol, tests, ppl_tests)}
    path = REAL_MODEL / "results.json"
    results = json.loads(path.read_text())
    results["factor_8x"] = {**results.get("factor_8x", {}), **block}
    write_results("real_model", {k: v for k, v in results.items() if k != "benchmark"}, path)
    write_report(protocol, block)
    return block


def write_report(protocol: dict, block: dict) -> Path:
    runs, lengths = block["runs"], sorted(protocol["passkey"]["trials"])
    target = str(protocol["target"])
    lines = [f"# `{protocol['name']}`: 8k -> 64k (pre-registered: `benchmarks/protocols/real_model_8x.yaml`, "
             f"{protocol['registered']})", "",
             "Passkey accuracy (trials; 95% Wilson interval), perplexity (2k: unseen domain; 64k: CPython's NEWS, "
             f"{protocol['perplexity']['target']['windows']} windows), RULER at 64k. `-`: not run yet. Command: "
             "`python -m experiments.evidence_8x`.", "",
             "| run | role | " + " | ".join(f"passkey {n // 1024}k" for n in lengths) + " | ppl 2k | ppl 64k | RULER 64k |",
             "|---|---|" + "---|" * (len(lengths) + 3)]
    for name, r in runs.items():
        pk = [cell(r["passkey"][str(n)], r["passkey_trials"][str(n)]) if str(n) in r.get("passkey", {}) else "-"
              for n in lengths]
        scores = list(r.get("ruler", {}).get("scores", {}).values())
        nums = [r.get("ppl_unseen", {}).get("2048"), r.get("ppl", {}).get(target),
                sum(scores) / len(scores) if scores else None]
        lines.append(f"| {name} | {r['role']} | " + " | ".join(pk + ["-" if v is None else f"{v:.2f}" for v in nums]) + " |")
    lines += ["", "## The registered tests", "", "| length | control | passkey difference | 95% interval | verdict |",
              "|---|---|---|---|---|"]
    lines += [f"| {t['length']} | {t['control']} | {t['difference']:+.2f} | {t['ci95'][0]:+.2f} .. {t['ci95'][1]:+.2f} | "
              f"{t['verdict']} |" for t in block["tests"]] or ["| - | - | - | - | not run yet |"]
    lines += ["", "| control | ppl 64k, PoSE / control | ratio | verdict |", "|---|---|---|---|"]
    lines += [f"| {t['control']} | {t['ppl'][0]:.2f} / {t['ppl'][1]:.2f} | {t['ratio']:.3f} | {t['verdict']} |"
              for t in block["perplexity_tests"]] or ["| - | - | - | not run yet |"]
    g = block["goal"]
    lines += ["", f"## Goal: {g['text']}", "", "| against | passkey at 64k | ppl at 64k | held |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['passkey'] or '-'} | {r['ppl'] or '-'} | "
              f"{ {True: 'yes', False: '**no**', None: 'not measured yet'}[r['held']]} |" for n, r in g["against"].items()]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    plot_passkey(runs, lengths, protocol["original"], OUT / "passkey.png")
    plot_tests(block["tests"], OUT / "tests.png")
    return OUT / "report.md"


def main(argv=None) -> int:
    p = addendum_arguments(__doc__, PROTOCOL, ("train", "decisive", "eval", "report", "all", "status"),
                           "what to run (decisive: the goal's 64k evaluations first; status: runs nothing, lists each "
                           "evaluation as done, partly done or waiting)")
    args, protocol, names = addendum_settings(p, argv)
    tasks = [t for t in evaluations(protocol, args.max_length) if t[0] in names]
    if args.stage == "decisive":
        tasks = [t for t in decisive_evaluations(protocol) if t[0] in names and t in tasks]
    if args.stage == "status":
        for name, kind, length in tasks:
            state = record_state(EVAL / f"{name}.{kind}.{length}.json", records(name, kind, length, protocol))
            print(f"{name} {kind} {length}: {state}")
        return 0
    if args.stage in ("decisive", "eval", "all") and "prediction" not in protocol:
        p.error(f"{args.protocol} has no `prediction` yet: the simulator's prediction is registered before any "
                "trial of this addendum (train and report may run)")
    set_budget(args.budget)
    gguf = model_file()
    train, _ = corpus(args.work, 4, args.docs)
    failed = []
    if args.stage in ("train", "decisive", "eval", "all"):
        print(f"device: {device()}", flush=True)
        trained = [n for n in names if protocol["runs"][n]["role"] in ("control", "pose")]
        failed += run_all([(n, protocol["runs"][n], protocol, gguf, args.work, train) for n in trained],
                          ensure_trained, 1, label=1)
    if args.stage in ("decisive", "eval", "all") and not failed:
        failed += run_all([(*t, protocol, gguf, args.work) for t in tasks], evaluate, args.jobs)
    if args.stage in ("report", "decisive", "eval", "all"):
        block = report(protocol)
        print(f"wrote factor_8x to {REAL_MODEL / 'results.json'} and {OUT / 'report.md'}; goal held: "
              f"{block['goal']['held']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OutOfTime as stop:
        print(stop, file=sys.stderr)
        sys.exit(3)
