"""Addendum A (`benchmarks/protocols/real_model_full_length.yaml`, with its amendment 1): PoSE against full-length
fine-tuning at 32k.

    python -m experiments.evidence_full_length [--stage data|train|claim|curve|eval|report|all|status]
                                               [--only RUN] [--max-length N] [--jobs N] [--budget SECONDS]

`data` builds the joined documents both runs train on (`joined_corpus`: the headline's training split, each
top-level folder's files in path order joined with the tokenizer's end-of-sequence token and cut at document
boundaries into pieces of at least 32,768 tokens); `train` fine-tunes PoSE + YaRN and full-length + YaRN on them
with the headline's settings (a GPU's work: one 32k update takes hours on two CPU cores), each point of the 32k
perplexity curve (the paper's Fig. 3c, `experiments.curve`) scored beside it, in `--jobs` lanes, as soon as its
copy of the LoRA weights is saved; `claim` does the same and then, in the same lanes, the evaluations that decide
claim (b) for each run as soon as it is trained (`claim_evaluations`: the 32k perplexity, the passkey at 16k and
32k at the amended counts); `curve` scores copies kept from an earlier run; `eval` runs every registered
evaluation of the trained runs; `report` writes `runs["full-yarn"]`, `runs["pose-yarn-joined"]` and
`full_length` (the registered test and goals, the amendment's equivalence test and claim (b)) into
`results/real_model/results.json`, and `protocol_full/report.md`, `passkey.png`, `tests.png`, `curve.png`. Every
evaluation is a record in `protocol_full/eval/` (the curve's in `protocol_full/curve/`) naming its device,
resumable; `--budget` stops the running commands (a fine-tuning keeps its checkpoint, `CURVE_RESERVE` s early so
that its last copies are scored; an evaluation its finished trials) when the time is spent, exit code 3.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import threading
from pathlib import Path
from queue import PriorityQueue

from benchmarks.common import (REAL_MODEL, OutOfTime, corpus, log_peak_bytes, log_updates, model_file,
                               passkey_command, perplexity_command, ruler_command, set_budget, stopped_by_budget,
                               write_results)
from experiments.evidence_runs import (addendum_arguments, addendum_settings, collect, device, ensure_trained,
                                      model_args, plot_passkey, plot_tests, record_state, records, run_all,
                                      run_recorded, trials, unseen_corpus)
from experiments.curve import CURVE, Snapshots, curve, curve_point, curve_steps, lost, plot_curve
from experiments.protocol import PROTOCOLS, difference_tests, discordant, equivalence_tests

PROTOCOL = PROTOCOLS / "real_model_full_length.yaml"
OUT = REAL_MODEL / "protocol_full"
EVAL = OUT / "eval"


# ------------------------------------------------------------------------------------------ the joined documents


def training_files(docs: Path, test_docs: int = 4) -> list[Path]:
    """The headline's training split: every reST source but the `test_docs` longest (`common.corpus`'s rule)."""
    files = sorted(docs.rglob("*.rst.txt"), key=lambda p: (-p.stat().st_size, str(p)))
    return sorted(files[test_docs:])


def plan_pieces(groups: list[tuple[str, list[tuple[str, int]]]], minimum: int, separator: int = 1) -> list[dict]:
    """Pieces of at least `minimum` tokens from `groups` [(folder, [(file, tokens), ...]), ...] (in order): within
    a folder, files join a piece until it holds >= `minimum` tokens (`separator` tokens between two files); a
    folder's remainder is appended to its last piece, or to the previous folder's last piece when the folder makes
    none (carried into the next folder's first piece when there is no earlier piece)."""
    pieces: list[dict] = []
    carry: dict | None = None
    for folder, files in groups:
        made, current = [], carry or {"folders": [], "files": [], "tokens": 0}
        carry = None
        for name, tokens in files:
            if current["files"]:
                current["tokens"] += separator
            current["files"].append(name)
            current["tokens"] += tokens
            if folder not in current["folders"]:
                current["folders"].append(folder)
            if current["tokens"] >= minimum:
                made.append(current)
                current = {"folders": [], "files": [], "tokens": 0}
        if current["files"]:
            target = made[-1] if made else pieces[-1] if pieces else None
            if target is None:
                carry = current
            else:
                target["tokens"] += separator + current["tokens"]
                target["files"] += current["files"]
                target["folders"] += [f for f in current["folders"] if f not in target["folders"]]
        pieces += made
    if carry is not None:
        raise ValueError(f"the whole text holds {carry['tokens']} tokens, fewer than one piece of {minimum}")
    return pieces


def joined_corpus(docs: Path, gguf: Path, work: Path, minimum: int) -> Path:
    """The folder of joined pieces (one .txt per piece, files joined with the tokenizer's end-of-sequence token)
    and its `pieces.json` (each piece's folders, files and tokens as the fine-tuning will count them)."""
    out = work / "joined"
    if (out / "pieces.json").is_file():
        return out
    from pose_mlx.model.gguf import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    groups: dict[str, list[tuple[str, int]]] = {}
    for path in training_files(docs):
        rel = path.relative_to(docs)
        count = len(tokenizer.encode(path.read_text(), add_special_tokens=False))
        groups.setdefault(rel.parts[0] if len(rel.parts) > 1 else "top", []).append((str(rel), count))
    pieces = plan_pieces(sorted(groups.items()), minimum)
    building = out.with_name(out.name + ".tmp")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    for i, piece in enumerate(pieces):
        text = tokenizer.eos_token.join((docs / f).read_text() for f in piece["files"])
        piece["tokens"] = len(tokenizer.encode(text, add_special_tokens=False)) + 2  # with BOS and EOS
        if piece["tokens"] < minimum:
            raise ValueError(f"piece {i} holds {piece['tokens']} tokens, fewer than {minimum}")
        (building / f"{i:03d}-{'+'.join(piece['folders'])}.txt").write_text(text)
    (building / "pieces.json").write_text(json.dumps({"minimum": minimum, "separator": tokenizer.eos_token,
                                                      "pieces": pieces}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    building.rename(out)
    return out


def data_summary(folder: Path) -> dict:
    """protocol_full/data.json: how many pieces, their tokens (in all, fewest, most) and the folders joined."""
    pieces = json.loads((folder / "pieces.json").read_text())["pieces"]
    tokens = [p["tokens"] for p in pieces]
    summary = {"pieces": len(pieces), "tokens": sum(tokens), "fewest": min(tokens), "most": max(tokens),
               "folders": sorted({f for p in pieces for f in p["folders"]})}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "data.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# ------------------------------------------------------------------------------------------ training, with the curve

#: Seconds a fine-tuning stops before the budget's end, so that the points of the copies it kept are scored.
CURVE_RESERVE = 60.0


def train(name: str, protocol: dict, gguf: Path, work: Path, data: Path, on_saved=None) -> Path:
    """One run's fine-tuning (`ensure_trained`, stopped `CURVE_RESERVE` s before the budget's end), its
    checkpoints' weights kept every `curve_every` updates and handed to `on_saved(step)` (`curve.Snapshots`), and
    its training log kept in protocol_full/train/ (seconds, peak memory and tokens of every update)."""
    every = protocol["perplexity"]["curve_every"]
    watcher = Snapshots(work / "trained" / f"{name}.partial" / "checkpoint", work / "snapshots" / name, every,
                        on_saved)
    watcher.start()
    try:
        folder = ensure_trained(name, protocol["runs"][name], protocol, gguf, work, data, reserve=CURVE_RESERVE)
    finally:
        watcher.done.set()
        watcher.join()
    log = work / "trained" / name / "train_log.jsonl"
    if log.is_file():
        (OUT / "train").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, OUT / "train" / f"{name}.log.jsonl")
    return folder


def trained(name: str) -> bool:
    return (REAL_MODEL / "protocol" / "adapters" / name).is_dir()


def claim(names: list[str], protocol: dict, gguf: Path, work: Path, data: Path | None, test: Path, jobs: int,
          evaluations: bool = True) -> list[tuple]:
    """What decides claim (b), in one pool of `jobs` lanes beside the training lane: each run fine-tuned in turn
    (when its adapters are not committed and `data` is given), each point of its curve scored as its copy is
    saved (first in line), then, with `evaluations`, its claim evaluations (`claim_evaluations`) once it is
    trained. The failed tasks."""
    lanes = Lanes(jobs)
    failed = []
    for name in names:
        if not trained(name) and data is not None:
            try:
                train(name, protocol, gguf, work, data,
                      lambda step, name=name: lanes.put(0, (name, step), curve_point, name, step, protocol, gguf,
                                                        work, test))
            except BaseException as e:  # noqa: BLE001 - the other run and the lanes go on (a budget stop too)
                print(f"{name}: FAILED: {e}", flush=True)
                failed.append((name,))
                continue
        if not (evaluations and trained(name)):
            continue
        ensure_trained(name, protocol["runs"][name], protocol, gguf, work, data)  # committed: only rebuilt
        for task in claim_evaluations(protocol, [name]):
            lanes.put(1, task, evaluate, *task, protocol, gguf, work, test)
    return failed + lanes.finish()


class Lanes:
    """`jobs` worker threads taking tasks by priority (lower first, then in the order put); `finish` waits for
    them all and returns the labels of those that failed (each printed, as `evidence_runs.run_all` does)."""

    def __init__(self, jobs: int):
        self.queue, self.count, self.failed = PriorityQueue(), itertools.count(), []
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(max(1, jobs))]
        for thread in self.threads:
            thread.start()

    def put(self, priority: int, label: tuple, fn, *args) -> None:
        self.queue.put((priority, next(self.count), label, fn, args))

    def _work(self) -> None:
        while True:
            _, _, label, fn, args = self.queue.get()
            if fn is None:
                return
            name = " ".join(map(str, label))
            try:
                print(f"{name}: {fn(*args)}", flush=True)
            except BaseException as e:  # noqa: BLE001 - a failed task (its SystemExit) must not stop the rest
                print(f"{name}: FAILED: {e}", flush=True)
                self.failed.append(label)

    def finish(self) -> list[tuple]:
        for _ in self.threads:
            self.queue.put((9, next(self.count), (), None, ()))
        for thread in self.threads:
            thread.join()
        return self.failed


# ------------------------------------------------------------------------------------------ the evaluations


def claim_evaluations(protocol: dict, names: list[str]) -> list[tuple[str, str, int]]:
    """(run, kind, length) of what decides claim (b) for `names`: the target perplexity, then the passkey at each
    length of the equivalence test (its amended trial counts), shortest first."""
    lengths = protocol.get("equivalence", protocol["test"])["lengths"]
    return [(n, "ppl", protocol["target"]) for n in names] + [
        (n, "passkey", length) for length in sorted(lengths) for n in names]


def evaluations(protocol: dict, max_length: int | None = None) -> list[tuple[str, str, int]]:
    """(run, kind, length) of every registered evaluation, cheapest first (real_model-v1's order)."""
    runs, target = protocol["runs"], protocol["target"]
    order = [(n, "ppl_unseen", protocol["perplexity"]["unseen"]["length"]) for n in runs]
    for length in sorted(protocol["passkey"]["trials"]):
        order += [(n, "passkey", length) for n in runs]
    order += [(n, "ppl", target) for n in runs]
    order += [(n, "ruler", length) for length in protocol["ruler"]["lengths"] for n in runs]
    return [t for t in order if max_length is None or t[2] <= max_length]


def evaluate(name: str, kind: str, length: int, protocol: dict, gguf: Path, work: Path, test: Path) -> Path:
    """One registered evaluation's record (run when missing)."""
    path = EVAL / f"{name}.{kind}.{length}.json"
    if path.is_file():
        return path
    args = model_args(name, protocol["runs"][name], protocol, gguf, work)
    if kind == "passkey":
        cmd = passkey_command(args, length, records(name, kind, length, protocol), protocol["passkey"]["seed"])
    elif kind == "ppl_unseen":
        u = protocol["perplexity"]["unseen"]
        cmd = perplexity_command(args, unseen_corpus(protocol, work), length, u["stride"], len(u["files"]), u["span"])
    elif kind == "ppl":
        cmd = perplexity_command(args, test, length, length, protocol["perplexity"]["target"]["documents"], length - 1)
    else:
        r = protocol["ruler"]
        cmd = ruler_command(args, str(length), ",".join(r["tasks"]), r["samples"], r["seed"])
    return run_recorded(cmd, path, work / "logs" / f"protocol_full.{name}.{kind}.{length}.log")


# ------------------------------------------------------------------------------------------ the report


def training_record(name: str) -> dict | None:
    """From a run's kept training log: updates, tokens seen, median seconds per update (after the first) and the
    largest peak memory, or None before it has trained."""
    steps = log_updates(OUT / "train" / f"{name}.log.jsonl")
    if not steps:
        return None
    seconds = sorted(s["seconds"] for s in steps[1:]) or [steps[0]["seconds"]]
    return {"updates": len(steps), "tokens": sum(s["tokens"] for s in steps),
            "seconds_per_update": seconds[len(seconds) // 2],
            "peak_bytes": log_peak_bytes(steps)}


def claim_b(protocol: dict, equivalence: list[dict]) -> dict | None:
    """Claim (b) under the amendment's equivalence test: held when PoSE is equivalent to Full on every registered
    measure (passkey at each length, the target perplexity), None while one is unmeasured; None without an
    equivalence test."""
    spec = protocol.get("equivalence")
    if not spec:
        return None
    wanted = [("passkey", n) for n in spec["lengths"]] + [("perplexity", spec["perplexity"]["length"])]
    said = {(t["measure"], t["length"]): t["verdict"] for t in equivalence}
    values = {f"{m} {n}": said.get((m, n)) for m, n in wanted}
    held = None if None in values.values() else all(v == "equivalent" for v in values.values())
    return {"claim": "PoSE matches full-length fine-tuning (equivalent within the margins of "
                     f"{', '.join(protocol['amendments'])})", "value": values, "held": held}


def goals(protocol: dict, runs: dict, tests: list[dict], cost: dict) -> list[dict]:
    """The three registered goals, each {"goal", "value", "held" (None while unmeasured)}."""
    pose = next(n for n, r in protocol["runs"].items() if r["role"] == "pose")
    full = next(n for n, r in protocol["runs"].items() if r["role"] == "control")
    key = str(protocol["target"])
    a, b = (runs.get(n, {}).get("ppl", {}).get(key) for n in (pose, full))
    ratio = a / b if a is not None and b is not None else None
    verdicts = {t["length"]: t["verdict"] for t in tests}
    lengths = protocol["test"]["lengths"]
    held_pk = None if any(n not in verdicts for n in lengths) else all(verdicts[n] != "worse" for n in lengths)
    mem = [cost.get(n, {}) and cost[n]["peak_bytes"] for n in (pose, full)]
    share = mem[0] / mem[1] if all(mem) else None
    return [{"goal": protocol["goals"][0], "value": ratio, "held": None if ratio is None else ratio <= 1.05},
            {"goal": protocol["goals"][1], "value": {n: verdicts.get(n) for n in lengths}, "held": held_pk},
            {"goal": protocol["goals"][2], "value": share, "held": None if share is None else share <= 1 / 8}]


def report(protocol: dict) -> dict:
    """results.json's `runs` entries of both runs and its `full_length` block; protocol_full/report.md."""
    runs = collect(protocol, EVAL)
    tests = difference_tests(protocol, runs)
    for t in tests:
        a, b = (trials(EVAL, t[k], "passkey", t["length"]) for k in ("pose", "control"))
        if a is not None and b is not None and len(a) == len(b):
            t["discordant"] = dict(zip(("pose_only", "control_only"), discordant(a, b)))
    cost = {n: training_record(n) for n in protocol["runs"]}
    equivalence = equivalence_tests(protocol, runs)
    block = {"protocol": str(PROTOCOL.relative_to(REAL_MODEL.parents[2])),
             "amendments": protocol.get("amendments", []), "tests": tests, "equivalence": equivalence,
             "claim_b": claim_b(protocol, equivalence), "curve": curve(protocol, runs), "training": cost,
             "goals": goals(protocol, runs, tests, {n: c for n, c in cost.items() if c})}
    path = REAL_MODEL / "results.json"
    results = json.loads(path.read_text())
    for name, entry in runs.items():
        results["runs"][name] = {"stage": "confirmation", "protocol": block["protocol"], **entry}
    results["full_length"] = block
    write_results("real_model", {k: v for k, v in results.items() if k != "benchmark"}, path)
    write_report(protocol, runs, block)
    return block


def write_report(protocol: dict, runs: dict, block: dict) -> Path:
    lengths = sorted(protocol["passkey"]["trials"])
    key = str(protocol["target"])
    lines = [f"# `{protocol['name']}`: PoSE against full-length fine-tuning (pre-registered: "
             f"`benchmarks/protocols/real_model_full_length.yaml`, {protocol['registered']})", "",
             "`-`: not run yet. Command: `python -m experiments.evidence_full_length`.", "",
             "| run | " + " | ".join(f"passkey {n // 1024}k" for n in lengths) + " | ppl 2k unseen | ppl 32k | "
             "updates | tokens seen | s / update | peak memory |", "|---|" + "---|" * (len(lengths) + 6)]
    for name, r in runs.items():
        pk = [f"{r['passkey'][str(n)]:.2f} ({r['passkey_trials'][str(n)]})" if str(n) in r.get("passkey", {}) else "-"
              for n in lengths]
        nums = ["-" if v is None else f"{v:.2f}" for v in (r.get("ppl_unseen", {}).get("2048"), r.get("ppl", {}).get(key))]
        t = block["training"].get(name) or {}
        nums += [str(t.get("updates", "-")), f"{t['tokens']:,}" if t else "-",
                 f"{t['seconds_per_update']:.2f}" if t else "-", f"{t['peak_bytes'] / 1e9:.2f} GB" if t else "-"]
        lines.append(f"| {name} | " + " | ".join(pk + nums) + " |")
    lines += ["", "The registered test (PoSE minus Full, passkey accuracy):", "",
              "| length | PoSE minus Full | 95% interval | verdict |", "|---|---|---|---|"]
    lines += [f"| {t['length']} | {t['difference']:+.2f} | {t['ci95'][0]:+.2f} .. {t['ci95'][1]:+.2f} | {t['verdict']} |"
              for t in block["tests"]] or ["| - | - | - | not run yet |"]
    lines += equivalence_lines(block)
    lines += ["", "| goal | value | held |", "|---|---|---|"]
    for g in block["goals"]:
        value = g["value"] if not isinstance(g["value"], float) else f"{g['value']:.3f}"
        lines.append(f"| {g['goal']} | {value if value is not None else '-'} | "
                     f"{ {True: 'yes', False: '**no**', None: 'not measured yet'}[g['held']]} |")
    lines += ["", "The 32k perplexity after every 25 updates (the paper's Fig. 3c): ![curve](curve.png)"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    plot_passkey(runs, lengths, protocol["original"], OUT / "passkey.png")
    plot_tests(block["tests"], OUT / "tests.png")
    plot_curve(block["curve"], OUT / "curve.png")
    return OUT / "report.md"


def equivalence_lines(block: dict) -> list[str]:
    """The report's table of the amendment's equivalence test and claim (b)'s verdict (nothing without one)."""
    c = block["claim_b"]
    if c is None:
        return []
    lines = ["", f"Claim (b) by the equivalence test of {', '.join(block['amendments'])} (two one-sided tests: "
             "passkey, Newcombe's 90% interval inside the margin; perplexity, the ratio inside 1 +- the margin):", "",
             "| measure | length | PoSE against Full | margin | verdict |", "|---|---|---|---|---|"]
    for t in block["equivalence"]:
        value = (f"{t['difference']:+.3f} ({t['ci90'][0]:+.3f} .. {t['ci90'][1]:+.3f})" if t["measure"] == "passkey"
                 else f"{t['ppl'][0]:.2f} / {t['ppl'][1]:.2f} = {t['ratio']:.3f}")
        lines.append(f"| {t['measure']} | {t['length']} | {value} | {t['margin']} | {t['verdict']} |")
    if not block["equivalence"]:
        lines.append("| - | - | - | - | not run yet |")
    held = {True: "**holds**", False: "**does not hold**", None: "not decided yet"}[c["held"]]
    return lines + ["", f"Claim (b): {held}."]


# ------------------------------------------------------------------------------------------ the command


def status(protocol: dict, names: list[str], max_length: int | None, work: Path) -> list[str]:
    """One line per fine-tuning, registered evaluation and curve point: done, partly done, waiting, or (a point)
    lost: its fine-tuning is over and its copy went unscored."""
    lines = [f"{n} fine-tuning: {'adapters committed' if trained(n) else 'waiting'}" for n in names]
    lines += [f"{n} {k} {length}: {record_state(EVAL / f'{n}.{k}.{length}.json', records(n, k, length, protocol))}"
              for n, k, length in evaluations(protocol, max_length) if n in names]
    target = protocol["target"]
    for n in names:
        gone = lost(protocol, n, work, trained(n))
        lines += [f"{n} curve @{s}: " + ("done (lost: its copy was not scored where it was kept)" if s in gone else
                                         record_state(CURVE / f"{n}@{s}.ppl.{target}.json", None))
                  for s in curve_steps(protocol)]
    return lines


STAGES = ("data", "train", "claim", "curve", "eval", "report", "all", "status")


def main(argv=None) -> int:
    p = addendum_arguments(__doc__, PROTOCOL, STAGES, "what to run (claim: train, the curve as it is saved, and the "
                           "evaluations that decide claim (b); all: claim, then every other evaluation and the report; "
                           "status: runs nothing)")
    args, protocol, names = addendum_settings(p, argv)
    if args.stage == "status":
        print("\n".join(status(protocol, names, args.max_length, args.work)))
        return 0
    set_budget(args.budget)
    gguf = model_file()
    _, test = corpus(args.work, 4, args.docs)
    failed, data = [], None
    if args.stage in ("data", "train", "claim", "all"):
        data = joined_corpus(args.docs, gguf, args.work, protocol["data"]["piece_min_tokens"])
        summary = data_summary(data)
        print(f"joined documents: {data} ({summary['pieces']} pieces, {summary['tokens']:,} tokens)", flush=True)
    if args.stage in ("train", "claim", "all"):
        print(f"device: {device()}", flush=True)
        failed += claim(names, protocol, gguf, args.work, data, test, args.jobs, args.stage != "train")
    if args.stage in ("curve", "all"):
        points = [(n, s, protocol, gguf, args.work, test) for n in names for s in curve_steps(protocol)
                  if (args.work / "snapshots" / n / f"weights-{s}.safetensors").is_file()]
        failed += run_all(points, curve_point, args.jobs, label=2)
    if args.stage in ("eval", "all"):
        ready = [n for n in names if trained(n)]
        for n in ready:
            ensure_trained(n, protocol["runs"][n], protocol, gguf, args.work, data)
        tasks = [(*t, protocol, gguf, args.work, test) for t in evaluations(protocol, args.max_length) if t[0] in ready]
        failed += run_all(tasks, evaluate, args.jobs)
    if args.stage in ("report", "claim", "eval", "curve", "all"):
        block = report(protocol)
        print(f"wrote full_length to {REAL_MODEL / 'results.json'} and {OUT / 'report.md'}; goals held: "
              f"{[g['held'] for g in block['goals']]}; claim (b): {(block['claim_b'] or {}).get('held')}", flush=True)
    return (3 if stopped_by_budget() else 1) if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OutOfTime as stop:
        print(stop, file=sys.stderr)
        sys.exit(3)
