"""The README's "Try it offline" block, run and timed as a user runs it: `python -m benchmarks.bench_quickstart`.

The commands are read from the README itself, the code block between `BEGIN` and `END` (a test checks that the
record holds the README's block of today, so the two cannot drift). They run line by line, each in its own
`bash` that starts from the environment the lines before it left (an assignment, the activated venv), in a
scratch folder that holds what the repository's root would: `tools/` and the running interpreter's venv as
`.venv` (links). For each `python -m pose_mlx.*` line (finetune, passkey, generate) it records the wall time, the
CPU time (user + system of the process and its children, `resource.getrusage`) and the 1-minute load average
before and after: on a shared machine the wall time says little, the CPU time is what the work costs. The other
lines (fetching the model, naming the data, writing doc.txt) are summed as `setup`. Also recorded: the passkey
found, the estimate line the 16k trial printed, and generate's answer with its prompt and answer tokens (the README
says what such an answer is worth). `--demo` times `python -m pose_mlx.demo` instead, twice into the same folder:
fresh, then reusing its corpus and trained model. Writes benchmarks/results/quickstart.json (what an earlier run
recorded that this one did not measure is kept); the README and docs/demo.md quote it (tests/test_docs_records.py
keeps them equal).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, ROOT, child_env, write_results

README = ROOT / "README.md"
BEGIN, END = "<!-- quickstart:begin", "<!-- quickstart:end -->"
COMMAND = re.compile(r"python -m pose_mlx\.(\w+)\b")


def readme_block(text: str) -> list[str]:
    """The lines of the code block between the README's quickstart markers."""
    start, end = text.index(BEGIN), text.index(END)
    fence = text[start:end].split("```")
    if len(fence) != 3:
        raise SystemExit(f"README.md: one ``` code block between {BEGIN} and {END} expected")
    return [line for line in fence[1].splitlines()[1:] if line.strip()]


def scratch(folder: Path) -> Path:
    """A folder shaped like the repository's root for the block: tools/ and the running venv as .venv (links)."""
    if sys.prefix == sys.base_prefix:
        raise SystemExit("run this benchmark from the repository's venv (the README's block activates .venv)")
    (folder / "tools").symlink_to(ROOT / "tools")
    (folder / ".venv").symlink_to(sys.prefix)
    return folder


def timed(line: str, env: dict, cwd: Path, log: Path) -> tuple[dict, dict, str]:
    """Run one line of the block in bash from `env`: (its wall and CPU seconds and the load around it, the
    environment it leaves, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    script = f"set -ae\n{line}\nprintf '\\0%s' ENVIRONMENT\nenv -0"  # the environment after the line, exported
    with open(log, "w") as err:
        proc = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{line!r} failed ({proc.returncode}); see {log}")
    out, _, rest = proc.stdout.decode().partition("\0ENVIRONMENT")
    log.with_suffix(".out").write_text(out)
    left = dict(item.split("=", 1) for item in rest.split("\0") if "=" in item)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return ({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": round(load0, 2),
             "load_after": round(os.getloadavg()[0], 2)}, left, out)


def run_block(lines: list[str], folder: Path) -> dict:
    """Every line of the block in `folder`: the steps' timings, the setup's, and what the steps produced."""
    env, steps, setup, record = child_env(), {}, {"wall_s": 0.0, "cpu_s": 0.0}, {}
    for i, line in enumerate(lines):
        command = COMMAND.search(line)
        name = command.group(1) if command else None
        cost, env, out = timed(line, env, folder, folder / f"{i}-{name or 'setup'}.log")
        if name is None:
            setup = {k: round(setup[k] + cost[k], 1) for k in setup}
            continue
        steps[name] = cost
        print(name, json.dumps(cost), flush=True)
        err = (folder / f"{i}-{name}.log").read_text()
        if name == "passkey":
            trials = json.loads(next((folder / "out").glob("*/eval/passkey-*.json")).read_text())["trials"]
            record["passkey_found"] = sum(t["correct"] for t in trials)
            record["passkey_estimate"] = next((m.group(0) for m in re.finditer(r"passkey: about [^\r\n]*", err)), None)
        if name == "generate":
            record["answer"] = out.strip()
            summary = re.search(r"prompt: (\d+) tokens, .*generation: (\d+) tokens", err)
            record["prompt_tokens"], record["answer_tokens"] = map(int, summary.groups())
    return {"steps": steps, "setup": setup, **record}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="time the demo (fresh, then reusing) instead")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/quickstart.json)")
    args = p.parse_args(argv)
    path = Path(args.out) if args.out else RESULTS_DIR / "quickstart.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    record = {k: kept[k] for k in ("block", "setup", "passkey_found", "passkey_estimate", "answer", "prompt_tokens",
                                   "answer_tokens") if k in kept}
    steps = dict(kept.get("steps", {}))
    with tempfile.TemporaryDirectory() as tmp:
        if args.demo:
            env = child_env()
            for name in ("demo_fresh", "demo_reuse"):
                line = shlex.join([sys.executable, "-m", "pose_mlx.demo", "--out", str(Path(tmp) / "demo")])
                steps[name] = timed(line, env, Path(tmp), Path(tmp) / f"{name}.log")[0]
                print(name, json.dumps(steps[name]), flush=True)
        else:
            lines = readme_block(README.read_text())
            ran = run_block(lines, scratch(Path(tmp)))
            steps.update(ran.pop("steps"))
            record.update(ran, block=lines)
    write_results("quickstart", {"steps": steps, **record, "cores": os.cpu_count()}, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
