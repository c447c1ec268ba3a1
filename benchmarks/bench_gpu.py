"""One GPU check in one command: `python -m benchmarks.bench_gpu` (about 8 minutes on one H100 / H200).

It builds a random Llama-2-7B-shaped bfloat16 llama itself (32 blocks, hidden 4096, 32 heads, intermediate 11008,
vocabulary 32000, untied head; mlx-lm's llama class, written by `pose_mlx.toy`'s pieces with a sentencepiece
tokenizer trained offline on the standard library, 512 pieces), an mlx-lm data folder of standard-library source
(`common.make_inputs`: every document longer than the window), and then measures, every tool run as its
real command line in a child process (`common.tool_command` / `run_tool`), LoRA rank 8 on every block, batch 1,
`--target 32k --window 4096`, learning rate `LR` in both tools (pose_mlx with `--no-fuse`: adapters only, no 13 GB
export per run):

  plan         `python -m pose_mlx.plan --json` per configuration (compiled / eager x gradient checkpointing
               on / off) against the largest `peak_memory_gb` of a real `python -m pose_mlx.finetune` run's
               train_log.jsonl; a configuration whose prediction exceeds the device's memory is not run;
  first update the first update's seconds from the log: of the first compiled run (after the eager runs, which
               leave MLX's CUDA kernels compiled in its on-disk cache: what `mx.compile` adds), of the eager run
               and of the later compiled runs; `compile_payback_updates` = the compiled first update's extra
               seconds over the eager one / the seconds compiling saves per later update;
  throughput   pose_mlx vs `mlx_lm lora` (same model folder, rows, LoRA rank and blocks, batch 1, gradient
               checkpointing in both), interleaved A B B A; an update's time is the time between two consecutive
               progress reports stamped by this script (`common.periods`), median per run, tokens/s =
               (window - 1) / that; ratio = pose_mlx tokens/s / mlx-lm tokens/s;
  row length   pose_mlx at windows 4096 and 4097 (4095- vs 4096-token rows fed to the model), side by side;
               when `python -m pose_mlx.finetune --help` lists a row-alignment flag these two run with it off,
               and pose_mlx's default is compared with it off at window 4096;
  mfu          the card's bf16 matmul peak (`gpu_checks.matmul_peak`, N 8192, alone on the card) and pose_mlx's
               model-FLOP utilisation at that throughput (`gpu_checks`' docstring has the FLOP convention);
  tests        the whole suite, `python -m pytest -v -rfE` (with `-n` workers when pytest-xdist is installed;
               this benchmark's own test is left out): passed / failed / skipped and the failed tests' names;
  conditions   whether another process used the GPU during the run (`gpu_checks.CardWatch`: nvidia-smi's compute
               processes at the start, between stages and every 10 s, less this benchmark's own process tree);
  goals        each goal of the issue with its value and whether it held (`gpu_checks.goals`).

Time: the run keeps to `--budget` seconds (default 500). The test suite starts first; beside it run the model
build, the plan and the eager runs whose predicted peak is at most half the GPU's memory (their peaks are their
own process's; nothing is timed for a goal while the suite runs); it is stopped after `--tests-seconds` (default
240) or when too little of the budget would be left for the first compiled and mlx-lm runs, and counted from its
per-test lines. Then, alone: the matmul peak, the first compiled run, mlx-lm, the other memory runs, the row runs,
a second round in reverse order. A run is stopped after `--run-seconds` (default 200), and one that would not fit
the time left is skipped; both are recorded with the reason (`incomplete`), and the exit code is then 3. Every
child's time is bounded by the budget. SIGTERM (or Ctrl-C) stops the running child; the JSON is written either
way, and after every stage, with what was finished.
`--dry-run` runs every stage on a tiny llama (2 blocks, hidden 64, window 256, 3-4 updates, N 256) on MLX's
default device (the CPU on a machine without GPU) with a small part of the test suite, into a temporary folder
unless `--output` says where; `--budget` then applies only when given. Without a GPU only `--dry-run` runs.
Writes `--output` (default benchmarks/results/gpu/): gpu.json (`common.write_results`: the date, versions and
machine added) and logs/ (the suite's output and each child's command and output).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pose_mlx.errors import ArgumentParser, Stopped, UserError, command

from benchmarks import gpu_checks
from benchmarks.common import (DRIVER, RESULTS_DIR, ROOT, check_lengths, child_env, make_inputs, own_seconds,
                               periods, run_tool, tool_command, write_results)

DEFAULT_OUTPUT = RESULTS_DIR / "gpu"
INFO = "BENCH_GPU_MODEL "

#: Model and run sizes: Llama-2-7B's shapes, and the dry run's tiny llama on the same code path.
SIZES = {
    "full": dict(hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000, window=4096, factor=8,
                 steps=5, plan_steps=3, rounds=2, docs=8, dtype="bfloat16", matmul=(8192, 4, 20), core_s=150.0,
                 tests=["tests", "--ignore=tests/test_bench_gpu.py"]),
    "dry": dict(hidden=64, layers=2, heads=4, intermediate=172, vocab=1024, window=256, factor=8,
                steps=4, plan_steps=3, rounds=2, docs=8, dtype="bfloat16", matmul=(256, 4, 5), core_s=0.0,
                tests=["tests/test_rope_schedules.py"]),
}

#: Learning rate of both tools, no warm-up: a few updates at bench_vs_mlx_lm's 1e-5 (warmed up) may move a random
#: bfloat16 model's loss by less than its rounding, and pose_mlx refuses to export a model whose loss rose above a
#: uniform guess's (its collapse check); the rate does not change an update's cost.
LR = "1e-4"

#: The memory configurations: (name, compiled, gradient checkpointing).
CONFIGS = (("compiled, checkpointing", True, True), ("eager, checkpointing", False, True),
           ("compiled, no checkpointing", True, False), ("eager, no checkpointing", False, False))
#: An eager run runs beside the test suite when its predicted peak is at most this share of the GPU's memory.
BESIDE_TESTS_SHARE = 0.5

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



class OutOfBudget(Exception):
    """Too little of the budget is left for the next child: it is skipped (recorded with this message)."""


class Terminated(BaseException):
    """SIGTERM arrived: the running child is stopped and what was finished is written."""


class Clock:
    """Seconds since the start and left of the `budget` (None: no limit)."""

    def __init__(self, budget: float | None):
        self.start, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float | None:
        return None if self.budget is None else self.budget - self.elapsed()

    def allow(self, cap: float | None, need: float = 1.0) -> float | None:
        """Seconds the next child may take: the time left, at most `cap` (None: no limit). Raises OutOfBudget
        when less than `need` seconds are left."""
        left = self.left()
        if left is None:
            return cap
        if left < need:
            raise OutOfBudget(f"skipped: {max(left, 0):.0f} s left of the budget")
        return left if cap is None else min(left, cap)


def say(clock: Clock, text: str) -> None:
    print(f"[{clock.elapsed():6.1f} s] {text}", flush=True)


def build_model(folder: Path, size: dict, dry_run: bool, timeout: float | None, log: Path | None = None,
                probe: bool = False) -> dict:
    """Build the model folder in a child (this process never starts MLX); the device it saw. `probe`: only that."""
    proc = subprocess.run([sys.executable, "-c", BUILD, str(folder),
                           json.dumps({**size, "dry_run": dry_run, "probe": probe})],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n")
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
    """`python -m pose_mlx.plan <finetune flags> --json`: the predicted peak, whether the plan says it fits, and
    the parameter counts (base and trainable) the MFU needs."""
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *argv, "--json"], env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"plan_error": proc.stderr.strip()[-500:]}
    plan = json.loads(proc.stdout)
    details = plan.get("details", {})
    return {"predicted_bytes": int(plan["peak_bytes"]), "phase": plan.get("phase"), "plan_fits": plan.get("fits"),
            "plan_available_bytes": plan.get("available_bytes"), "breakdown": plan.get("breakdown"),
            "parameters": details.get("parameters"), "trainable_parameters": details.get("trainable_parameters")}


def _label(tool: str, label: str) -> str:
    """A log's name part for a run: letters, digits, '.', '_' and '-' only ("rows +1" -> "rows-plus1")."""
    text = tool if label == tool else f"{tool}-{label.replace('+', 'plus')}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


class Runner:
    """Runs pose_mlx and mlx-lm on the benchmark's model and data, each run inside the time left; every run's
    record goes to `records` and its output to `logs`/NN-<tool>-<label>.log."""

    def __init__(self, args, size: dict, model: Path, data: Path, work: Path, clock: Clock, logs: Path,
                 records: list[dict]):
        self.model, self.data, self.work, self.clock, self.run_seconds = model, data, work, clock, args.run_seconds
        self.logs, self.records = logs, records
        self.base = SimpleNamespace(**{k: size[k] for k in ("hidden", "layers", "heads", "vocab", "window",
                                                            "factor", "docs")},
                                    batch=1, lora_rank=args.lora_rank, threads=args.threads, steps=size["steps"])
        self.durations: list[float] = []
        self.beside_tests = False  # set while the test suite runs beside

    def args_for(self, window: int, steps: int) -> SimpleNamespace:
        return SimpleNamespace(**{**vars(self.base), "window": window, "steps": steps})

    def pose_argv(self, window: int, steps: int, compiled: bool = True, checkpoint: bool = True,
                  extra: tuple = ()) -> list[str]:
        """pose_mlx.finetune's flags (`common.tool_command`'s LoRA command, `--target factor x`) for this run."""
        cmd = tool_command("pose_mlx", "lora", steps, self.args_for(window, steps), self.model, self.data, self.work)
        return cmd[4:] + ["--lr", LR, "--warmup", "0", "--no-fuse"] + (["--grad-checkpoint"] if checkpoint else []) \
            + ([] if compiled else ["--no-compile"]) + list(extra)

    def _run(self, tool: str, cmd: list[str], args, record: dict) -> dict:
        """One child within the time left (at most --run-seconds; skipped when less is left than the median run
        so far, at least 20 s)."""
        need = max(20.0, statistics.median(self.durations) if self.durations else 0.0)
        timeout = self.clock.allow(self.run_seconds, need)
        log = self.logs / f"{len(self.records):02d}-{_label(tool, record['label'])}.log"  # record is in
        record["log"] = log.name
        t0 = time.perf_counter()
        try:
            return run_tool(cmd, tool, args, timeout=timeout, log=log)
        finally:
            record["run_seconds"] = time.perf_counter() - t0
            self.durations.append(record["run_seconds"])

    def pose(self, label: str, window: int, steps: int, compiled: bool = True, checkpoint: bool = True,
             extra: tuple = ()) -> dict:
        """One pose_mlx run: seconds per update (this script's clock, else the log's), peak bytes, first update."""
        args = self.args_for(window, steps)
        argv = self.pose_argv(window, steps, compiled, checkpoint, extra)
        record = {"label": label, "tool": "pose_mlx", "window": window, "input_tokens": window - 1, "steps": steps,
                  "compiled": compiled, "grad_checkpoint": checkpoint, "extra_flags": list(extra),
                  "beside_tests": self.beside_tests}
        say(self.clock, f"pose_mlx {label}: window {window}, {steps} updates, "
                        f"{'compiled' if compiled else 'eager'}, checkpointing {'on' if checkpoint else 'off'} "
                        f"{' '.join(extra)}")
        out = self.work / "pose_out"
        self.records.append(record)
        try:
            result = self._run("pose_mlx", [sys.executable, "-c", DRIVER, "pose_mlx", *argv], args, record)
            log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
            record["peak_bytes"] = int(max(r["peak_memory_gb"] for r in log) * 2**30)
            record["first_update_seconds"] = next(r["seconds"] for r in log if r["step"] == 1)
            if steps >= 3:  # updates 2 .. steps-1 are timed
                record.update(_per_update(result, "pose_mlx", args, self.work))
        except (TimeoutError, SystemExit, OutOfBudget) as error:
            record["error"] = str(error)[-1500:]
        finally:
            shutil.rmtree(out, ignore_errors=True)
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
        self.records.append(record)
        try:
            result = self._run("mlx_lm", cmd, args, record)
            record.update(_per_update(result, "mlx_lm", args, self.work))
        except (TimeoutError, SystemExit, OutOfBudget) as error:
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


# ------------------------------------------------------------------------------------------ the stages


class Progress:
    """Times each stage into `stage_seconds`, samples the card at its start and writes the JSON at its end."""

    def __init__(self, results: dict, clock: Clock, watch: gpu_checks.CardWatch, save):
        self.results, self.clock, self.watch, self.save, self.current = results, clock, watch, save, "start"

    def __call__(self, name: str, fn, *args):
        self.current = name
        self.watch.sample(name)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.results["stage_seconds"][name] = time.perf_counter() - t0
            self.save()


def measure(args, size: dict, work: Path, clock: Clock, results: dict, progress: Progress, logs: Path,
            setup: dict) -> None:
    """Every stage after the device check, in order, filling `results`; the test suite runs from the start."""
    workers = 0 if args.dry_run else args.test_workers  # the dry run's few tests: no workers to start
    tests = None if args.skip_tests else gpu_checks.start_tests(size["tests"], workers, logs / "tests.log")
    if tests is not None:
        say(clock, f"tests: {' '.join(tests['cmd'][1:])}, started beside the next stages")
    try:
        runner = progress("model", _model_and_data, args, size, work, clock, results, logs, setup)
        window, steps, align = size["window"], size["steps"], setup["align"]
        off = tuple(align or ())
        plan = progress("plan", _plan, runner, size, clock, results)
        memory = results["device_memory_bytes"]
        beside = [e for e in (plan[1], plan[3]) if tests is not None and e["fits_device"]
                  and e["predicted_bytes"] <= BESIDE_TESTS_SHARE * memory]
        runner.beside_tests = tests is not None
        progress("beside_tests", lambda: [memory_run(runner, e, size) for e in beside])
        runner.beside_tests = False
        if tests is not None:
            results["tests"] = progress("tests", _finish_tests, tests, args, size, clock)
        results["matmul_peak"] = progress("matmul_peak", _peak, size, clock)

        def first_compiled():  # after an eager run, which fills the kernel cache
            memory_run(runner, plan[1], size)
            record = memory_run(runner, plan[0], size, "default", steps)
            record["first_compiled"] = True

        progress("first_compiled", first_compiled)
        progress("round_1", runner.mlx_lm, window, steps)
        progress("memory_runs", lambda: [memory_run(runner, e, size) for e in plan[2:]])
        rows = ([lambda: runner.pose("rows off", window, steps, extra=off)] if align else []) + [
            lambda: runner.pose("rows +1", window + 1, steps, extra=off)]
        progress("rows", lambda: [fn() for fn in rows])
        for r in range(1, size["rounds"]):  # the reverse order: B A after A B
            progress(f"round_{r + 1}", lambda: (runner.mlx_lm(window, steps),
                                                runner.pose("default", window, steps)))
            progress(f"rows_{r + 1}", lambda: [fn() for fn in rows[::-1]])
    finally:
        if tests is not None and results["tests"] is None:  # stopped before its end: count what it ran
            results["tests"] = _finish_tests(tests, args, size, clock, 0.0)


def _model_and_data(args, size: dict, work: Path, clock: Clock, results: dict, logs: Path, setup: dict) -> Runner:
    """The model folder (in a child), the data folder, finetune's row-alignment flag; the runner."""
    device = build_model(work / "model", size, results["dry_run"], clock.allow(None, 10), logs / "build.log")
    results["model"]["parameters"] = device["parameters"]
    say(clock, f"  {device['parameters']:,} parameters on {device['device']} "
               f"({device['device_memory_bytes'] / 2**30:.1f} GiB), mlx {device['mlx']}")
    window = size["window"]
    data_args = SimpleNamespace(window=window + 1, docs=size["docs"], doc_chars=6 * (window + 1))
    model, data = make_inputs(data_args, work)
    shortest = check_lengths(data_args, model, data)
    help_text = subprocess.run([sys.executable, "-m", "pose_mlx.finetune", "--help"], env=child_env(),
                               capture_output=True, text=True, timeout=clock.allow(60, 5)).stdout
    setup["align"] = align_off(help_text)
    say(clock, f"data: {size['docs']} documents of >= {shortest} tokens; row alignment flag: "
               + (" ".join(setup["align"]) + " (off)" if setup["align"] else "none"))
    return Runner(args, size, model, data, work, clock, logs, results["runs"])


def _plan(runner: Runner, size: dict, clock: Clock, results: dict) -> list[dict]:
    """`pose_mlx.plan`'s prediction of every configuration; those over the device's memory are not run."""
    for name, compiled, checkpoint in CONFIGS:
        prediction = predict(runner.pose_argv(size["window"], size["plan_steps"], compiled, checkpoint),
                             timeout=clock.allow(120, 5))
        fits = "plan_error" not in prediction and prediction["predicted_bytes"] <= results["device_memory_bytes"]
        results["plan"].append({"config": name, "compiled": compiled, "grad_checkpoint": checkpoint, **prediction,
                                "fits_device": fits, "measured_bytes": None})
        say(clock, f"plan {name}: " + (f"{prediction['predicted_bytes'] / 2**30:.2f} GiB predicted"
                                       if "predicted_bytes" in prediction else prediction["plan_error"])
            + ("" if fits else " - does not fit the device, not run"))
    return results["plan"]


def memory_run(runner: Runner, entry: dict, size: dict, label: str | None = None, steps: int | None = None) -> dict:
    """The plan entry's configuration, run once (its measured peak and first update); {} when already run or
    predicted not to fit."""
    if entry.get("attempted"):
        return {}
    entry["attempted"] = True
    if not entry["fits_device"]:
        entry["not_measured"] = entry.get("plan_error") or "the plan's prediction exceeds the device's memory"
        return {}
    record = runner.pose(label or entry["config"], size["window"], steps or size["plan_steps"], entry["compiled"],
                         entry["grad_checkpoint"])
    if "peak_bytes" in record:
        entry.update(measured_bytes=record["peak_bytes"], error=record["peak_bytes"] / entry["predicted_bytes"] - 1,
                     first_update_seconds=record["first_update_seconds"])
    else:
        entry["not_measured"] = record.get("error")
    return record


def _finish_tests(tests: dict, args, size: dict, clock: Clock, timeout: float | None = None) -> dict:
    """Wait for the suite until --tests-seconds from its start, or until only the first compiled and mlx-lm
    runs' time (`core_s`) is left of the budget; then it is stopped and counted from its per-test lines."""
    if timeout is None:
        limits = [args.tests_seconds - (time.perf_counter() - tests["start"])] if args.tests_seconds else []
        left = clock.left()
        limits += [left - size["core_s"]] if left is not None else []
        timeout = max(min(limits), 1.0) if limits else None
    say(clock, "tests: waiting for the test suite" + (f" (at most {timeout:.0f} s)" if timeout else ""))
    record = gpu_checks.finish_tests(tests, timeout)
    say(clock, f"  {record['passed']} passed, {record['failed']} failed, {record['skipped']} skipped"
               + (f", {record['errors']} errors" if record["errors"] else "")
               + ("" if record["complete"] else " (stopped before the end: counted from its per-test lines)")
               + "".join(f"\n    FAILED {name}" for name in record["failed_names"]))
    return record


def _peak(size: dict, clock: Clock) -> dict | None:
    """The card's bf16 matmul peak (`gpu_checks.matmul_peak`), alone on the card; None when it failed."""
    n, k, reps = size["matmul"]
    try:
        peak = gpu_checks.matmul_peak(n, k, reps, clock.allow(120, 10))
    except (SystemExit, subprocess.TimeoutExpired) as error:
        say(clock, f"matmul peak: not measured: {str(error).splitlines()[0]}")
        return None
    say(clock, f"matmul peak: {peak['tflops']:.4g} TFLOP/s (bf16 {n} x {n}, {k} at a time, median of {reps})")
    return peak


# ------------------------------------------------------------------------------------------ the command


def _terminate(signum, frame):
    raise Terminated()


def _stale_logs(logs: Path) -> list[Path]:
    """The log files an earlier run of this benchmark wrote into `logs` (only those: the folder may hold others)."""
    names = ("tests.log", "build.log")
    return [p for p in logs.glob("*.log") if p.name in names or re.match(r"\d\d-(pose_mlx|mlx_lm)-", p.name)]


def parse_args(argv):
    parser = ArgumentParser(prog="python -m benchmarks.bench_gpu", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on a tiny llama (2 blocks, hidden 64, window 256) with a small part of the "
                             "test suite, on MLX's default device; writes to a temporary folder unless --output")
    parser.add_argument("--output", type=Path,
                        help=f"folder for gpu.json and logs/ (default {DEFAULT_OUTPUT.relative_to(ROOT)}; with "
                             "--dry-run a folder in the temporary directory)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the test suite ('tests' is null)")
    parser.add_argument("--budget", type=float,
                        help="seconds for the whole benchmark: every child is bounded by the time left, runs that "
                             "would not fit are skipped and recorded so, exit code 3 (default 500; none with "
                             "--dry-run)")
    parser.add_argument("--tests-seconds", type=float,
                        help="seconds the test suite may run before it is stopped and counted from its per-test "
                             "lines (default 240; none with --dry-run)")
    parser.add_argument("--run-seconds", type=float,
                        help="seconds one training run may take before it is stopped and recorded so (default 200; "
                             "none with --dry-run)")
    parser.add_argument("--test-workers", type=int, default=10,
                        help="pytest-xdist workers (-n) when pytest-xdist is installed (default 10; 0: none)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank of both tools (default 8)")
    parser.add_argument("--threads", type=int, default=0,
                        help="OPENBLAS_NUM_THREADS of the training children (default 0: leave the environment alone)")
    parser.add_argument("--workdir", type=Path, help="folder for the model, data and outputs (kept; default: a "
                                                     "temporary one, removed at the end)")
    args = parser.parse_args(argv)
    defaults = {} if args.dry_run else {"budget": 500.0, "tests_seconds": 240.0, "run_seconds": 200.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if any(v is not None and v <= 0 for v in (args.budget, args.run_seconds, args.tests_seconds)) \
            or args.lora_rank <= 0 or min(args.test_workers, args.threads) < 0:
        raise UserError("need --budget, --run-seconds, --tests-seconds, --lora-rank > 0 and --test-workers, "
                        "--threads >= 0")
    output = args.output or (Path(tempfile.gettempdir()) / "bench_gpu_dry_run" if args.dry_run else DEFAULT_OUTPUT)
    if args.dry_run and output.resolve() == DEFAULT_OUTPUT.resolve():
        raise UserError(f"--dry-run does not write {DEFAULT_OUTPUT.relative_to(ROOT)} (its numbers are a toy's)")
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file; it names the folder for gpu.json and logs/")
    args.output = output
    return args


@command("bench_gpu")
def main(argv=None) -> int:
    args = parse_args(argv)
    size = SIZES["dry" if args.dry_run else "full"]
    clock = Clock(args.budget)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = args.output / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in _stale_logs(logs):
        stale.unlink()
    say(clock, f"model: {size['layers']} blocks, hidden {size['hidden']}, {size['heads']} heads, intermediate "
               f"{size['intermediate']}, vocabulary {size['vocab']}, {size['dtype']}")
    device = build_model(work / "model", size, args.dry_run, clock.allow(120, 10), probe=True)
    if not device["gpu"] and not args.dry_run:
        raise UserError(f"MLX's default device is {device['default_device']}, not a GPU; this benchmark needs one "
                        "(pip install -e \".[cuda,test]\" on a CUDA machine), or pass --dry-run")
    results, stops, setup = gpu_checks.new_results(args, size, LR), [], {"align": None}
    results.update(device=device["device"], device_memory_bytes=device["device_memory_bytes"], mlx=device["mlx"])
    watch = gpu_checks.CardWatch()

    def save() -> None:
        results["total_seconds"] = clock.elapsed()
        gpu_checks.summarize(results, stops, watch, setup["align"])
        partial = args.output / "gpu.json.partial"
        write_results("gpu", results, partial)
        partial.replace(args.output / "gpu.json")

    progress = Progress(results, clock, watch, save)
    watch.sample("start")
    watch.start()
    previous, interrupted = signal.signal(signal.SIGTERM, _terminate), None
    try:
        measure(args, size, work, clock, results, progress, logs, setup)
    except OutOfBudget as error:
        stops.append(f"{progress.current}: {error}")
    except subprocess.TimeoutExpired as error:  # a stage's child ran past the time left
        stops.append(f"{progress.current}: stopped by the budget after {error.timeout:.0f} s")
    except (Terminated, KeyboardInterrupt) as error:
        interrupted = error
        stops.append(f"{progress.current}: stopped by {'SIGTERM' if isinstance(error, Terminated) else 'Ctrl-C'}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        watch.stop()
        save()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    say(clock, f"wrote {args.output / 'gpu.json'}" + (f"; incomplete: {len(results['incomplete'])} items"
                                                      if results["incomplete"] else ""))
    if isinstance(interrupted, Terminated):
        raise Stopped(signal.SIGTERM, f"SIGTERM: what was finished is in {args.output / 'gpu.json'}")
    if interrupted is not None:
        raise interrupted
    return 3 if results["incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
