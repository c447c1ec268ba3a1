"""The README's "Try it offline" commands, timed as a user runs them: `python -m benchmarks.bench_quickstart`.

Runs the fine-tuning (SmolLM2-135M GGUF, 16k target, 512-token window, 20 updates on the standard library's
`email` package), one 16k passkey trial and one question about a 3,709-token licence text (`generate --chat`),
each as its own process, into a temporary folder. For each it records the wall time, the CPU time (user + system
of the process and its children, `resource.getrusage`) and the 1-minute load average before and after: on a
shared machine the wall time says little, the CPU time is what the work costs. `--demo` times
`python -m pose_mlx.demo` instead, twice into the same folder: fresh, then reusing its corpus and trained model.
Writes benchmarks/results/quickstart.json (the steps of an earlier run that this one did not repeat are kept); the
README and docs/demo.md quote it (tests/test_docs_records.py keeps them equal).
"""

from __future__ import annotations

import argparse
import email
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, child_env, model_file, write_results

QUESTION_FILE = Path("/usr/share/common-licenses/MPL-2.0")


def commands(gguf: Path, out: Path) -> list[tuple[str, list[str]]]:
    """The README's commands, with the output folder under `out`."""
    model = out / "smollm2-16k"
    data = os.path.dirname(email.__file__)
    return [("finetune", ["pose_mlx.finetune", "--model", str(gguf), "--target", "16k", "--window", "512", "--steps",
                          "20", "--data", data, "--output", str(model), "--no-progress"]),
            ("passkey", ["pose_mlx.passkey", "--model", str(model), "--lengths", "16k", "--trials", "1",
                         "--no-progress"]),
            ("generate", ["pose_mlx.generate", "--model", str(model), "--chat", "--prompt-file", str(QUESTION_FILE),
                          "--prompt", "Which licence is this, and which version?", "--max-tokens", "64",
                          "--no-progress"])]


def timed(cmd: list[str], log: Path) -> dict:
    """Wall and CPU seconds of one command and the load average around it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", *cmd], stdout=f, stderr=subprocess.STDOUT, env=child_env()).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code:
        raise SystemExit(f"{cmd[0]} failed ({code}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": round(load0, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="time the demo (fresh, then reusing) instead")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quickstart.json)")
    args = p.parse_args(argv)
    path = Path(args.out) if args.out else RESULTS_DIR / "quickstart.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    steps, extra = dict(kept.get("steps", {})), {k: kept[k] for k in ("passkey_found",) if k in kept}
    with tempfile.TemporaryDirectory() as tmp:
        if args.demo:
            for name in ("demo_fresh", "demo_reuse"):
                steps[name] = timed(["pose_mlx.demo", "--out", str(Path(tmp) / "demo")], Path(tmp) / f"{name}.log")
                print(name, json.dumps(steps[name]), flush=True)
        else:
            for name, cmd in commands(model_file(), Path(tmp)):
                steps[name] = timed(cmd, Path(tmp) / f"{name}.log")
                print(name, json.dumps(steps[name]), flush=True)
            record = json.loads(next((Path(tmp) / "smollm2-16k" / "eval").glob("passkey-*.json")).read_text())
            extra["passkey_found"] = sum(t["correct"] for t in record["trials"])
    write_results("quickstart", {"steps": steps, **extra, "cores": os.cpu_count()}, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
