"""The pending GPU jobs in priority order within one time budget: `python -m experiments.gpu_jobs --budget S --out DIR`.

GPU time comes in short slots (about 15 minutes, calls of at most 10), so every GPU job takes a budget, stops
cleanly before it runs out and keeps what it finished (a fine-tuning its checkpoint, an evaluation its finished
trials), and the next slot goes on from there. The jobs, most important first:

  1. bench_gpu         `benchmarks.bench_gpu`, alone on the card: plans against peaks, pose_mlx against mlx-lm,
                       the first compiled update, MFU, the test suite (pending until gpu.json says it ran alone
                       and nothing was cut);
  2. full-length       `experiments.evidence_full_length`: both fine-tunings, the Fig. 3c curve, the registered trials;
  3. 8x                `experiments.evidence_8x --stage eval`: the 64k trials (once the prediction is registered and the
                       64k PoSE adapters are committed);
  4. cost              `experiments.bench_cost_curve --grad-checkpoint --skip-recorded`: the real model's cost curve
                       (PoSE at 1k/2k, full-length at 8k/16k/32k) on the GPU, the configurations not yet recorded.

Each pending, ready job runs as its own process (its own session) with `--budget` = the time left minus a reserve
(`RESERVE`, for packing and for the job's own stop); no job starts with less than 30 s. A job still running
`STOP_AFTER` seconds past its budget gets SIGTERM, and SIGKILL `KILL_AFTER` seconds later. Each job's outcome
(finished, stopped by its budget: exit 3, stopped by this runner, failed, not ready, done before, no time left)
and what is pending before and after it are recorded.

At the end every file the jobs wrote or changed under benchmarks/results/ (partial records included), then under
the jobs' work folders (a fine-tuning's checkpoints: `Job.keep`), is packed into DIR as `results.tar.gz`, split into
`results.tar.gz.partNN` pieces of at most 15 MiB, everything in DIR at most 60 MiB in at most 7 files (a device
call returns at most 8 files of 16 MiB, 64 MiB in all); what does not fit is listed in `left_behind`. Files the
jobs removed are listed in the archive and removed again when it is unpacked. DIR also gets `gpu_jobs.json` (what
ran, for how long, how each ended, what is still pending, the archive's SHA-256) and `gpu_jobs.log` (the jobs'
output: its first 64 KiB and last part when longer than 1 MiB).

  --unpack FILES...   joins the pieces (in name order, none missing; checked against gpu_jobs.json's SHA-256 when
                      it lies beside them), refuses absolute paths, '..', links and devices, extracts into the
                      checkout (or --into) and removes the files the jobs removed;
  --list              runs nothing: each job's state, and the git-ignored files a next call must carry (partial
                      records, checkpoints) to resume;
  --dry-run           runs `bench_gpu --dry-run` (into a temporary folder) and reports the evidence jobs' status
                      only, packing the dry run's files: the whole runner on a CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pose_mlx.errors import ArgumentParser, UserError, command

from benchmarks.common import RESULTS_DIR, ROOT, child_env

PART_BYTES = 15 * 2**20
OUT_BYTES = 60 * 2**20  # everything written into --out
MAX_FILES = 7
LOG_BYTES, LOG_HEAD = 2**20, 64 * 2**10
RESERVE = 45.0  # seconds kept for packing the results and for the last job's own stop
MIN_START = 30.0  # no job starts with less
STOP_AFTER, KILL_AFTER = 15.0, 10.0  # SIGTERM this long past a job's budget, SIGKILL this long after
ARCHIVE, REMOVED = "results.tar.gz", ".gpu_jobs-removed.json"
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


def status_pending(module: str, *extra: str) -> str | None:
    """Pending items of an evidence script's `--stage status` (lines not starting 'done' / 'adapters committed')."""
    out = subprocess.run([sys.executable, "-m", module, "--stage", "status", *extra], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT)
    if out.returncode:
        return f"its status failed (exit {out.returncode}): {' '.join(out.stderr.split())[-200:]}"
    lines = [line for line in out.stdout.splitlines() if ": " in line]
    waiting = [line for line in lines if not line.split(": ", 1)[1].startswith(("done", "adapters committed"))]
    return f"{len(waiting)} of {len(lines)} items not done" if waiting else None


def ready_8x() -> str | None:
    from experiments.evidence_8x import PROTOCOL
    from experiments.protocol import load_protocol

    if "prediction" not in load_protocol(PROTOCOL):
        return "the simulator's prediction is not registered yet"
    adapters = RESULTS_DIR / "real_model" / "protocol" / "adapters" / "pose-yarn-64k"
    return None if adapters.is_dir() else "the 64k PoSE fine-tuning (CPU) has not committed its adapters"


def default_jobs() -> list[Job]:
    py = [sys.executable, "-m"]
    return [Job("bench_gpu", [*py, "benchmarks.bench_gpu"], gpu_pending),
            Job("full-length", [*py, "experiments.evidence_full_length", "--stage", "all", "--jobs", "3"],
                lambda: status_pending("experiments.evidence_full_length"),
                keep=(str(WORK / "trained"), str(WORK / "snapshots"), str(WORK / "logs"))),
            Job("8x", [*py, "experiments.evidence_8x", "--stage", "eval", "--jobs", "3"],
                lambda: status_pending("experiments.evidence_8x"), ready_8x, keep=(str(WORK / "logs"),)),
            Job("cost", [*py, "experiments.bench_cost_curve", "--grad-checkpoint", "--skip-recorded"],
                cost_pending)]


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


# ------------------------------------------------------------------------------------------ packing


def snapshot(roots: list[Path]) -> dict[Path, tuple[int, int]]:
    """{file: (mtime_ns, size)} of every file under `roots` (those that exist)."""
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for root in roots if root.exists()
            for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file()}


def changes(before: dict, after: dict) -> tuple[list[Path], list[Path]]:
    """(files new or changed, files removed) between two snapshots."""
    return sorted(p for p, stamp in after.items() if before.get(p) != stamp), sorted(set(before) - set(after))


def pack(groups: list[list[Path]], removed: list[Path], out: Path, base: Path, cap: int,
         part: int = PART_BYTES) -> dict:
    """`groups` of files (in priority order; paths inside `base`, stored relative to it) and the list of `removed`
    ones as out/results.tar.gz, split into `part`-byte pieces when larger, at most `cap` bytes in all: a file that
    would pass the cap is left behind (listed). Returns the pieces' names, the SHA-256 and what was left behind."""
    buffer, left_behind = io.BytesIO(), []
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        names = json.dumps([str(p.relative_to(base)) for p in removed]).encode()
        info = tarfile.TarInfo(REMOVED)
        info.size, info.mtime = len(names), int(time.time())
        tar.addfile(info, io.BytesIO(names))
        for files in groups:
            for f in files:
                size = f.stat().st_size
                if buffer.tell() + size + size // 500 + 256 * 2**10 > cap:  # the compressor's pending bytes too
                    left_behind.append({"path": str(f.relative_to(base)), "bytes": size})
                    continue
                tar.add(f, arcname=str(f.relative_to(base)), recursive=False)
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    count = max(1, math.ceil(len(data) / part))
    names = [ARCHIVE] if count == 1 else [f"{ARCHIVE}.part{i:02d}" for i in range(count)]
    for i, name in enumerate(names):
        (out / name).write_bytes(data[i * part:(i + 1) * part])
    return {"packed": names, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "left_behind": left_behind}


def _safe(member: tarfile.TarInfo) -> bool:
    path = Path(member.name)
    return (member.isfile() or member.isdir()) and not path.is_absolute() and ".." not in path.parts \
        and member.name not in ("", ".")


def unpack(files: list[Path], into: Path = ROOT) -> dict:
    """Join `files` (results.tar.gz, or all its pieces), check them (none missing; the SHA-256 in a gpu_jobs.json
    beside them), refuse unsafe members, extract into `into` and remove the files the jobs removed."""
    files = sorted((Path(f) for f in files), key=lambda p: p.name)
    names = [f.name for f in files]
    expected = [ARCHIVE] if names == [ARCHIVE] else [f"{ARCHIVE}.part{i:02d}" for i in range(len(files))]
    if names != expected:
        raise UserError(f"--unpack: expected {', '.join(expected)} (all the pieces, once each); got {', '.join(names)}")
    data = b"".join(f.read_bytes() for f in files)
    summary = files[0].parent / "gpu_jobs.json"
    if summary.is_file():
        sha = json.loads(summary.read_text()).get("sha256")
        if sha and hashlib.sha256(data).hexdigest() != sha:
            raise UserError(f"--unpack: the pieces do not make the archive {summary} describes (SHA-256 differs)")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as error:
        raise UserError(f"--unpack: not a whole results archive ({error})") from None
    bad = [m.name for m in members if not _safe(m)]
    if bad:
        raise UserError(f"--unpack: refusing links, devices and paths outside the folder: {', '.join(bad[:3])}")
    removed = json.loads(tar.extractfile(REMOVED).read()) if REMOVED in tar.getnames() else []
    extracted = [m for m in members if m.name != REMOVED]
    tar.extractall(into, members=extracted, filter="data")
    gone = []
    for name in removed:
        target = into / name
        if ".." not in Path(name).parts and not Path(name).is_absolute() and target.is_file():
            target.unlink()
            gone.append(name)
    return {"files": [m.name for m in extracted if m.isfile()], "removed": gone}


def write_log(full: Path, out: Path) -> None:
    """out/gpu_jobs.log: the jobs' whole output, or its first LOG_HEAD bytes and last part when over LOG_BYTES."""
    data = full.read_bytes()
    if len(data) > LOG_BYTES:
        cut = f"\n[... {len(data) - LOG_BYTES + 100} bytes cut ...]\n".encode()
        data = data[:LOG_HEAD] + cut + data[-(LOG_BYTES - LOG_HEAD - 100):]
    (out / "gpu_jobs.log").write_bytes(data)


def resumable() -> list[str]:
    """Git-ignored state a next call must carry to resume: folders of partial records under benchmarks/results
    and the jobs' `keep` folders that exist."""
    folders = sorted({str(p.parent.relative_to(ROOT)) for p in RESULTS_DIR.rglob("*.partial.jsonl")})
    return folders + [k for job in default_jobs() for k in job.keep if (ROOT / k).exists()]


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
    """The runner: the jobs within `budget`, then every file they changed under `roots` (and their `keep`
    folders) packed into `out` with gpu_jobs.json and gpu_jobs.log. `report`: other jobs whose pending state is
    reported before and after (the dry run's real ones); by default the jobs' own. Returns gpu_jobs.json's dict."""
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
    in_results = [p for p in changed if any(r in p.parents for r in roots)]
    packed = pack([in_results, [p for p in changed if p not in in_results]], removed, out, base,
                  OUT_BYTES - LOG_BYTES - 2**18)
    summary = {"budget": budget, "seconds": round(time.monotonic() - start, 1), "jobs": ran,
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
    args = p.parse_args(argv)
    if args.unpack:
        done = unpack(args.unpack, args.into)
        print(f"unpacked {len(done['files'])} files into {args.into}; removed {len(done['removed'])} the jobs removed")
        return 0
    if args.list:
        _print_pending("GPU jobs:", pending_report(default_jobs()))
        carry = resumable()
        print("to carry into the next call (git-ignored state to resume from): " + (" ".join(carry) or "nothing"))
        return 0
    if args.out is None:
        raise UserError("--out is required to run jobs (the folder the results are packed into)")
    if args.budget <= 0:
        raise UserError("--budget must be > 0 seconds")
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="gpu_jobs-dry-") as scratch:
            summary = run(dry_jobs(Path(scratch)), args.budget, args.out, [Path(scratch)], Path(scratch),
                          report=default_jobs())
    else:
        summary = run(default_jobs(), args.budget, args.out, [RESULTS_DIR], ROOT)
    _print_pending("pending before:", summary["pending_before"])
    _print_pending("pending after:", summary["pending_after"])
    print(f"{summary['changed']} files changed, {len(summary['removed'])} removed; packed into {args.out}: "
          f"{', '.join(summary['packed'])} ({summary['bytes'] / 2**20:.1f} MiB)"
          + (f"; left behind: {len(summary['left_behind'])} files" if summary["left_behind"] else "")
          + f"; {summary['seconds']:.0f} s in all")
    return 1 if any(e["outcome"].startswith("failed") for e in summary["jobs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
