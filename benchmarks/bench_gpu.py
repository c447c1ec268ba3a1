"""One GPU check in one command: `python -m benchmarks.bench_gpu` (about 8 minutes on one H100 / H200).

It builds a random Llama-2-7B-shaped bfloat16 llama itself (32 blocks, hidden 4096, 32 heads, intermediate 11008,
vocabulary 32000, untied head; mlx-lm's llama class, written by `pose_mlx.toy`'s pieces with a sentencepiece
tokenizer trained offline on the standard library, 512 pieces), an mlx-lm data folder of standard-library source
(`common.make_inputs`: every document longer than the window), and then measures, every tool run as its
real command line in a child process (`common.tool_command` / `run_tool`), LoRA rank 8 on every block, batch 1,
`--target 32k --window 4096`, learning rate `LR` in both tools:

  plan         `python -m pose_mlx.plan --json` per configuration (compiled / eager x gradient checkpointing
               on / off) against the largest `peak_memory_gb` of a real `python -m pose_mlx.finetune` run's
               train_log.jsonl; a configuration whose prediction exceeds the device's memory is not run;
  first update the first update's seconds from the log: of the first compiled run (after one eager run, which
               leaves MLX's CUDA kernels compiled in its on-disk cache: what `mx.compile` adds), of the eager run
               (the first training run) and of the later compiled runs;
  throughput   pose_mlx vs `mlx_lm lora` (same model folder, rows, LoRA rank and blocks, batch 1, gradient
               checkpointing in both), interleaved; an update's time is the time between two consecutive
               progress reports stamped by this script (`common.periods`), median per run, tokens/s =
               (window - 1) / that; ratio = pose_mlx tokens/s / mlx-lm tokens/s;
  row length   pose_mlx at windows 4096 and 4097 (4095- vs 4096-token rows fed to the model), side by side;
               when `python -m pose_mlx.finetune --help` lists a row-alignment flag these two run with it off,
               and pose_mlx's default is compared with it off at window 4096;
  tests        `python -m pytest -q -p no:cacheprovider` (with `-n 6` when pytest-xdist is installed; this
               benchmark's own test is left out), passed / failed / skipped from pytest's summary line.

Time: the run stops within `--budget` seconds (default 460). The test suite starts first and runs beside the model
build and the plan (at most `--tests-seconds`, default 200, then it is stopped and counted from its progress);
nothing is timed before it has ended. The training runs follow in order of importance (the eager and the compiled
run with checkpointing, one interleaved round, the runs without checkpointing, a second round); a run is stopped
after `--run-seconds` (default 200), and a run that would not fit the time left is skipped; both are recorded
with the reason.
`--dry-run` runs every stage on a tiny llama (2 blocks, hidden 64, window 256, 2-4 updates) on MLX's default
device (the CPU on a machine without GPU) with a small part of the test suite, and writes to a temporary file
unless `--output` says where. Without a GPU (MLX's default device is the CPU) only `--dry-run` runs.
Writes benchmarks/results/gpu/gpu.json (`common.write_results`: the date, versions and machine added).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import (DRIVER, RESULTS_DIR, ROOT, check_lengths, child_env, make_inputs, own_seconds,
                               periods, run_tool, tool_command, write_results)

DEFAULT_OUTPUT = RESULTS_DIR / "gpu" / "gpu.json"
INFO = "BENCH_GPU_MODEL "

#: Model and run sizes: Llama-2-7B's shapes, and the dry run's tiny llama on the same code path.
SIZES = {
    "full": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000, window=4096, factor=8,
                 steps=5, plan_steps=3, rounds=2, docs=8, dtype="bfloat16",
                 tests=["--ignore=tests/test_bench_gpu.py"]),
    "dry": dict(hidden=64, layers=2, heads=4, intermediate=172, vocab=1024, window=256, factor=8,
                steps=4, plan_steps=2, rounds=2, docs=8, dtype="bfloat16", tests=["tests/test_rope_schedules.py"]),
}

#: Learning rate of both tools, no warm-up: a few updates at bench_vs_mlx_lm's 1e-5 (warmed up) may move a random
#: bfloat16 model's loss by less than its rounding, and pose_mlx refuses to export a model whose loss rose above a
#: uniform guess's (its collapse check); the rate does not change an update's cost.
LR = "1e-4"

#: The memory configurations: (name, compiled, gradient checkpointing).
CONFIGS = (("compiled, checkpointing", True, True), ("eager, checkpointing", False, True),
           ("compiled, no checkpointing", True, False), ("eager, no checkpointing", False, False))

#: The child that builds the model folder and reports the device.
BUILD = r"""
import json, os, sys
import pose_mlx
import mlx.core as mx
from mlx.utils import tree_flatten
from pose_mlx import toy
from pose_mlx.model.source import build_model
folder, size = sys.argv[1], json.loads(sys.argv[2])
info = mx.device_info() if hasattr(mx, "device_info") else {}
gpu = mx.default_device() == mx.gpu
memory = info.get("total_memory") or info.get("memory_size") or (
    os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
report = {"gpu": gpu, "device": str(info.get("device_name") or info.get("architecture") or mx.default_device()),
          "device_memory_bytes": int(memory), "mlx": mx.__version__, "default_device": str(mx.default_device())}
if (gpu or size["dry_run"]) and not size["probe"]:
    toy.train_tokenizer(toy.stdlib_texts(max_chars=toy.DEFAULT_TOKENIZER_CHARS), folder, vocab_size=512)
    tok = toy.tokenizer_info(folder)
    config = toy.model_config(tok["vocab_size"], hidden_size=size["hidden"], num_layers=size["layers"],
                              num_heads=size["heads"], intermediate_size=size["intermediate"],
                              max_position_embeddings=size["window"], tie_word_embeddings=False,
                              bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
                              extra_config={"vocab_size": size["vocab"], "torch_dtype": size["dtype"]})
    model = build_model(config, seed=0)
    model.set_dtype(getattr(mx, size["dtype"]))
    toy.save_model_folder(model, config, folder, folder)
    report["parameters"] = sum(v.size for _, v in tree_flatten(model.parameters()))
print("BENCH_GPU_MODEL " + json.dumps(report), flush=True)
"""


class Clock:
    """Seconds since the start and left of the `budget` (None: no limit)."""

    def __init__(self, budget: float | None):
        self.start, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float | None:
        return None if self.budget is None else self.budget - self.elapsed()


def say(clock: Clock, text: str) -> None:
    print(f"[{clock.elapsed():6.1f} s] {text}", flush=True)


def build_model(folder: Path, size: dict, dry_run: bool, probe: bool = False) -> dict:
    """Build the model folder in a child (this process never starts MLX); the device it saw. `probe`: only that."""
    proc = subprocess.run([sys.executable, "-c", BUILD, str(folder),
                           json.dumps({**size, "dry_run": dry_run, "probe": probe})],
                          env=child_env(), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(INFO)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"building the model failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len(INFO):])


def align_off(help_text: str) -> list[str] | None:
    """The flags that turn row alignment off, when finetune's --help lists a flag with 'align' in its name: its
    `--no-` form when listed, else the flag with the value 'off'; None when there is no such flag."""
    names = re.findall(r"(?<![\w-])--([\w-]*align[\w-]*)", help_text)
    if not names:
        return None
    negative = [n for n in names if n.startswith("no-")]
    if negative:
        return [f"--{negative[0]}"]
    return [f"--{names[0]}", "off"]


def predict(argv: list[str], timeout: float | None) -> dict:
    """`python -m pose_mlx.plan <finetune flags> --json`: the predicted peak and whether the plan says it fits."""
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *argv, "--json"], env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    plan = json.loads(proc.stdout)
    return {"predicted_bytes": int(plan["peak_bytes"]), "phase": plan.get("phase"), "plan_fits": plan.get("fits"),
            "plan_available_bytes": plan.get("available_bytes"), "breakdown": plan.get("breakdown")}


class Runner:
    """Runs pose_mlx and mlx-lm on the benchmark's model and data, each run inside the time left."""

    def __init__(self, args, size: dict, model: Path, data: Path, work: Path, clock: Clock):
        self.model, self.data, self.work, self.clock, self.run_seconds = model, data, work, clock, args.run_seconds
        self.base = SimpleNamespace(**{k: size[k] for k in ("hidden", "layers", "heads", "vocab", "window",
                                                            "factor", "docs")},
                                    batch=1, lora_rank=args.lora_rank, threads=args.threads, steps=size["steps"])
        self.durations: list[float] = []

    def args_for(self, window: int, steps: int) -> SimpleNamespace:
        return SimpleNamespace(**{**vars(self.base), "window": window, "steps": steps})

    def pose_argv(self, window: int, steps: int, compiled: bool = True, checkpoint: bool = True,
                  extra: tuple = ()) -> list[str]:
        """pose_mlx.finetune's flags (`common.tool_command`'s LoRA command, `--target factor x`) for this run."""
        cmd = tool_command("pose_mlx", "lora", steps, self.args_for(window, steps), self.model, self.data, self.work)
        return cmd[4:] + ["--lr", LR, "--warmup", "0"] + (["--grad-checkpoint"] if checkpoint else []) \
            + ([] if compiled else ["--no-compile"]) + list(extra)

    def timeout(self) -> float | None:
        """Seconds the next run may take (the time left, at most --run-seconds); None: no limit. Raises
        TimeoutError when too little is left for a run as long as the median run so far (at least 20 s)."""
        left = self.clock.left()
        if left is None:
            return None
        if left < max(20.0, statistics.median(self.durations) if self.durations else 0.0):
            raise TimeoutError(f"skipped: {max(left, 0):.0f} s left of the budget")
        return min(left, self.run_seconds)

    def _run(self, tool: str, cmd: list[str], args) -> dict:
        t0 = time.perf_counter()
        try:
            return run_tool(cmd, tool, args, timeout=self.timeout())
        finally:
            self.durations.append(time.perf_counter() - t0)

    def pose(self, label: str, window: int, steps: int, compiled: bool = True, checkpoint: bool = True,
             extra: tuple = ()) -> dict:
        """One pose_mlx run: seconds per update (this script's clock, else the log's), peak bytes, first update."""
        args = self.args_for(window, steps)
        argv = self.pose_argv(window, steps, compiled, checkpoint, extra)
        record = {"label": label, "tool": "pose_mlx", "window": window, "input_tokens": window - 1, "steps": steps,
                  "compiled": compiled, "grad_checkpoint": checkpoint, "extra_flags": list(extra)}
        say(self.clock, f"pose_mlx {label}: window {window}, {steps} updates, "
                        f"{'compiled' if compiled else 'eager'}, checkpointing {'on' if checkpoint else 'off'} "
                        f"{' '.join(extra)}")
        out = self.work / "pose_out"
        try:
            t0 = time.perf_counter()
            result = self._run("pose_mlx", [sys.executable, "-c", DRIVER, "pose_mlx", *argv], args)
            record["run_seconds"] = time.perf_counter() - t0
            log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
            record["peak_bytes"] = int(max(r["peak_memory_gb"] for r in log) * 2**30)
            record["first_update_seconds"] = next(r["seconds"] for r in log if r["step"] == 1)
            if steps >= 3:  # updates 2 .. steps-1 are timed
                record.update(_per_update(result, "pose_mlx", args, self.work))
        except (TimeoutError, SystemExit) as error:
            record["error"] = str(error)[-1500:]
        finally:
            shutil.rmtree(out, ignore_errors=True)  # a 7B export is 13 GB: one at a time on the disk
            shutil.rmtree(self.work / "pose_out.partial", ignore_errors=True)
        say(self.clock, "  " + _describe(record))
        return record

    def mlx_lm(self, window: int, steps: int) -> dict:
        """One `mlx_lm lora` run with gradient checkpointing on the same rows."""
        args = self.args_for(window, steps)
        cmd = tool_command("mlx_lm", "lora", steps, args, self.model, self.data, self.work) + [
            "--learning-rate", LR, "--grad-checkpoint"]
        record = {"label": "mlx_lm", "tool": "mlx_lm", "window": window, "input_tokens": window - 1, "steps": steps,
                  "grad_checkpoint": True}
        say(self.clock, f"mlx_lm lora: window {window}, {steps} updates, checkpointing on")
        try:
            t0 = time.perf_counter()
            result = self._run("mlx_lm", cmd, args)
            record["run_seconds"] = time.perf_counter() - t0
            record.update(_per_update(result, "mlx_lm", args, self.work))
        except (TimeoutError, SystemExit) as error:
            record["error"] = str(error)[-1500:]
        finally:
            shutil.rmtree(self.work / "mlx_lm_out", ignore_errors=True)
        say(self.clock, "  " + _describe(record))
        return record


def _per_update(result: dict, tool: str, args, work: Path) -> dict:
    """Median seconds per update and tokens/s: this script's clock between progress reports when at least two
    were seen (`periods`), else the tool's own figures (a progress bar may skip reports of very short updates)."""
    own = own_seconds(tool, result, args, work)
    try:
        seconds, clock = periods(result["marks"], args.steps)["wall"], "reports"
    except SystemExit:
        seconds, clock = own, "own"
    if not seconds:
        raise SystemExit(f"{tool}: no timed update among 2 .. {args.steps - 1}")
    s = statistics.median(seconds)
    tokens = args.batch * (args.window - 1)
    return {"s_per_update": s, "tokens_per_s": tokens / s, "clock": clock, "seconds": seconds,
            "own_s_per_update": statistics.median(own) if own else None}


def _describe(record: dict) -> str:
    if "error" in record:
        return f"not measured: {record['error'].splitlines()[0] if record['error'] else 'error'}"
    parts = [f"{record['s_per_update']:.3f} s/update, {record['tokens_per_s']:.0f} tokens/s"] \
        if "s_per_update" in record else []
    if "peak_bytes" in record:
        parts.append(f"peak {record['peak_bytes'] / 2**30:.2f} GiB, "
                     f"first update {record['first_update_seconds']:.1f} s")
    return "; ".join(parts) + f" ({record['run_seconds']:.0f} s in all)"


def start_tests(args, size: dict, clock: Clock, dry_run: bool) -> dict:
    """Start the test suite (or the dry run's part of it) in a child; it runs while the model is built and the plan
    made, and must end before the timed runs start (`finish_tests`)."""
    workers = args.test_workers if importlib.util.find_spec("xdist") and not dry_run else 0
    # -o addopts= : pyproject's own -q would make this -qq, which prints no summary line
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *(["-n", str(workers)] if workers else []), *size["tests"]]
    say(clock, f"tests: {' '.join(cmd[1:])}, started beside the next stages"
               + ("" if dry_run else f" (at most {args.tests_seconds:.0f} s)"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return {"proc": proc, "cmd": cmd, "start": time.perf_counter(), "limit": None if dry_run else args.tests_seconds}


def finish_tests(tests: dict, clock: Clock) -> dict:
    """Wait for the test suite until its time is up (then stop it); counts from pytest's summary line, or from its
    progress characters when it had to be stopped."""
    proc, limit = tests["proc"], tests["limit"]
    say(clock, "tests: waiting for the test suite")
    try:
        timeout = None if limit is None else max(limit - (time.perf_counter() - tests["start"]), 1.0)
        output, complete = proc.communicate(timeout=timeout)[0], True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and its xdist workers, which this script started
        output, complete = proc.communicate()[0], False
    counts = parse_pytest(output)
    record = {**counts, "complete": complete and counts["summary"] is not None, "exit_code": proc.returncode,
              "seconds": time.perf_counter() - tests["start"], "command": " ".join(["python", *tests["cmd"][1:]]),
              "tail": output[-1500:]}
    say(clock, f"  {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
               + ("" if record["complete"] else " (stopped before the end: counted from its progress)"))
    return record


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_PROGRESS = re.compile(r"^([.FsExX]+)\s*(\[\s*\d+%\])?$")


def parse_pytest(output: str) -> dict:
    """passed / failed / skipped / errors (ints) from pytest's last summary line ('3 passed, 1 skipped in 2.0s');
    without one (a run that was stopped), from the `-q` progress characters (. F s E x X)."""
    lines = output.splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\b(passed|failed|skipped|errors?|no tests ran)\b",
                                                                  line) and re.search(r" in [\d.]+s", line)), None)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if summary is not None:
        for number, word in _SUMMARY.findall(summary):
            key = "errors" if word.startswith("error") else word
            if key in counts:
                counts[key] += int(number)
    else:
        chars = "".join(m.group(1) for m in map(_PROGRESS.match, (line.strip() for line in lines)) if m)
        counts.update(passed=chars.count("."), failed=chars.count("F"), skipped=chars.count("s"),
                      errors=chars.count("E"))
    return {**counts, "summary": summary.strip("= ") if summary else None}


def rates(records: list[dict], label: str) -> list[float]:
    return [r["tokens_per_s"] for r in records if r.get("label") == label and "tokens_per_s" in r]


def ratio_of(a: list[float], b: list[float]) -> dict:
    """Median tokens/s of each side and their ratio a / b (None where a side has no measurement)."""
    ma, mb = (statistics.median(x) if x else None for x in (a, b))
    return {"a": ma, "b": mb, "ratio": ma / mb if ma and mb else None}


def measure(args, size: dict, work: Path, clock: Clock, dry_run: bool) -> dict:
    """Check the device (exit 2 without a GPU unless a dry run), start the test suite, then every other stage."""
    say(clock, f"model: {size['layers']} blocks, hidden {size['hidden']}, {size['heads']} heads, intermediate "
               f"{size['intermediate']}, vocabulary {size['vocab']}, {size['dtype']}")
    device = build_model(work / "model", size, dry_run, probe=True)
    if not device["gpu"] and not dry_run:
        print(f"error: MLX's default device is {device['default_device']}, not a GPU; this benchmark needs one "
              "(pip install -e \".[cuda,test]\" on a CUDA machine), or pass --dry-run", file=sys.stderr)
        sys.exit(2)
    tests = start_tests(args, size, clock, dry_run) if not args.skip_tests else None
    try:
        return _measure(args, size, work, clock, dry_run, tests)
    finally:
        if tests is not None and tests["proc"].poll() is None:  # stopped by an error: stop the suite too
            os.killpg(tests["proc"].pid, signal.SIGKILL)
            tests["proc"].communicate()


def _measure(args, size: dict, work: Path, clock: Clock, dry_run: bool, tests: dict | None) -> dict:
    """The stages after the device check; the results' dict."""
    stages: dict[str, float] = {}

    def stage(name: str, t0: float) -> None:
        stages[name] = time.perf_counter() - t0

    t0 = time.perf_counter()
    model = work / "model"
    device = build_model(model, size, dry_run)
    say(clock, f"  {device['parameters']:,} parameters on {device['device']} "
               f"({device['device_memory_bytes'] / 2**30:.1f} GiB), mlx {device['mlx']}")
    stage("model", t0)

    t0 = time.perf_counter()
    window = size["window"]
    data_args = SimpleNamespace(window=window + 1, docs=size["docs"], doc_chars=6 * (window + 1))
    model, data = make_inputs(data_args, work)
    shortest = check_lengths(data_args, model, data)
    help_text = subprocess.run([sys.executable, "-m", "pose_mlx.finetune", "--help"], env=child_env(),
                               capture_output=True, text=True).stdout
    align = align_off(help_text)
    say(clock, f"data: {size['docs']} documents of >= {shortest} tokens; row alignment flag: "
               + (" ".join(align) + " (off)" if align else "none"))
    stage("data", t0)

    runner = Runner(args, size, model, data, work, clock)
    off = tuple(align) if align else ()

    t0 = time.perf_counter()
    plan = []
    for name, compiled, checkpoint in CONFIGS:
        prediction = predict(runner.pose_argv(window, size["plan_steps"], compiled, checkpoint), timeout=120)
        fits = prediction.get("predicted_bytes", 0) <= device["device_memory_bytes"] and "error" not in prediction
        plan.append({"config": name, "compiled": compiled, "grad_checkpoint": checkpoint, **prediction,
                     "fits_device": fits, "measured_bytes": None})
        say(clock, f"plan {name}: " + (f"{prediction['predicted_bytes'] / 2**30:.2f} GiB predicted"
                                       if "predicted_bytes" in prediction else prediction["error"])
            + ("" if fits else " - does not fit the device, not run"))
    stage("plan", t0)

    if tests is not None:  # nothing is timed while the test suite runs
        t0 = time.perf_counter()
        tests = finish_tests(tests, clock)
        stage("waiting_for_tests", t0)

    records: list[dict] = []

    def measured(entry: dict, record: dict) -> None:
        records.append(record)
        if "peak_bytes" in record:
            entry["measured_bytes"] = record["peak_bytes"]
            entry["error"] = record["peak_bytes"] / entry["predicted_bytes"] - 1
            entry["first_update_seconds"] = record["first_update_seconds"]
        else:
            entry["not_measured"] = record.get("error")

    # a round: pose_mlx's default run (compiled, checkpointing, window W), mlx-lm, and the row-length runs
    runs = [lambda: runner.pose("default", window, size["steps"]), lambda: runner.mlx_lm(window, size["steps"])]
    if align:
        runs.append(lambda: runner.pose("rows off", window, size["steps"], extra=off))
    runs.append(lambda: runner.pose("rows +1", window + 1, size["steps"], extra=off))

    def memory_run(entry: dict, label: str | None = None, steps: int = size["plan_steps"]) -> dict:
        if not entry["fits_device"]:
            entry["not_measured"] = "the plan's prediction exceeds the device's memory"
            return {}
        record = runner.pose(label or entry["config"], window, steps, entry["compiled"], entry["grad_checkpoint"])
        measured(entry, record)
        return record

    # eager first: it fills MLX's kernel cache, so the first compiled run's first update shows what compiling costs;
    # that run is also the first round's pose_mlx run (its updates 2 .. steps-1 are past the compilation)
    t0 = time.perf_counter()
    memory_run(plan[1])
    first = memory_run(plan[0], "default", size["steps"])
    stage("first_runs", t0)

    t0 = time.perf_counter()
    for fn in runs[1:]:
        records.append(fn())
    stage("round_1", t0)

    t0 = time.perf_counter()
    for entry in plan[2:]:
        memory_run(entry)
    stage("memory_runs", t0)

    t0 = time.perf_counter()
    for r in range(1, size["rounds"]):
        for fn in runs[::-1] if r % 2 else runs:
            records.append(fn())
    stage("more_rounds", t0)

    throughput = ratio_of(rates(records, "default"), rates(records, "mlx_lm"))
    rows = ratio_of(rates(records, "rows +1"), rates(records, "rows off" if align else "default"))
    aligned = ratio_of(rates(records, "default"), rates(records, "rows off")) if align else None
    warm_first = [r["first_update_seconds"] for r in records if r.get("label") == "default"
                  and "first_update_seconds" in r and r is not first]

    return {
        "device": device["device"],
        "device_memory_bytes": device["device_memory_bytes"],
        "mlx": device["mlx"],
        "mlx_packages": {d.metadata["Name"]: d.version for d in metadata.distributions()
                         if (d.metadata["Name"] or "").lower().startswith("mlx")},
        "dry_run": dry_run,
        "tests": tests,
        "plan": plan,
        "throughput": {
            "pose_mlx": throughput["a"], "mlx_lm": throughput["b"], "ratio": throughput["ratio"],
            "tokens_per_update": window - 1, "rounds": len(rates(records, "mlx_lm"))},
        "row_length": {
            "windows": [window, window + 1], "input_tokens": [window - 1, window],
            "tokens_per_s": [rows["b"], rows["a"]], "ratio": rows["ratio"],
            "alignment": "off (" + " ".join(off) + ")" if align else "no alignment flag in pose_mlx.finetune"},
        "alignment": None if aligned is None else {
            "flag_off": list(off), "default_tokens_per_s": aligned["a"], "off_tokens_per_s": aligned["b"],
            "ratio": aligned["ratio"]},
        "first_update_seconds": first.get("first_update_seconds"),
        "first_update_seconds_eager": plan[1].get("first_update_seconds"),
        "first_update_seconds_warm": statistics.median(warm_first) if warm_first else None,
        "runs": records,
        "stage_seconds": stages,
        "total_seconds": clock.elapsed(),
        "model": {"parameters": device["parameters"], "layers": size["layers"], "hidden": size["hidden"],
                  "heads": size["heads"], "intermediate": size["intermediate"], "vocab": size["vocab"],
                  "dtype": size["dtype"], "tie_word_embeddings": False},
        "config": {"window": window, "target": window * size["factor"], "lora_rank": args.lora_rank, "lr": float(LR),
                   "lora_layers": "all", "batch": 1, "steps": size["steps"], "plan_steps": size["plan_steps"],
                   "rounds": size["rounds"], "budget_s": None if dry_run else args.budget,
                   "run_s": None if dry_run else args.run_seconds,
                   "tests_s": None if dry_run else args.tests_seconds},
        "method": ("per update = time between the progress reports of updates n-1 and n (n = 2 .. steps-1) "
                   "stamped by this script, median per run; throughput and row-length ratios = median tokens/s over "
                   "runs of one side / the other's, the runs interleaved; peaks = the largest peak_memory_gb of a "
                   "run's train_log.jsonl"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on a tiny llama (2 blocks, hidden 64, window 256) with a small part of the "
                             "test suite, on MLX's default device; writes to a temporary file unless --output")
    parser.add_argument("--output", help=f"JSON path (default {DEFAULT_OUTPUT.relative_to(ROOT)}; with --dry-run a "
                                         "file in the temporary directory)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the test suite ('tests' is null)")
    parser.add_argument("--budget", type=float, default=460.0,
                        help="seconds for the whole benchmark: runs that would not fit are skipped and recorded so "
                             "(default 460; ignored with --dry-run)")
    parser.add_argument("--tests-seconds", type=float, default=200.0,
                        help="seconds the test suite may run (it starts first, beside the model build) before it is "
                             "stopped and counted from its progress (default 200; ignored with --dry-run)")
    parser.add_argument("--run-seconds", type=float, default=200.0,
                        help="seconds one training run may take before it is stopped and recorded so (default 200; "
                             "ignored with --dry-run)")
    parser.add_argument("--test-workers", type=int, default=6,
                        help="pytest-xdist workers (-n) when pytest-xdist is installed (default 6; 0: none)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of both tools (default 8)")
    parser.add_argument("--threads", type=int, default=0,
                        help="OPENBLAS_NUM_THREADS of the training children (default 0: leave the environment alone)")
    parser.add_argument("--workdir", help="folder for the model, data and outputs (kept; default: a temporary one, "
                                          "removed at the end)")
    args = parser.parse_args(argv)
    if min(args.budget, args.run_seconds, args.lora_rank) <= 0 or min(args.tests_seconds, args.test_workers,
                                                                        args.threads) < 0:
        parser.error("need --budget, --run-seconds, --lora-rank > 0 and --tests-seconds, --test-workers, "
                     "--threads >= 0")
    output = Path(args.output) if args.output else (
        Path(tempfile.gettempdir()) / "bench_gpu_dry_run.json" if args.dry_run else DEFAULT_OUTPUT)
    if args.dry_run and output.resolve() == DEFAULT_OUTPUT.resolve():
        parser.error(f"--dry-run does not write {DEFAULT_OUTPUT.relative_to(ROOT)} (its numbers are a toy's)")
    size = SIZES["dry" if args.dry_run else "full"]
    clock = Clock(None if args.dry_run else args.budget)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = measure(args, size, work, clock, args.dry_run)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    path = write_results("gpu", results, output)
    say(clock, f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
