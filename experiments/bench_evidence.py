"""The pre-registered evidence for the real model: runs `benchmarks/protocols/real_model.yaml` as it stands.

    python -m experiments.bench_evidence [--stage screen|train|eval|report|all|status] [--only RUN] [--max-length N]

Every run of the protocol is evaluated with the project's own commands and the SmolLM2 GGUF file:
- trained runs are rebuilt from their committed LoRA adapters (`adapters/<train>/`: `pose_mlx.convert` + the
  adapter files) or fine-tuned with the protocol's settings (`--sampler plain --schedule none` for the `adapt-*`
  controls, one fine-tuning for all of them, extended at load with their schedule);
- evaluations run cheapest first across runs (unseen-domain perplexity at 2k, then passkey at each length in
  increasing order, 32k perplexity, RULER), each cached as one JSON in `results/real_model/protocol/eval/`, so an
  interrupted benchmark goes on where it stopped, in another session or on another machine (each JSON records the
  device that gave it); `--max-length` stops short of the long lengths on a slow machine;
- the report stage writes the protocol's keys into `results/real_model/results.json`: `protocol`, `headline`,
  `tests`, and for each of the protocol's runs its confirmation numbers (`passkey`, `passkey_trials`,
  `ppl_unseen`, `ppl`, `ruler`, the devices) on top of its entry in `runs`, the exploratory stage's numbers
  (`bench_real_model`, which keeps them there) under its `exploratory` key; and `protocol/report.md`,
  `protocol/passkey.png`, `protocol/tests.png` (the tests as a forest plot), with the supplement of
  `experiments.evidence_short_documents` (`ppl_supplement`) where it has run; then it brings `sim_agreement` (the
  simulator's ranking of the methods against the real model's) up to date in both results.json files and the
  simulator's report;
- `--stage status` runs nothing: it lists every evaluation as done (with its device), partly done (the records an
  interrupted run left, which the next run takes up) or waiting.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.common import (REAL_MODEL, ROOT, corpus, model_file, passkey_command, perplexity_command,
                               ruler_command, write_results)
from experiments.evidence_runs import (adapters_folder, cell, collect as collect_records, device, ensure_trained,
                                      model_args, plot_passkey, plot_tests, record_state, records, run_all, run_recorded,
                                      shared_arguments, train_name, trials as trials_in, unseen_corpus)
from experiments.protocol import difference_tests, discordant, load_protocol, select_recipe
from experiments.sim_agreement import refresh as refresh_sim_agreement

EVAL = REAL_MODEL / "protocol" / "eval"
SCREEN = REAL_MODEL / "protocol" / "screen"  # the recipe screening's evaluations (its own seed), never pooled with EVAL
SUPPLEMENT = REAL_MODEL / "protocol" / "supplement"  # experiments.evidence_short_documents: added after the trials


def evaluations(protocol: dict, max_length: int | None) -> list[tuple[str, str, int]]:
    """(run, kind, length) of every evaluation, cheapest first: unseen 2k perplexity, passkey by length, 32k
    perplexity, RULER."""
    runs, target = protocol["runs"], protocol["target"]
    order = [(n, "ppl_unseen", protocol["perplexity"]["unseen"]["length"]) for n in runs]
    trials = protocol["passkey"]["trials"]
    for length in sorted(trials):
        order += [(n, "passkey", length) for n in runs]
    order += [(n, "ppl", target) for n in runs]
    order += [(n, "ruler", length) for length in protocol["ruler"]["lengths"] for n in runs]
    return [item for item in order if max_length is None or item[2] <= max_length]


def standing(name: str, kind: str, length: int, protocol: dict, screening: bool = False) -> str:
    """Where one evaluation stands (`evidence_runs.record_state`)."""
    path = (SCREEN if screening else EVAL) / f"{name}.{kind}.{length}.json"
    return record_state(path, records(name, kind, length, protocol, screening))


def evaluate(name: str, kind: str, length: int, protocol: dict, gguf: Path, work: Path, test: Path,
             screening: bool = False) -> Path:
    """One cached evaluation's JSON (run when missing): of the confirmation stage, or with `screening` of the
    recipe screening (its own folder, passkey seed and trial counts)."""
    folder = SCREEN if screening else EVAL
    path = folder / f"{name}.{kind}.{length}.json"
    if path.is_file():
        return path
    spec = protocol["runs"].get(name, {"role": "pose"}) if screening else protocol["runs"][name]
    args = model_args(name, spec, protocol, gguf, work)
    log = work / "logs" / f"{'screen' if screening else 'protocol'}.{name}.{kind}.{length}.log"
    if kind == "passkey":
        seed = protocol["recipe"]["screening"]["passkey_seed"] if screening else protocol["passkey"]["seed"]
        cmd = passkey_command(args, length, records(name, kind, length, protocol, screening), seed)
    elif kind == "ppl_unseen":
        u = protocol["perplexity"]["unseen"]
        cmd = perplexity_command(args, unseen_corpus(protocol, work), length, u["stride"], len(u["files"]), u["span"])
    elif kind == "ppl":
        docs = protocol["perplexity"]["target"]["documents"]
        cmd = perplexity_command(args, test, length, length, docs, length - 1)
    else:
        r = protocol["ruler"]
        cmd = ruler_command(args, str(length), ",".join(r["tasks"]), r["samples"], r["seed"])
    return run_recorded(cmd, path, log)


def screening_numbers(protocol: dict) -> dict:
    """{candidate or "none": {"passkey": {length: accuracy}, "ppl_unseen": ..., "ppl": ...}} of the screening
    evaluations done so far."""
    out = {}
    for path in sorted(p for p in SCREEN.glob("*.json") if ".partial" not in p.name):
        name, kind, length = path.name.removesuffix(".json").rsplit(".", 2)
        record = json.loads(path.read_text())
        entry = out.setdefault(name, {})
        if kind == "passkey":
            entry.setdefault("passkey", {})[int(length)] = sum(t["correct"] for t in record["trials"]) / len(record["trials"])
        else:
            entry[kind] = record["results"][0]["ppl"]
    return out


def screening_winner(protocol: dict, numbers: dict) -> str | None:
    """The winner by the protocol's rule over the screening's `numbers` (None while they leave it open, or before
    the base's unseen-domain perplexity on the screening's device is measured)."""
    base = numbers.get("none", {}).get("ppl_unseen")
    return select_recipe(protocol, numbers, base) if base else None


def screening_evaluations(protocol: dict, candidates: list[str]) -> list[tuple[str, str, int]]:
    """(candidate or "none", kind, length) of the screening's evaluations, cheapest first: the target perplexity
    (one pass over each held-out document) before the passkey trials at the longer lengths (one prompt each)."""
    unseen = protocol["perplexity"]["unseen"]["length"]
    short, *longer = sorted(protocol["recipe"]["screening"]["passkey_trials"])
    tasks = [("none", "ppl_unseen", unseen)] + [(c, "ppl_unseen", unseen) for c in candidates]
    tasks += [(c, "passkey", short) for c in candidates] + [(c, "ppl", protocol["target"]) for c in candidates]
    return tasks + [(c, "passkey", n) for n in longer for c in candidates]


def status(protocol: dict, names: list[str], max_length: int | None) -> list[str]:
    """`--stage status`: one line per evaluation, the confirmation's then the screening's, in the order they
    run, a count of each state (`standing`) and the screening's winner as far as its numbers decide it."""
    lines, counts = [], {}
    candidates = {n: {"role": "pose", **c} for n, c in protocol["recipe"]["candidates"].items()}
    sections = [("confirmation", [t for t in evaluations(protocol, max_length) if t[0] in names],
                 {n: protocol["runs"][n] for n in names}, False),
                ("screening", screening_evaluations(protocol, list(candidates)), candidates, True)]
    for title, tasks, runs, screening in sections:
        folder = SCREEN if screening else EVAL
        lines.append(f"{title} ({folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}):")
        trained = [n for n, spec in runs.items() if spec["role"] in ("control", "pose")]
        untrained = [n for n in trained if not adapters_folder(n, runs[n]).is_dir()]
        lines.append(f"  fine-tunings: {len(trained) - len(untrained)} of {len(trained)} have committed adapters"
                     + (f"; not yet: {', '.join(untrained)}" if untrained else ""))
        for name, kind, length in tasks:
            state = standing(name, kind, length, protocol, screening)
            key = state.split(" ")[0] if state.startswith(("done", "waiting")) else "partial"
            counts[key] = counts.get(key, 0) + 1
            lines.append(f"  {name} {kind} {length}: {state}")
    winner = screening_winner(protocol, screening_numbers(protocol))
    return lines + [", ".join(f"{counts.get(k, 0)} {k}" for k in ("done", "partial", "waiting")),
                    f"screening winner: {winner or 'not decided yet (what decides it is unmeasured)'}"]


def screen(protocol: dict, gguf: Path, work: Path, train: Path, test: Path, jobs: int,
           only: list[str] | None = None) -> str | None:
    """The recipe screening: fine-tune every candidate (or those in `only`) with the protocol's settings, evaluate
    those trained on the screening's own trials (and the base's unseen-domain perplexity on the same device), write
    `protocol/screening.json` and return the winner by the protocol's rule, over every candidate's cached numbers
    (None while they leave it open)."""
    recipe = protocol["recipe"]
    candidates = {name: {"role": "pose", "train": c["train"]} for name, c in recipe["candidates"].items()
                  if not only or name in only}
    untrained = run_all([(name, spec, protocol, gguf, work, train) for name, spec in candidates.items()],
                        ensure_trained, jobs, label=1)
    candidates = {name: spec for name, spec in candidates.items() if name not in {t[0] for t in untrained}}
    tasks = screening_evaluations(protocol, list(candidates))
    failed = len(untrained) + len(run_all([(*t, protocol, gguf, work, test, True) for t in tasks], evaluate, jobs))
    numbers = screening_numbers(protocol)
    winner = screening_winner(protocol, numbers)
    write_results("screening", {"selection": recipe["selection"], "numbers": numbers, "winner": winner,
                                "failed": failed}, SCREEN.parent / "screening.json")
    return winner


def with_winner(protocol: dict) -> dict:
    """The protocol with the screening's winner (if decided) among its runs, as role pose."""
    path = SCREEN.parent / "screening.json"
    winner = json.loads(path.read_text())["winner"] if path.is_file() else None
    if winner and winner not in protocol["runs"]:
        protocol["runs"][winner] = {"role": "pose", "train": protocol["recipe"]["candidates"][winner]["train"]}
    return protocol


def collect(protocol: dict) -> dict:
    """results.json's per-run entries of the confirmation stage, from the cached evaluations, with the
    short-documents supplement where it has run."""
    runs = collect_records(protocol, EVAL)
    for name, entry in runs.items():
        entry.update(supplement(name, protocol))
    return runs


def trials(name: str, kind: str, length: int) -> list[dict] | None:
    """A cached evaluation's per-trial records, or None."""
    return trials_in(EVAL, name, kind, length)


def goal_rows(protocol: dict, runs: dict, name: str) -> list[tuple[str, object, bool | None]]:
    """(goal, value, held or None while unmeasured) of the protocol's goals for run `name`."""
    def get(run, key, length):
        return runs.get(run, {}).get(key, {}).get(str(length))

    base8, pk8 = get("none", "passkey", 8192), get(name, "passkey", 8192)
    ppl2, base2 = get(name, "ppl_unseen", 2048), get("none", "ppl_unseen", 2048)
    controls = [get(n, "ppl", protocol["target"]) for n, r in protocol["runs"].items() if r["role"] == "control"]
    ppl32 = get(name, "ppl", protocol["target"])
    best = min((c for c in controls if c is not None), default=None)
    rows = [("passkey >= 0.95 at 4096", get(name, "passkey", 4096), lambda v: v >= 0.95),
            ("passkey at 8192 >= the base's - 0.05", pk8,
             None if base8 is None else (lambda v: v >= base8 - 0.05)),
            ("passkey >= 0.9 at 16384", get(name, "passkey", 16384), lambda v: v >= 0.9),
            ("passkey >= 0.85 at 32768", get(name, "passkey", 32768), lambda v: v >= 0.85),
            ("unseen-domain perplexity at 2048 within 3% of the base's", ppl2,
             None if base2 is None else (lambda v: abs(v / base2 - 1) <= 0.03)),
            ("perplexity at 32768 below the best control's", ppl32,
             None if best is None or None in controls else (lambda v: v < best))]
    return [(goal, value, None if value is None or check is None else bool(check(value)))
            for goal, value, check in rows]


def supplement(name: str, protocol: dict) -> dict:
    """{"ppl_supplement": {target: ...}} of a run whose held-out documents too short for the target were scored
    whole (`experiments.evidence_short_documents`): their perplexity and documents, and the perplexity over all
    held-out documents, token-weighted with the registered record, exp((n1 ln p1 + n2 ln p2) / (n1 + n2)); {}
    while either record is missing."""
    target = protocol["target"]
    paths = (EVAL / f"{name}.ppl.{target}.json", SUPPLEMENT / f"{name}.ppl_whole.{target}.json")
    if not all(p.is_file() for p in paths):
        return {}
    registered, short = (json.loads(p.read_text()) for p in paths)
    (p1, n1), (p2, n2) = [(r["results"][0]["ppl"], r["results"][0]["tokens"]) for r in (registered, short)]
    return {"ppl_supplement": {str(target): {
        "short_documents": short["documents"], "ppl_short": p2, "tokens_short": n2, "device": short.get("device"),
        "documents_all": registered["documents"] + short["documents"],
        "ppl_all": math.exp((n1 * math.log(p1) + n2 * math.log(p2)) / (n1 + n2))}}}


def write_report(protocol: dict, runs: dict, tests: list[dict], head: str) -> Path:
    """protocol/report.md, protocol/passkey.png and protocol/tests.png: the confirmation stage as far as it has run."""
    out = REAL_MODEL / "protocol"
    lengths = sorted(protocol["passkey"]["trials"])
    lines = [f"# Confirmation stage of `{protocol['name']}` (pre-registered: "
             f"`benchmarks/protocols/real_model.yaml`, {protocol['registered']})", "",
             "Every number below comes from the protocol's own trials (passkey seed "
             f"{protocol['passkey']['seed']}); the exploratory stage (seeds 0 and 1) is in `../report.md` and is "
             "never pooled with these. `-`: not run yet. Command: `python -m experiments.bench_evidence`.", "",
             "## Passkey accuracy (trials; 95% Wilson interval), perplexity, RULER", "",
             "| run | role | " + " | ".join(map(str, lengths)) + " | ppl 2k, unseen domain | ppl 32k | "
             + " | ".join(f"RULER {n // 1024}k" for n in protocol["ruler"]["lengths"]) + " |",
             "|---|---|" + "---|" * (len(lengths) + 2 + len(protocol["ruler"]["lengths"]))]
    for name, r in runs.items():
        pk = [cell(r["passkey"][str(n)], r["passkey_trials"][str(n)]) if str(n) in r.get("passkey", {}) else "-"
              for n in lengths]
        ppl2 = r.get("ppl_unseen", {}).get("2048")
        ppl32 = r.get("ppl", {}).get(str(protocol["target"]))
        numbers = ["-" if v is None else f"{v:.2f}" for v in (ppl2, ppl32)]
        for n in protocol["ruler"]["lengths"]:  # the tasks' mean score at each length
            scores = [v for k, v in r.get("ruler", {}).get("scores", {}).items() if k.endswith(f"@{n}")]
            numbers.append(f"{sum(scores) / len(scores):.2f}" if scores else "-")
        lines.append(f"| {name} | {r['role']} | " + " | ".join(pk + numbers) + " |")
    registered = protocol["perplexity"]["target"]["documents"]
    scored = sorted({r["ppl_documents"][str(protocol["target"])] for r in runs.values()
                     if str(protocol["target"]) in r.get("ppl_documents", {})})
    if scored and scored != [registered]:
        lines += ["", f"Perplexity at {protocol['target']}: the protocol registered {registered} held-out documents, "
                  f"but only {' or '.join(map(str, scored))} of them reach {protocol['target']} tokens, so the column is "
                  "over those (a deviation found after the trials ran; the documents were not changed)."]
    extra = {n: r["ppl_supplement"][str(protocol["target"])] for n, r in runs.items()
             if str(protocol["target"]) in r.get("ppl_supplement", {})}
    if extra:
        first = next(iter(extra.values()))
        lines += ["", "Supplement, added after the trials (not a registered number): the held-out documents too "
                  f"short for {protocol['target']} tokens ({first['short_documents']}; {first['tokens_short']:,} "
                  "tokens in all), each scored whole in one window by the same runs (`python -m "
                  "experiments.evidence_short_documents`), and the perplexity over all the held-out documents, "
                  "token-weighted:", "",
                  f"| run | ppl {protocol['target'] // 1024}k, registered | the short document(s), whole | "
                  "all held-out documents |", "|---|---|---|---|"]
        t = str(protocol["target"])
        lines += [f"| {n} | {runs[n]['ppl'][t]:.2f} ({runs[n]['ppl_documents'][t]}) | {e['ppl_short']:.2f} "
                  f"({e['short_documents']}) | {e['ppl_all']:.2f} ({e['documents_all']}) |" for n, e in extra.items()]
    lines += ["", "## The pre-registered test", "",
              "PoSE minus control passkey accuracy; Newcombe's hybrid score interval, 95%; better if the interval "
              "lies above 0, worse if below, else not distinguishable. Discordant pairs: matched trials (same key, "
              "depth and filler) only PoSE / only the control got right.", "",
              "| length | PoSE | control | difference | 95% interval | verdict | discordant |", "|---|---|---|---|---|---|---|"]
    for t in tests:
        pairs = t.get("discordant")
        lines.append(f"| {t['length']} | {t['pose']} | {t['control']} | {t['difference']:+.2f} | "
                     f"{t['ci95'][0]:+.2f} .. {t['ci95'][1]:+.2f} | {t['verdict']} | "
                     + (f"{pairs['pose_only']} / {pairs['control_only']}" if pairs else "-") + " |")
    if not tests:
        lines.append("| - | - | - | - | - | not run yet | - |")
    else:
        lines += ["", "![the pre-registered tests as a forest plot](tests.png)"]
    lines += ["", f"## Goals of the headline run ({head})", "", "| goal | value | held |", "|---|---|---|"]
    for goal, value, held in goal_rows(protocol, runs, head):
        shown = "-" if value is None else f"{value:.2f}"
        lines.append(f"| {goal} | {shown} | {({True: 'yes', False: '**no**', None: 'not measured yet'})[held]} |")
    base2, own2 = (runs.get(n, {}).get("ppl_unseen", {}).get("2048") for n in ("none", head))
    if base2 and own2 and own2 < 0.97 * base2:
        lines += ["", f"The unseen-domain goal is read as registered, both ways (\"within 3%\"): {head} is "
                  f"{1 - own2 / base2:.1%} *below* the base there, which no reading counts as a regression, but the "
                  "rule as written is not met and stays so."]
    lines += screening_section(protocol)
    devices = sorted({d for r in runs.values() for d in r.get("devices", {}).values() if d})
    lines += ["", "Devices that gave these numbers: " + ("; ".join(devices) or "none yet") + "."]
    if any(d.startswith("Device(gpu, 0) on") for d in devices):
        lines += ["Records that name no GPU model were written before the records named it, on the H200 lent on "
                  "2026-11-26 (see `docs/evidence.md`)."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot_passkey(runs, lengths, protocol["original"], out / "passkey.png")
    plot_tests(tests, out / "tests.png")
    return out / "report.md"


def screening_section(protocol: dict) -> list[str]:
    """The recipe screening's table (its own trials, seed `recipe.screening.passkey_seed`) as far as it has run."""
    numbers = screening_numbers(protocol)
    if not numbers:
        return []
    lengths = sorted(protocol["recipe"]["screening"]["passkey_trials"])
    base = numbers.get("none", {}).get("ppl_unseen")
    winner = screening_winner(protocol, numbers)
    lines = ["", "## Recipe screening (its own trials; never pooled with the table above)", "",
             f"Selection rule: {protocol['recipe']['selection']}", "",
             "| candidate | " + " | ".join(f"passkey {n}" for n in lengths) +
             " | ppl 2k, unseen domain (vs the base's) | ppl 32k |", "|---|" + "---|" * (len(lengths) + 2)]
    for name in protocol["recipe"]["candidates"]:
        r = numbers.get(name, {})
        pk = [f"{r['passkey'][n]:.2f}" if n in r.get("passkey", {}) else "-" for n in lengths]
        unseen = r.get("ppl_unseen")
        shown = "-" if unseen is None else f"{unseen:.2f}" + (f" ({unseen / base - 1:+.1%})" if base else "")
        ppl = r.get("ppl")
        lines.append(f"| {name} | " + " | ".join(pk) + f" | {shown} | {'-' if ppl is None else f'{ppl:.2f}'} |")
    lines += ["", f"The base's unseen-domain perplexity on the screening's device: "
              f"{'-' if base is None else f'{base:.2f}'}. Winner: {winner or 'not decided yet (what decides it is unmeasured)'}."]
    if any(c["train"].get("loss_scale", 1) > 1 for c in protocol["recipe"]["candidates"].values()):
        lines += ["", "Candidates named `*-scaled` are the second screening stage: the same recipes fine-tuned with the "
                  "loss scaled by `train.loss_scale` (float16 gradients keep their digits; `docs/evidence.md`), "
                  "registered after the first stage's results; the others were fine-tuned unscaled (`loss_scale: 1`)."]
    if "pose-yarn-again" in numbers:
        lines += ["", "`pose-yarn-again` is the confirmation's PoSE + YaRN recipe fine-tuned again beside the candidates, "
                  "on their device: a recipe pays if it beats this row, not the confirmation's run (see "
                  "`docs/evidence.md`, where a run was trained)."]
    return lines


def headline(protocol: dict, runs: dict) -> str:
    """The recommended PoSE run: the only one of role pose, else the better by the recipe selection rule
    (`select_recipe`) over their confirmation numbers (passkey at the screened lengths, unseen-domain and target
    perplexity) against the base's unseen-domain perplexity; while those leave it open, the first of them
    measured at the target."""
    pose = [n for n, r in protocol["runs"].items() if r["role"] == "pose"]
    unseen, target = str(protocol["perplexity"]["unseen"]["length"]), str(protocol["target"])
    numbers = {n: {"passkey": {int(k): v for k, v in runs.get(n, {}).get("passkey", {}).items()},
                   "ppl_unseen": runs.get(n, {}).get("ppl_unseen", {}).get(unseen),
                   "ppl": runs.get(n, {}).get("ppl", {}).get(target)} for n in pose}
    base = next((r.get("ppl_unseen", {}).get(unseen) for n, r in runs.items()
                 if protocol["runs"].get(n, {}).get("role") == "base"), None)
    chosen = select_recipe(protocol, numbers, base, names=pose) if base else None
    return chosen or next((n for n in pose if numbers[n]["passkey"].get(int(target)) is not None), pose[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_arguments(p)
    p.add_argument("--stage", choices=("screen", "train", "eval", "report", "all", "status"), default="all",
                   help="what to run (screen: the recipe screening, whose winner then joins the runs; status: "
                        "runs nothing, lists each evaluation as done, partly done or waiting)")
    p.add_argument("--jobs", type=int, default=1,
                   help="evaluations (and fine-tunings) run at once, each its own process (default 1; a GPU "
                        "with room for several models takes more)")
    p.add_argument("--only", action="append", default=None, help="only these runs, or with --stage screen these candidates (repeatable)")
    p.add_argument("--max-length", type=int, default=None,
                   help="evaluate only lengths up to this (the rest waits for a faster machine)")
    args = p.parse_args(argv)
    protocol = load_protocol(args.protocol)
    unknown = sorted(set(args.only or ()) - set(protocol["runs"]) - set(protocol["recipe"]["candidates"]))
    if unknown:
        p.error(f"--only: no run or candidate named {', '.join(unknown)} in {args.protocol}")
    if args.stage == "status":
        protocol = with_winner(protocol)
        names = [n for n in protocol["runs"] if not args.only or n in args.only]
        print("\n".join(status(protocol, names, args.max_length)))
        return 0
    gguf = model_file()
    train, test = corpus(args.work, 4, args.docs)
    if args.stage != "report":
        print(f"device: {device()}", flush=True)
    if args.stage == "screen":
        winner = screen(protocol, gguf, args.work, train, test, args.jobs, args.only)
        print(f"screening winner: {winner or 'not decided yet'}", flush=True)
        return 0
    protocol = with_winner(protocol)
    names = [n for n in protocol["runs"] if not args.only or n in args.only]
    failed = 0
    if args.stage in ("train", "eval", "all"):
        trained = [n for n in names if protocol["runs"][n]["role"] in ("control", "pose")]
        # one fine-tuning serves all controls: rebuild it once before the others run beside each other
        for name in [n for n in trained if train_name(n, protocol["runs"][n]) == "adapt"][:1]:
            ensure_trained(name, protocol["runs"][name], protocol, gguf, args.work, train)
        failed += len(run_all([(n, protocol["runs"][n], protocol, gguf, args.work, train) for n in trained],
                              ensure_trained, args.jobs, label=1))
    if args.stage in ("eval", "all"):
        unseen_corpus(protocol, args.work)
        tasks = [(n, kind, length, protocol, gguf, args.work, test)
                 for n, kind, length in evaluations(protocol, args.max_length) if n in names]
        failed += len(run_all(tasks, evaluate, args.jobs))
    results_path = REAL_MODEL / "results.json"
    results = json.loads(results_path.read_text())
    runs = collect(protocol)
    tests = difference_tests(protocol, runs)
    for t in tests:
        a, b = (trials(t["pose"], "passkey", t["length"]), trials(t["control"], "passkey", t["length"]))
        if a is not None and b is not None and len(a) == len(b):
            t["discordant"] = dict(zip(("pose_only", "control_only"), discordant(a, b)))
    for name, entry in runs.items():  # the confirmation stage at the top of each run, the exploratory one kept
        earlier = results["runs"].get(name, {})
        exploratory = earlier.get("exploratory", {}) if earlier.get("stage") == "confirmation" else earlier
        results["runs"][name] = {"stage": "confirmation", **entry, **({"exploratory": exploratory} if exploratory else {})}
    results.pop("protocol_runs", None)
    head = headline(protocol, runs)
    if "exploratory_goals" not in results:  # the exploratory stage's goals, once under `goals`
        results["exploratory_goals"] = results.pop("goals", [])
    results.update(protocol=str(args.protocol.resolve().relative_to(ROOT)), tests=tests, headline=head,
                   goals=[{"run": head, "goal": g, "value": v, "held": h} for g, v, h in goal_rows(protocol, runs, head)])
    write_results("real_model", {k: v for k, v in results.items() if k != "benchmark"}, results_path)
    report = write_report(protocol, runs, tests, results["headline"])
    print(f"wrote {results_path} and {report}", flush=True)
    agreement = refresh_sim_agreement(real=results_path)  # the simulator's ranking against these runs, too
    print(f"sim_agreement: perplexity tau {agreement['ppl_tau']}, passkey tau {agreement['passkey_tau']} over "
          f"{', '.join(agreement['methods'])}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
