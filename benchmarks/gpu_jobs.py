"""The pending GPU jobs, in priority order, within one time budget: `python -m benchmarks.gpu_jobs --budget S --out DIR`.

GPU time comes here in short slots (about 15 minutes, calls of at most 10), so every GPU job takes a budget, stops
cleanly before it runs out and keeps what it finished (a fine-tuning its checkpoint, an evaluation its finished
trials), and the next slot goes on from there. The jobs, most important first:

  1. bench_gpu         `benchmarks.bench_gpu`, alone on the card: plans against peaks, pose_mlx against mlx-lm,
                       the first compiled update, the test suite (pending until gpu.json says it ran alone and
                       complete);
  2. full-length       `benchmarks.evidence_full_length`: both fine-tunings, the Fig. 3c curve, the registered trials;
  3. 8x                `benchmarks.evidence_8x --stage eval`: the 64k trials (once the prediction is registered and the
                       64k PoSE adapters are committed).

Each job runs as its own process with the time left minus a reserve for packing; a job that is done is skipped. At
the end every file the jobs wrote or changed under benchmarks/results/ (partial records included) is packed into
DIR as `results.tar.gz` (split into `results.tar.gz.partNN` pieces of at most 15 MiB: a device call returns at most
8 files of 16 MiB), with `gpu_jobs.json` (what ran, for how long, how each ended, and what is still pending) and
the jobs' output in `gpu_jobs.log`. Unpack here with `python -m benchmarks.gpu_jobs --unpack FILES...`.
`--list` runs nothing and prints each job's state.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, child_env

PART_BYTES = 15 * 2**20
RESERVE = 45.0  # seconds kept for packing the results and for the last job's own stop


@dataclass
class Job:
    """One GPU job: its command (`budget` seconds are appended as `--budget B`) and how to tell it is pending."""

    name: str
    command: list[str]
    pending: callable  # () -> str | None: why it is pending, None when done or not ready
    ready: callable = field(default=lambda: None)  # () -> str | None: why it cannot run yet, None when it can


def _gpu_pending() -> str | None:
    path = RESULTS_DIR / "gpu" / "gpu.json"
    if not path.is_file():
        return "no gpu.json"
    record = json.loads(path.read_text())
    conditions = str(record.get("conditions", ""))
    missing = [k for k in ("throughput", "first_update_seconds", "mfu", "tests") if record.get(k) in (None, {})]
    if "alone" not in conditions:
        return f"gpu.json was measured {conditions or 'with the card shared'}"
    return f"gpu.json lacks {', '.join(missing)}" if missing else None


def _status_pending(module: str, *extra: str) -> str | None:
    """Pending items of an evidence script's `--stage status` (lines not starting 'done'/'adapters committed')."""
    out = subprocess.run([sys.executable, "-m", module, "--stage", "status", *extra], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if ": " in line]
    waiting = [line for line in lines if not line.split(": ", 1)[1].startswith(("done", "adapters committed"))]
    return f"{len(waiting)} of {len(lines)} items not done" if waiting or out.returncode else None


def _8x_ready() -> str | None:
    from benchmarks.protocol import load_protocol
    from benchmarks.evidence_8x import PROTOCOL

    if "prediction" not in load_protocol(PROTOCOL):
        return "the simulator's prediction is not registered yet"
    adapters = RESULTS_DIR / "real_model" / "protocol" / "adapters" / "pose-yarn-64k"
    return None if adapters.is_dir() else "the 64k PoSE fine-tuning (CPU) has not committed its adapters"


def default_jobs() -> list[Job]:
    return [Job("bench_gpu", ["benchmarks.bench_gpu"], _gpu_pending),
            Job("full-length", ["benchmarks.evidence_full_length", "--stage", "all", "--jobs", "3"],
                lambda: _status_pending("benchmarks.evidence_full_length")),
            Job("8x", ["benchmarks.evidence_8x", "--stage", "eval", "--jobs", "3"],
                lambda: _status_pending("benchmarks.evidence_8x"), _8x_ready)]


def run_jobs(jobs: list[Job], budget: float, log, reserve: float = RESERVE) -> list[dict]:
    """Run each pending, ready job in order with the time left (minus `reserve`); returns one entry per job."""
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
        elif left < 30:
            entry["outcome"] = "no time left"
        else:
            t0 = time.monotonic()
            log.write(f"=== {job.name}: {' '.join(job.command)} --budget {left:.0f}\n")
            log.flush()
            proc = subprocess.run([sys.executable, "-m", *job.command, "--budget", f"{left:.0f}"], stdout=log,
                                  stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
            entry.update(seconds=round(time.monotonic() - t0, 1), exit_code=proc.returncode,
                         outcome="finished" if proc.returncode == 0 else
                         "stopped by the budget" if proc.returncode == 3 else "failed")
        entry["pending_after"] = job.pending()
        ran.append(entry)
    return ran


def changed_since(root: Path, start: float) -> list[Path]:
    """Files under `root` written at or after `start` (time.time())."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_mtime >= start)


def pack(files: list[Path], out: Path, base: Path = ROOT) -> list[Path]:
    """`files` (paths relative to `base` inside) as out/results.tar.gz, split into PART_BYTES pieces when larger."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(base)))
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    if len(data) <= PART_BYTES:
        (out / "results.tar.gz").write_bytes(data)
        return [out / "results.tar.gz"]
    parts = []
    for i in range(0, len(data), PART_BYTES):
        parts.append(out / f"results.tar.gz.part{i // PART_BYTES:02d}")
        parts[-1].write_bytes(data[i:i + PART_BYTES])
    return parts


def unpack(files: list[Path], base: Path = ROOT) -> list[str]:
    """Join `files` (a results.tar.gz or its parts, in name order) and extract them under `base`; returns the names."""
    data = b"".join(Path(f).read_bytes() for f in sorted(files, key=lambda p: Path(p).name))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        bad = [n for n in names if n.startswith("/") or ".." in Path(n).parts]
        if bad:
            raise SystemExit(f"refusing to unpack paths outside the checkout: {bad[:3]}")
        tar.extractall(base, filter="data")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=500.0, help="seconds for all jobs together (default 500)")
    p.add_argument("--out", type=Path, help="folder for the packed results, gpu_jobs.json and gpu_jobs.log")
    p.add_argument("--list", action="store_true", help="run nothing: print each job's state")
    p.add_argument("--unpack", nargs="+", type=Path, metavar="FILE", help="extract packed results into this checkout")
    args = p.parse_args(argv)
    if args.unpack:
        names = unpack(args.unpack)
        print(f"unpacked {len(names)} files into {ROOT}")
        return 0
    jobs = default_jobs()
    if args.list:
        for job in jobs:
            why, blocked = job.pending(), job.ready()
            print(f"{job.name}: {'done' if why is None else f'pending ({why})'}" + (f"; not ready: {blocked}" if blocked else ""))
        return 0
    if args.out is None:
        p.error("--out is required to run jobs (the folder the results are packed into)")
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu_jobs.log", "w") as log:
        ran = run_jobs(jobs, args.budget, log)
    parts = pack(changed_since(RESULTS_DIR, start), args.out)
    summary = {"budget": args.budget, "seconds": round(time.time() - start, 1), "jobs": ran,
               "packed": [f.name for f in parts],
               "pending": {e["job"]: e["pending_after"] for e in ran if e["pending_after"]}}
    (args.out / "gpu_jobs.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
