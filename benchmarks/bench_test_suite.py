"""What the test suite costs on this machine: `python -m benchmarks.bench_test_suite`.

Runs `python -m pytest -p no:cacheprovider` (quiet by the project's addopts) in a child process from the
repository root and records how many tests passed, failed and were skipped (pytest's last line), the wall time, the
CPU time (user + system of the child and its own children: the data-parallel tests start ranks,
`resource.getrusage`) and the 1-minute load average before and after: on a shared machine the CPU time is what the
suite costs, the wall time what it took beside other work. Writes benchmarks/results/test_suite.json, which the
README and docs/testing.md quote (tests/test_docs_records.py keeps them equal).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, child_env, write_results


def counts(last_line: str) -> dict:
    """{"passed": n, "failed": n, "skipped": n, ...} of pytest's summary line ("1681 passed, 8 skipped in 1380s")."""
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                                    last_line)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/test_suite.json)")
    args = p.parse_args(argv)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    # pyproject's addopts already pass -q; a second -q would drop pytest's last line, the counts read here
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    record = {"tests": counts(last), "summary": last, "exit_code": proc.returncode, "wall_s": round(wall, 1),
              "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
              "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}
    path = write_results("test_suite", record, Path(args.out) if args.out else RESULTS_DIR / "test_suite.json")
    print(f"{last}; {record['cpu_s']:.0f} CPU-s, {record['wall_s']:.0f} s; wrote {path}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
