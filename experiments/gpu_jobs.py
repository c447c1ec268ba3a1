"""The pending GPU jobs in the order that decides the most per GPU-second, within one time budget:
`python -m experiments.gpu_jobs --budget S --out DIR`; `--plan` says beforehand what each lent session will run.

GPU time comes in short slots (a lent session: about 15 minutes, one command of at most 10), so every GPU job
takes a budget, stops cleanly before it runs out and keeps what it finished (a fine-tuning its checkpoint, an
evaluation its finished trials), and the next slot goes on from there. The jobs, in order:

  a-claim      `experiments.evidence_full_length --stage claim`: addendum A's two fine-tunings, one after the
               other in one call, each point of their curve scored beside them as it is saved, and, as soon as a
               run is trained, what decides claim (b): its 32k perplexity and its passkey at 16k and 32k at the
               amended counts (`--jobs 3` evaluation lanes);
  b-decisive   `experiments.evidence_8x --stage decisive`: addendum B's goal, the passkey and perplexity at 64k,
               PoSE + YaRN, dynamic NTK and YaRN first (once the prediction and the 64k adapters are committed);
  a-rest       `experiments.evidence_full_length --stage all`: the rest of addendum A;
  b-rest       `experiments.evidence_8x --stage eval`: the rest of addendum B;
  cost         `experiments.bench_cost_curve --grad-checkpoint --skip-recorded`: the cost curve's configurations
               not yet recorded on a GPU;
  bench_gpu    `benchmarks.bench_gpu --skip-tests`: plans against peaks, pose_mlx against mlx-lm, the first
               compiled update, MFU (pending until gpu.json says it ran alone and nothing was cut);
  tests I/K    `benchmarks.gpu_tests --shard I/K`: the test suite in K shards (`--shards`, default 3) that each fit
               a call, pending until every test file is in a complete shard recorded on a GPU.

Each pending, ready job runs as its own process (its own session) with `--budget` = the time left minus a reserve
(`RESERVE`, for packing and for the job's own stop); no job starts with less than 30 s. A job still running
`STOP_AFTER` seconds past its budget gets SIGTERM, and SIGKILL `KILL_AFTER` seconds later. Each job's outcome
(finished, stopped by its budget: exit 3, stopped by this runner, failed, not ready, done before, no time left)
and what is pending before and after it are recorded.

At the end, what a later session or this checkout needs is packed into DIR as `results.tar.gz`, split into
`results.tar.gz.partNN` pieces of at most 15 MiB, everything in DIR at most 60 MiB in at most 7 files (a device
call returns at most 8 files of 16 MiB, 64 MiB in all), in this order, each group whole or left behind whole
(`left_behind`): every file the jobs wrote or changed under benchmarks/results/ (partial records included); then,
per unfinished fine-tuning, what resumes it (`resume_files`: its run.json, log and last checkpoint, the weights and
AdamW state in float32 so that it resumes exactly; not the checkpoint before it); then the curve's kept copies
not yet scored (float16); then the jobs' logs. Files the jobs removed are listed in the archive and removed again
when it is unpacked. DIR also gets `gpu_jobs.json` (what ran, for how long, how each ended, what is still
pending, the archive's SHA-256, `manifest`: every packed file's size and SHA-256, and `code`: the SHA-256 of every
source file the jobs ran, with the commit when the checkout is a git one) and `gpu_jobs.log` (the jobs' output:
its first 64 KiB and last part when longer than 1 MiB).

  --unpack FILES...   joins the pieces (in name order, none missing; checked against gpu_jobs.json's SHA-256 and
                      each file against its manifest when it lies beside them), refuses absolute paths, '..', links
                      and devices, extracts into the checkout (or --into) and removes the files the jobs removed;
  --returns DIR       a folder that outlives the call on the same machine (tools/gpu_session.sh gives its stash's):
                      what earlier calls of the session returned is unpacked into the checkout before the jobs run
                      (a call's checkout is a fresh copy, so their records would be gone), and this call's return is
                      added to it;
  --list              runs nothing: each job's state, and the git-ignored files a next call must carry (partial
                      records, checkpoints) to resume;
  --plan              runs nothing: the plan (`experiments.gpu_plan`) of what is pending, over lent sessions of
                      `--session-seconds` with `--overhead` of them spent starting and carrying (`--json`: as JSON);
  --dry-run           runs `bench_gpu --dry-run` (into a temporary folder) and reports the evidence jobs' status
                      only, packing the dry run's files: the whole runner on a CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pose_mlx.errors import ArgumentParser, UserError, command

from benchmarks.common import RESULTS_DIR, ROOT, child_env
from experiments.gpu_pack import (ARCHIVE, LOG_BYTES, Group, changes, code_fingerprint, keep, pack, replay,
                                  resume_files, snapshot, unpack, write_log)

OUT_BYTES = 60 * 2**20  # everything written into --out
MAX_FILES = 7
SHARDS = 3  # the test suite's shards (`benchmarks.gpu_tests`)
RESERVE = 45.0  # seconds kept for packing the results and for the last job's own stop
MIN_START = 30.0  # no job starts with less
STOP_AFTER, KILL_AFTER = 15.0, 10.0  # SIGTERM this long past a job's budget, SIGKILL this long after
OWN_FILES = ("gpu_jobs.json", "gpu_jobs.log")
WORK = Path("out") / "real_model"  # the evidence scripts' default --work


@dataclass
class Job:
    """One GPU job: its command (`--budget S` is appended), why it is pending (None: done), why it cannot run yet
    (None: it can), and the folders (relative to the checkout) of its resumable state beside benchmarks/results."""

    name: str
    command: list[str]
    pending: Callable[[], str | None]
    ready: Callable[[], str | None] = field(default=lambda: None)
    keep: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------ the jobs


def gpu_pending(path: Path = RESULTS_DIR / "gpu" / "gpu.json") -> str | None:
    """Why bench_gpu is pending: no gpu.json, a dry run's, not measured alone on the card, or cut by its budget."""
    if not path.is_file():
        return "no gpu.json"
    record = json.loads(path.read_text())
    conditions = str(record.get("conditions") or "no conditions recorded")
    incomplete = record.get("incomplete", ["gpu.json predates the `incomplete` record"])
    if record.get("dry_run"):
        return "gpu.json is a dry run's"
    if not conditions.startswith("alone"):
        return f"gpu.json was not measured alone on the card: {_cut(conditions, 160)}"
    return f"gpu.json is incomplete: {_cut('; '.join(incomplete), 300)}" if incomplete else None


def _cut(text: str, length: int) -> str:
    return text if len(text) <= length else text[:length - 3].rsplit(" ", 1)[0] + " ..."


def status_pending(module: str, *extra: str, only: Callable[[str], bool] = lambda item: True) -> str | None:
    """Pending items of an evidence script's `--stage status` (lines not starting 'done' / 'adapters committed'),
    of the items ("<run> <what>") that `only` keeps."""
    out = subprocess.run([sys.executable, "-m", module, "--stage", "status", *extra], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT)
    if out.returncode:
        return f"its status failed (exit {out.returncode}): {' '.join(out.stderr.split())[-200:]}"
    lines = [line for line in out.stdout.splitlines() if ": " in line and only(line.split(": ", 1)[0])]
    waiting = [line for line in lines if not line.split(": ", 1)[1].startswith(("done", "adapters committed"))]
    return f"{len(waiting)} of {len(lines)} items not done" if waiting else None


def ready_8x() -> str | None:
    from experiments.evidence_8x import PROTOCOL
    from experiments.protocol import load_protocol

    if "prediction" not in load_protocol(PROTOCOL):
        return "the simulator's prediction is not registered yet"
    adapters = RESULTS_DIR / "real_model" / "protocol" / "adapters" / "pose-yarn-64k"
    return None if adapters.is_dir() else "the 64k PoSE fine-tuning (CPU) has not committed its adapters"


def claim_items() -> set[str]:
    """The status items of addendum A that decide claim (b): the fine-tunings, their curve, the claim's evaluations."""
    from experiments import evidence_full_length as efl
    from experiments.protocol import load_protocol

    protocol = load_protocol(efl.PROTOCOL)
    runs = list(protocol["runs"])
    return ({f"{n} fine-tuning" for n in runs} | {f"{n} curve @{s}" for n in runs for s in efl.curve_steps(protocol)}
            | {" ".join(map(str, t)) for t in efl.claim_evaluations(protocol, runs)})


def decisive_items() -> set[str]:
    """The status items of addendum B that its goal is judged on (`evidence_8x.decisive_evaluations`)."""
    from experiments import evidence_8x as e8
    from experiments.protocol import load_protocol

    return {" ".join(map(str, t)) for t in e8.decisive_evaluations(load_protocol(e8.PROTOCOL))}


def default_jobs(shards: int = SHARDS) -> list[Job]:
    """The queue, in the order that decides the most per GPU-second (the module's docstring)."""
    py = [sys.executable, "-m"]
    a, b = "experiments.evidence_full_length", "experiments.evidence_8x"
    keep = (str(WORK / "trained"), str(WORK / "snapshots"), str(WORK / "logs"))
    jobs = [Job("a-claim", [*py, a, "--stage", "claim", "--jobs", "3"],
                lambda: status_pending(a, only=claim_items().__contains__), keep=keep),
            Job("b-decisive", [*py, b, "--stage", "decisive", "--jobs", "3"],
                lambda: status_pending(b, only=decisive_items().__contains__), ready_8x, keep=(str(WORK / "logs"),)),
            Job("a-rest", [*py, a, "--stage", "all", "--jobs", "3"], lambda: status_pending(a), keep=keep),
            Job("b-rest", [*py, b, "--stage", "eval", "--jobs", "3"], lambda: status_pending(b), ready_8x,
                keep=(str(WORK / "logs"),)),
            Job("cost", [*py, "experiments.bench_cost_curve", "--grad-checkpoint", "--skip-recorded"], cost_pending),
            Job("bench_gpu", [*py, "benchmarks.bench_gpu", "--skip-tests"], gpu_pending)]
    return jobs + [Job(f"tests {i}/{shards}", [*py, "benchmarks.gpu_tests", "--shard", f"{i}/{shards}"],
                       lambda i=i: shard_pending(i, shards)) for i in range(1, shards + 1)]


def shard_pending(i: int, k: int) -> str | None:
    """Why the test suite's shard `i` of `k` is pending (`gpu_tests.shard_pending`, imported when asked)."""
    from benchmarks.gpu_tests import shard_pending as pending

    return pending(i, k)


def cost_pending() -> str | None:
    """Why the cost job is pending (`bench_cost_curve.gpu_pending`, imported when asked, as `ready_8x` does)."""
    from experiments.bench_cost_curve import gpu_pending

    return gpu_pending()


def dry_jobs(scratch: Path) -> list[Job]:
    """bench_gpu's dry run into `scratch`/gpu (pending until its gpu.json is there)."""
    gpu = scratch / "gpu"
    return [Job("bench_gpu --dry-run", [sys.executable, "-m", "benchmarks.bench_gpu", "--dry-run", "--output",
                                        str(gpu)], lambda: None if (gpu / "gpu.json").is_file() else "dry run")]


def pending_report(jobs: list[Job]) -> dict:
    """{job: why it is pending (plus why it cannot run yet), or None when done}."""
    report = {}
    for job in jobs:
        why, blocked = job.pending(), job.ready()
        report[job.name] = None if why is None else why + (f"; not ready: {blocked}" if blocked else "")
    return report


# ------------------------------------------------------------------------------------------ running them


def run_job(job: Job, budget: float, log, stop_after: float = STOP_AFTER, kill_after: float = KILL_AFTER) -> dict:
    """Run `job` with `--budget budget` in its own session, its output to `log`; SIGTERM to its whole group
    `stop_after` seconds past the budget, SIGKILL `kill_after` seconds later. Its exit code and outcome."""
    log.write(f"=== {job.name}: {' '.join(job.command[1:])} --budget {budget:.0f}\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen([*job.command, "--budget", f"{budget:.0f}"], stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(), cwd=ROOT, start_new_session=True)
    outcome = None
    try:
        code = proc.wait(timeout=budget + stop_after)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        outcome = "stopped by gpu_jobs past its budget (SIGTERM)"
        try:
            code = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, outcome = proc.wait(), "killed by gpu_jobs past its budget (SIGKILL)"
    finally:
        if proc.poll() is None:  # left by an exception: the job's group goes too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if outcome is None:
        outcome = "finished" if code == 0 else "stopped by its budget" if code == 3 else f"failed (exit {code})"
    log.write(f"=== {job.name}: {outcome} after {time.monotonic() - t0:.0f} s\n")
    log.flush()
    return {"seconds": round(time.monotonic() - t0, 1), "exit_code": code, "outcome": outcome}


def run_jobs(jobs: list[Job], budget: float, log, reserve: float = RESERVE, min_start: float = MIN_START,
             **stops) -> list[dict]:
    """Each pending, ready job in order with the time left minus `reserve` (none with less than `min_start`);
    one entry per job: what was pending before and after it, and how it ended."""
    end = time.monotonic() + budget
    ran = []
    for job in jobs:
        why, blocked = job.pending(), job.ready()
        entry = {"job": job.name, "pending_before": why}
        left = end - time.monotonic() - reserve
        if why is None:
            entry["outcome"] = "done before"
        elif blocked:
            entry["outcome"] = f"not ready: {blocked}"
        elif left < min_start:
            entry["outcome"] = f"no time left ({max(left, 0):.0f} s)"
        else:
            print(f"gpu_jobs: {job.name}, {left:.0f} s", flush=True)
            entry.update(budget=round(left), **run_job(job, left, log, **stops))
        entry["pending_after"] = job.pending() if "exit_code" in entry else why
        print(f"gpu_jobs: {job.name}: {entry['outcome']}", flush=True)
        ran.append(entry)
    return ran


def scored(copy: Path) -> bool:
    """Whether the curve's kept copy `copy` (<run>/weights-<step>.safetensors) has its point recorded."""
    from experiments.curve import CURVE

    step = copy.name.removeprefix("weights-").removesuffix(".safetensors")
    return any(CURVE.glob(f"{copy.parent.name}@{step}.ppl.*.json"))


def groups(changed: list[Path], roots: list[Path]) -> list[Group]:
    """What to bring back, in order: the files changed under `roots` (the records); per unfinished fine-tuning
    among the changed files, what resumes it (whole); the curve's kept copies not yet scored; the logs."""
    records = [p for p in changed if any(r in p.parents for r in roots)]
    others = [p for p in changed if p not in records]
    runs = sorted({f for p in others for f in p.parents if f.name.endswith(".partial") and (f / "run.json").is_file()})
    resume = [Group(resume_files(run), whole=True) for run in runs]
    copies = [p for p in others if p.parent.parent.name == "snapshots" and p.name.startswith("weights-")
              and not scored(p)]
    logs = [p for p in others if p.parent.name == "logs"]
    return [Group(records), *resume, Group(copies), Group(logs)]


def resumable(jobs: list[Job] | None = None) -> list[str]:
    """Git-ignored files a next session must carry to go on where this checkout stopped: partial records under
    benchmarks/results, what resumes each unfinished fine-tuning of the jobs' work folders, the curve's copies
    not yet scored."""
    files = sorted(RESULTS_DIR.rglob("*.partial.jsonl"))
    for folder in {ROOT / k for job in (jobs or default_jobs()) for k in job.keep}:
        for run in sorted(folder.glob("*.partial")) if folder.name == "trained" else ():
            files += resume_files(run)
        if folder.name == "snapshots":
            files += [p for p in sorted(folder.glob("*/weights-*.safetensors")) if not scored(p)]
    return [str(p.relative_to(ROOT)) for p in files]


# ------------------------------------------------------------------------------------------ the command


def prepare(out: Path) -> None:
    """An empty --out, or one holding only this runner's own files of an earlier run (removed)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; it names the folder for the packed results")
    out.mkdir(parents=True, exist_ok=True)
    own = [p for p in out.iterdir() if p.name in OWN_FILES or p.name.startswith(ARCHIVE)]
    foreign = sorted(p.name for p in out.iterdir() if p not in own)
    if foreign:
        raise UserError(f"--out {out} holds other files ({', '.join(foreign[:3])}): give an empty folder")
    for p in own:
        p.unlink()


def run(jobs: list[Job], budget: float, out: Path, roots: list[Path], base: Path, report: list[Job] | None = None,
        **limits) -> dict:
    """The runner: the jobs within `budget`, then what they changed under `roots` and their `keep` folders packed
    into `out` (`groups`) with gpu_jobs.json and gpu_jobs.log. `report`: other jobs whose pending state is reported
    before and after (the dry run's real ones); by default the jobs' own. Returns gpu_jobs.json's dict."""
    start = time.monotonic()
    prepare(out)
    keep = [base / k for job in jobs for k in job.keep]
    before = snapshot(roots + keep)
    pending_before = pending_report(report) if report else None
    with tempfile.TemporaryDirectory(prefix="gpu_jobs-") as tmp:
        full = Path(tmp) / "gpu_jobs.log"
        with open(full, "w") as log:
            ran = run_jobs(jobs, budget - (time.monotonic() - start), log, **limits)
        write_log(full, out)
    changed, removed = changes(before, snapshot(roots + keep))
    changed = [p for p in changed if out.resolve() not in p.resolve().parents]
    packed = pack(groups(changed, roots), removed, out, base, OUT_BYTES - LOG_BYTES - 2**18)
    summary = {"budget": budget, "seconds": round(time.monotonic() - start, 1), "code": code_fingerprint(ROOT),
               "jobs": ran,
               "pending_before": pending_before or {e["job"]: e["pending_before"] for e in ran},
               "pending_after": pending_report(report) if report else {e["job"]: e["pending_after"] for e in ran},
               "changed": len(changed), "removed": [str(p.relative_to(base)) for p in removed], **packed}
    (out / "gpu_jobs.json").write_text(json.dumps(summary, indent=1) + "\n")
    files = list(out.iterdir())
    assert len(files) <= MAX_FILES and sum(f.stat().st_size for f in files) <= OUT_BYTES, files
    return summary


def _print_pending(title: str, report: dict) -> None:
    print(title)
    for name, why in report.items():
        print(f"  {name}: {'done' if why is None else f'pending ({why})'}")


@command("gpu_jobs")
def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m experiments.gpu_jobs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=500.0,
                   help="seconds for everything: the jobs, the checks and the packing (default 500)")
    p.add_argument("--out", type=Path, help="an empty folder for the packed results, gpu_jobs.json and gpu_jobs.log")
    p.add_argument("--dry-run", action="store_true",
                   help="run bench_gpu --dry-run and the evidence jobs' status only (a few CPU minutes)")
    p.add_argument("--list", action="store_true",
                   help="run nothing: print each job's state and the ignored files a next call must carry")
    p.add_argument("--unpack", nargs="+", type=Path, metavar="FILE",
                   help="extract results.tar.gz (or all its .partNN pieces) into the checkout")
    p.add_argument("--into", type=Path, default=ROOT, help="with --unpack: where to extract (default: the checkout)")
    p.add_argument("--returns", type=Path, default=None,
                   help="a folder outside the checkout that outlives the call: what earlier calls of this session "
                        "returned is unpacked into the checkout before the jobs, and this call's return is added")
    p.add_argument("--shards", type=int, default=SHARDS, help=f"the test suite's shards (default {SHARDS})")
    p.add_argument("--plan", action="store_true", help="run nothing: what each lent session will run (gpu_plan)")
    p.add_argument("--session-seconds", type=float, default=900.0,
                   help="with --plan: the device seconds of one lent session (default 900)")
    p.add_argument("--overhead", type=float, default=240.0,
                   help="with --plan: the seconds of a session spent starting the machine and carrying files "
                        "(default 240)")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    args = p.parse_args(argv)
    if args.shards < 1:
        raise UserError("--shards must be at least 1")
    if args.plan:
        from experiments.gpu_plan import describe, queue_plan

        try:
            found = queue_plan(args.session_seconds, args.overhead, args.shards)
        except ValueError as error:
            raise UserError(f"--plan: {error}") from None
        print(json.dumps(found, indent=1) if args.json else describe(found))
        return 0
    if args.unpack:
        done = unpack(args.unpack, args.into)
        print(f"unpacked {len(done['files'])} files into {args.into}; removed {len(done['removed'])} the jobs removed")
        return 0
    if args.list:
        _print_pending("GPU jobs:", pending_report(default_jobs(args.shards)))
        from benchmarks.gpu_tests import summary as suite

        s = suite(args.shards)
        print(f"the test suite on a GPU: {s['shards']} of {args.shards} shards recorded, {s['passed']} passed, "
              f"{s['failed']} failed, {s['errors']} errors" + ("" if s["complete"] else " (not complete)"))
        carry = resumable()
        print("to carry into the next session (git-ignored state to resume from; `tools/gpu_wheels.py download "
              "--state` packs it): " + (" ".join(carry) or "nothing"))
        return 0
    if args.out is None:
        raise UserError("--out is required to run jobs (the folder the results are packed into)")
    if args.budget <= 0:
        raise UserError("--budget must be > 0 seconds")
    if args.returns is not None and args.returns.exists() and not args.returns.is_dir():
        raise UserError(f"--returns {args.returns} is a file; it names the folder that keeps each call's return")
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="gpu_jobs-dry-") as scratch:
            summary = run(dry_jobs(Path(scratch)), args.budget, args.out, [Path(scratch)], Path(scratch),
                          report=default_jobs())
    else:
        if args.returns is not None:
            replayed = replay(args.returns, ROOT)
            print(f"replayed what earlier calls returned: {', '.join(replayed) or 'nothing'}", flush=True)
        summary = run(default_jobs(args.shards), args.budget, args.out, [RESULTS_DIR], ROOT)
        if args.returns is not None:
            print(f"this call's return kept in {keep(args.out, args.returns)}")
    _print_pending("pending before:", summary["pending_before"])
    _print_pending("pending after:", summary["pending_after"])
    print(f"{summary['changed']} files changed, {len(summary['removed'])} removed; packed into {args.out}: "
          f"{', '.join(summary['packed'])} ({summary['bytes'] / 2**20:.1f} MiB)"
          + (f"; left behind: {len(summary['left_behind'])} files" if summary["left_behind"] else "")
          + f"; {summary['seconds']:.0f} s in all")
    return 1 if any(e["outcome"].startswith("failed") for e in summary["jobs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
