"""The test suite on a GPU in shards that each fit one short call: `python -m benchmarks.gpu_tests --shard I/K`.

The suite's test files are collected (`pytest --collect-only`: how many tests each holds) and dealt into K shards
of about equal test counts (`shards`: largest file first, onto the lightest shard; ties by name, so every machine
deals the same shards from the same files); shard I runs with `gpu_checks.start_tests` (pytest -v -rfE, xdist
workers when installed) until it ends or `--budget` seconds less a margin, then is counted from its per-test lines
(`gpu_checks.finish_tests`). Its record, `results/gpu/tests/shard-I-of-K.json` (`common.write_results`), holds the
files, counts, failed tests' names, `complete`, seconds and MLX's device; its output is
`results/gpu/tests/shard-I-of-K.log`. Exit code 0 when the shard ran to its end (failures are its result), 3 when
the budget stopped it. A shard is pending until a complete record of it made on a GPU exists (`shard_pending`);
`summary(k)` adds the shards up: "no failing test" is judged over the whole suite once every shard is complete.
Without a GPU it refuses unless `--dry-run` (records into a temporary folder, or `--output`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from pose_mlx.errors import ArgumentParser, UserError, command

from benchmarks.common import RESULTS_DIR, ROOT, child_env, write_results
from benchmarks.gpu_checks import finish_tests, start_tests

TESTS = RESULTS_DIR / "gpu" / "tests"
MARGIN = 15.0  # seconds kept from --budget for counting and writing
COUNT = re.compile(r"^(tests/\S+\.py): (\d+)$")
OWN = "tests/test_bench_gpu.py"  # bench_gpu's own test runs its dry run: left out, as bench_gpu does


def collect(paths: tuple[str, ...] = ("tests",)) -> dict[str, int]:
    """{test file: how many tests pytest collects from it} (the suite's own test of bench_gpu left out)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-q", "-p", "no:cacheprovider",
                          *paths], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    counts = {m.group(1): int(m.group(2)) for m in map(COUNT.match, out.stdout.splitlines()) if m}
    if not counts:
        raise UserError(f"pytest collected no tests (exit {out.returncode}): {' '.join(out.stderr.split())[-300:]}")
    return {f: n for f, n in counts.items() if f != OWN}


def shards(counts: dict[str, int], k: int) -> list[list[str]]:
    """The files dealt into `k` shards of about equal test counts: largest first onto the lightest shard (ties:
    the file's name, the shard's number); each shard's files in name order."""
    loads, dealt = [0] * k, [[] for _ in range(k)]
    for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        i = min(range(k), key=lambda j: (loads[j], j))
        loads[i] += n
        dealt[i].append(name)
    return [sorted(files) for files in dealt]


def record_path(i: int, k: int, folder: Path = TESTS) -> Path:
    return folder / f"shard-{i}-of-{k}.json"


def shard_pending(i: int, k: int, folder: Path = TESTS) -> str | None:
    """Why shard `i` of `k` is pending: no record of it, a record not made on a GPU, or one stopped early."""
    path = record_path(i, k, folder)
    if not path.is_file():
        return "not run on a GPU yet"
    record = json.loads(path.read_text())
    if record.get("dry_run") or "gpu" not in str(record.get("device", "")):
        return "its record is not a GPU's"
    return None if record.get("complete") else "its last run was stopped before the end"


def summary(k: int, folder: Path = TESTS) -> dict:
    """The shards' counts added up, the failed tests' names, and `complete` (every shard of k ran to its end)."""
    records = [json.loads(p.read_text()) for p in sorted(folder.glob(f"shard-*-of-{k}.json"))]
    out = {key: sum(r[key] for r in records) for key in ("passed", "failed", "skipped", "errors")}
    return {**out, "failed_names": [n for r in records for n in r["failed_names"]], "shards": len(records),
            "complete": len(records) == k and all(r["complete"] for r in records)}


def parse_shard(text: str) -> tuple[int, int]:
    found = re.fullmatch(r"(\d+)/(\d+)", text)
    if not found or not 1 <= int(found.group(1)) <= int(found.group(2)):
        raise UserError(f"--shard must be I/K with 1 <= I <= K, got {text!r}")
    return int(found.group(1)), int(found.group(2))


def device() -> str:
    code = "import pose_mlx, mlx.core as mx; print(mx.default_device())"
    return subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True).stdout.strip()


@command("gpu_tests")
def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m benchmarks.gpu_tests", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", required=True, help="I/K: run the I-th of K shards of the suite")
    p.add_argument("--budget", type=float, default=None, help="seconds for the shard, counting and writing included")
    p.add_argument("--workers", type=int, default=10, help="pytest-xdist workers when installed (default 10; 0: none)")
    p.add_argument("--output", type=Path, default=None,
                   help=f"folder for the record (default {TESTS.relative_to(ROOT)})")
    p.add_argument("--dry-run", action="store_true", help="run on MLX's default device, into a temporary folder")
    args = p.parse_args(argv)
    i, k = parse_shard(args.shard)
    where = device()
    if "gpu" not in where and not args.dry_run:
        raise UserError(f"MLX's default device is {where or 'unknown'}, not a GPU; pass --dry-run to try it here")
    folder = args.output or (Path(tempfile.mkdtemp(prefix="gpu_tests-")) if args.dry_run else TESTS)
    files = shards(collect(), k)[i - 1]
    log = record_path(i, k, folder).with_suffix(".log")
    tests = start_tests(files, args.workers, log)
    timeout = None if args.budget is None else max(args.budget - MARGIN, 1.0)
    record = finish_tests(tests, timeout)
    write_results("gpu_tests", {"shard": [i, k], "files": files, "device": where, "dry_run": args.dry_run,
                                **record}, record_path(i, k, folder))
    print(f"shard {i}/{k}: {record['passed']} passed, {record['failed']} failed, {record['skipped']} skipped"
          + ("" if record["complete"] else " (stopped by the budget)") + f"; {record_path(i, k, folder)}")
    return 0 if record["complete"] else 3


if __name__ == "__main__":
    sys.exit(main())
