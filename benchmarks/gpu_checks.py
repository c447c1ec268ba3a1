"""What `benchmarks.bench_gpu` measures beside its training runs: whether the card was shared, the card's bf16 matmul
peak and the model-FLOP utilisation, the test suite with its failures named, and the goals.

Sharing: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader` sampled at the start, between
stages and every `CardWatch.every` seconds, each sample split into this benchmark's own process tree (its pid and
every descendant, from /proc's parent links) and the others. `conditions` is "alone: ...", "shared: ..." (another
process held the GPU in some sample) or "unknown: ..." (no nvidia-smi, it failed, or it never listed a process of
this benchmark's while one ran on the GPU: then it cannot see processes, as in some containers).

Model FLOPs of one LoRA update (the FLOP convention; `benchmarks.bench_mfu` gives the full fine-tuning's):

    flops = 4 P T + 6 R T + 12 L H S T

P the base model's parameters (every one, embeddings included, as PaLM's 6 P T counts them), R the LoRA
adapters' parameters, T = batch x (window - 1) target tokens, S = window - 1, L blocks of width H. Per token and
weight a matrix product costs 2 FLOPs forward and 2 for the gradient of its input; only the adapters also get the
2 of a weight gradient (the frozen weights' are never computed), hence 4 P + 6 R where full training has 6 P. The
attention term is PaLM's: scores and weighted sums over the full S x S square, forward and backward, causal
masking not discounted. Gradient checkpointing's recomputed forward is not counted (model FLOPs, not hardware
FLOPs). MFU = flops x updates/s / peak, with the peak = k 2 N^3 / t of k bf16 N x N matmuls evaluated together
(N = 8192 on a GPU), the median of `reps` timings after warm-up, measured in a child alone on the card.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

from benchmarks.common import ROOT, child_env

# ------------------------------------------------------------------------------------------ was the card shared?

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]


def process_tree(root: int) -> set[int]:
    """`root` and every living descendant of it (Linux's /proc parent links; just {root} elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone since the listing
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {root}, [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def parse_compute_apps(text: str) -> list[tuple[int, str]]:
    """(pid, used memory as nvidia-smi wrote it) per line of `--query-compute-apps=pid,used_memory` CSV."""
    apps = []
    for line in text.splitlines():
        pid, _, memory = line.partition(",")
        if pid.strip().isdigit():
            apps.append((int(pid), memory.strip()))
    return apps


class CardWatch:
    """Samples the GPU's compute processes (`QUERY`) now (`sample`) and every `every` seconds in a thread
    (`start` / `stop`), splitting each sample into this process tree's and the others'."""

    def __init__(self, every: float = 10.0, query: list[str] = QUERY, root: int | None = None):
        self.every, self.query, self.root = every, query, os.getpid() if root is None else root
        self.samples: list[dict] = []
        self.error: str | None = None
        self.stage, self.start_time = "start", time.perf_counter()
        self._stop, self._lock, self._thread = threading.Event(), threading.Lock(), None

    def sample(self, stage: str | None = None) -> None:
        """One sample, labelled with `stage` (which becomes the current stage) or the current one."""
        if stage is not None:
            self.stage = stage
        if not shutil.which(self.query[0]):
            self.error = f"no {self.query[0]} on this machine"
            return
        try:
            out = subprocess.run(self.query, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as error:
            self.error = f"{self.query[0]} failed: {error}"
            return
        if out.returncode != 0:
            self.error = f"{self.query[0]} exited {out.returncode}: {' '.join(out.stderr.split())[:200]}"
            return
        own = process_tree(self.root)
        apps = parse_compute_apps(out.stdout)
        with self._lock:
            self.samples.append({"t": round(time.perf_counter() - self.start_time, 1), "stage": self.stage,
                                 "own": [[p, m] for p, m in apps if p in own],
                                 "other": [[p, m] for p, m in apps if p not in own]})

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.every):
                self.sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def conditions(self) -> str:
        """"alone: ...", "shared: ..." or "unknown: ..." (see the module's docstring)."""
        with self._lock:
            samples = list(self.samples)
        if not samples:
            return f"unknown: {self.error or 'no sample of the GPU processes was taken'}"
        shared = [s for s in samples if s["other"]]
        if shared:
            others = sorted({f"pid {p} ({m})" for s in shared for p, m in s["other"]})
            stages = sorted({s["stage"] for s in shared}, key=[s["stage"] for s in samples].index)
            return (f"shared: other processes held the GPU in {len(shared)} of {len(samples)} samples "
                    f"(stages {', '.join(stages)}): {', '.join(others[:8])}" + (" ..." if len(others) > 8 else ""))
        if not any(s["own"] for s in samples):
            return (f"unknown: {self.query[0]} listed no process of this benchmark's in {len(samples)} samples, not "
                    "even while its runs used the GPU: it cannot see the processes here")
        note = f" ({self.error} later)" if self.error else ""
        return f"alone: no other process held the GPU in {len(samples)} samples of {self.query[0]}{note}"


# ------------------------------------------------------------------------------------------ peak and MFU

PEAK_INFO = "BENCH_GPU_PEAK "

#: The child that times k bf16 n x n matmuls evaluated together (one batched product), `reps` times after warm-up.
PEAK = r"""
import json, sys
import pose_mlx
import mlx.core as mx
from benchmarks.common import matmul_times
n, k, reps = map(int, sys.argv[1:4])
times = matmul_times(n, reps, warmup=3, dtype="bfloat16", batch=k)
print("BENCH_GPU_PEAK " + json.dumps({"n": n, "k": k, "times": times, "device": str(mx.default_device())}))
"""


def matmul_peak(n: int, k: int, reps: int, timeout: float | None) -> dict:
    """The card's bf16 matmul peak, measured in a child: TFLOP/s = k 2 n^3 / t, t the median of `reps` timings
    of a @ b (b: k matrices, one batched product) after three warm-up ones."""
    proc = subprocess.run([sys.executable, "-c", PEAK, str(n), str(k), str(reps)], env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PEAK_INFO)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the matmul peak failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    record = json.loads(lines[0][len(PEAK_INFO):])
    record["tflops"] = k * 2 * n**3 / statistics.median(record["times"]) / 1e12
    return record


FLOPS_CONVENTION = ("model_flops_per_update = 4 P T + 6 R T + 12 L H S T: P base parameters (embeddings included), "
                    "R LoRA parameters, T = batch x (window - 1) tokens, S = window - 1, L blocks of width H; the "
                    "frozen weights' weight gradients are not computed and checkpointing's recomputation is not "
                    "counted; MFU = model_flops_per_update x updates/s / the card's bf16 matmul peak")


def lora_flops(parameters: int, lora: int, layers: int, hidden: int, tokens: int, seq: int) -> int:
    """Model FLOPs of one LoRA update: 4 P T + 6 R T + 12 L H S T (the module's docstring)."""
    return 4 * parameters * tokens + 6 * lora * tokens + 12 * layers * hidden * seq * tokens


def mfu(flops_per_update: int | None, tokens_per_update: int, tokens_per_s: float | None,
        peak_tflops: float | None, reasons: list[str]) -> dict:
    """The `mfu` record; every value None where one input is (`reasons` says why)."""
    achieved = (flops_per_update * tokens_per_s / tokens_per_update / 1e12
                if flops_per_update and tokens_per_s else None)
    return {"model_flops_per_update": flops_per_update, "tokens_per_s": tokens_per_s, "achieved_tflops": achieved,
            "peak_bf16_tflops": peak_tflops, "mfu": achieved / peak_tflops if achieved and peak_tflops else None,
            "convention": FLOPS_CONVENTION, **({"not_measured": "; ".join(reasons)} if reasons else {})}


# ------------------------------------------------------------------------------------------ the test suite


def start_tests(paths: list[str], workers: int, log: Path) -> dict:
    """Start pytest on `paths` in a child of its own session (`workers` xdist workers when pytest-xdist is
    installed), verbose so that every test's outcome has a line (its name when it fails, counts when it has to
    be stopped), its output to `log`."""
    workers = workers if workers and importlib.util.find_spec("xdist") else 0
    # -o addopts= : pyproject's own -q; -v: a line per test; -rfE: the failures' and errors' summary lines
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=",
           *(["-n", str(workers)] if workers else []), *paths]
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=handle, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return {"proc": proc, "cmd": cmd, "start": time.perf_counter(), "log": log, "handle": handle}


def stop_tests(tests: dict) -> None:
    """Stop the suite (pytest and its xdist workers: its own session) if it still runs."""
    if tests["proc"].poll() is None:
        os.killpg(tests["proc"].pid, signal.SIGKILL)
    tests["proc"].wait()
    tests["handle"].close()


def finish_tests(tests: dict, timeout: float | None) -> dict:
    """Wait for the suite at most `timeout` seconds (then stop it); its counts and failed tests' names."""
    proc = tests["proc"]
    try:
        proc.wait(timeout=timeout)
        complete = True
    except subprocess.TimeoutExpired:
        complete = False
    stop_tests(tests)
    output = tests["log"].read_text(errors="replace")
    counts = parse_pytest(output)
    return {**counts, "complete": complete and counts["summary"] is not None, "exit_code": proc.returncode,
            "seconds": time.perf_counter() - tests["start"], "command": " ".join(["python", *tests["cmd"][1:]]),
            "log": tests["log"].name}


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_PROGRESS = re.compile(r"^([.FsExX]+)\s*(\[\s*\d+%\])?$")
_OUTCOME = r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
_VERBOSE = (re.compile(rf"^(\S+::.+?) {_OUTCOME}(?: |$)"),  # tests/x.py::test_y[a b] PASSED   [ 5%]
            re.compile(rf"^\[gw\d+\] \[\s*\d+%\] {_OUTCOME} (\S+::.+?)\s*$"))  # [gw0] [  5%] PASSED tests/x.py::test_y
_SHORT = re.compile(r"^(FAILED|ERROR) (\S+::.+?|\S+\.py)(?: - |$)")  # -rfE: FAILED tests/x.py::test_y - assert ...
_KEYS = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}


def parse_pytest(output: str) -> dict:
    """passed / failed / skipped / errors from pytest's last summary line ('3 passed, 1 skipped in 2.0s'); without
    one (a run that was stopped) from its verbose per-test lines, else its `-q` progress characters; and the
    names of the failed and erroring tests (`failed_names`, from both kinds of lines, in order)."""
    lines = output.splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\b(passed|failed|skipped|errors?|no tests ran)\b",
                                                                  line) and re.search(r" in [\d.]+s", line)), None)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    outcomes: dict[str, str] = {}
    names: list[str] = []
    for line in lines:
        line = line.strip()
        for pattern in _VERBOSE:
            m = pattern.match(line)
            if m:
                name, outcome = (m.group(1), m.group(2)) if pattern is _VERBOSE[0] else (m.group(2), m.group(1))
                outcomes[f"{name} {outcome}"] = outcome  # a test's setup error and call may both have lines
                if outcome in ("FAILED", "ERROR") and name not in names:
                    names.append(name)
        m = _SHORT.match(line)
        if m and m.group(2) not in names:
            names.append(m.group(2))
    if summary is not None:
        for number, word in _SUMMARY.findall(summary):
            key = "errors" if word.startswith("error") else word
            if key in counts:
                counts[key] += int(number)
    elif outcomes:
        for outcome in outcomes.values():
            if outcome in _KEYS:
                counts[_KEYS[outcome]] += 1
    else:
        chars = "".join(m.group(1) for m in map(_PROGRESS.match, (line.strip() for line in lines)) if m)
        counts.update(passed=chars.count("."), failed=chars.count("F"), skipped=chars.count("s"),
                      errors=chars.count("E"))
    return {**counts, "failed_names": names, "summary": summary.strip("= ") if summary else None}


# ------------------------------------------------------------------------------------------ the results


def new_results(args, size: dict, lr: str) -> dict:
    """Every key of gpu.json, null (or empty) until measured: a run stopped at any point still has them all."""
    window = size["window"]
    return {
        "device": None, "device_memory_bytes": None, "mlx": None,
        "mlx_packages": {d.metadata["Name"]: d.version for d in metadata.distributions()
                         if (d.metadata["Name"] or "").lower().startswith("mlx")},
        "dry_run": args.dry_run, "conditions": None, "card_samples": [], "incomplete": [],
        "tests": None, "plan": [],
        "throughput": {"pose_mlx": None, "mlx_lm": None, "ratio": None, "tokens_per_update": window - 1, "rounds": 0},
        "row_length": {"windows": [window, window + 1], "input_tokens": [window - 1, window],
                       "tokens_per_s": [None, None], "ratio": None, "alignment": None},
        "alignment": None,
        "first_update_seconds": None, "first_update_seconds_eager": None, "first_update_seconds_warm": None,
        "compile_payback": None,
        "mfu": mfu(None, window - 1, None, None, ["not measured yet"]), "matmul_peak": None,
        "goals": [], "runs": [], "stage_seconds": {}, "total_seconds": None,
        "model": {"parameters": None, "layers": size["layers"], "hidden": size["hidden"], "heads": size["heads"],
                  "intermediate": size["intermediate"], "vocab": size["vocab"], "dtype": size["dtype"],
                  "tie_word_embeddings": False},
        "config": {"window": window, "target": window * size["factor"], "lora_rank": args.lora_rank,
                   "lr": float(lr), "lora_layers": "all", "batch": 1, "steps": size["steps"],
                   "plan_steps": size["plan_steps"], "rounds": size["rounds"], "budget_s": args.budget,
                   "run_s": args.run_seconds, "tests_s": args.tests_seconds, "matmul": list(size["matmul"])},
        "method": ("per update = time between the progress reports of updates n-1 and n (n = 2 .. steps-1) "
                   "stamped by this script, median per run; throughput and row-length ratios = median tokens/s over "
                   "runs of one side / the other's, the runs interleaved; peaks = the largest peak_memory_gb of a "
                   "run's train_log.jsonl; " + FLOPS_CONVENTION),
        "logs": "logs/",
    }


def rates(records: list[dict], label: str) -> list[float]:
    return [r["tokens_per_s"] for r in records if r.get("label") == label and "tokens_per_s" in r]


def ratio_of(a: list[float], b: list[float]) -> dict:
    """Median tokens/s of each side and their ratio a / b (None where a side has no measurement)."""
    ma, mb = (statistics.median(x) if x else None for x in (a, b))
    return {"a": ma, "b": mb, "ratio": ma / mb if ma and mb else None}


def summarize(results: dict, stops: list[str], watch: CardWatch, align: list[str] | None) -> None:
    """The figures derived from the runs, the plan and the peak: throughput, row length, first updates, MFU,
    conditions, what is incomplete and why, and the goals."""
    records, plan = results["runs"], results["plan"]
    throughput = ratio_of(rates(records, "default"), rates(records, "mlx_lm"))
    results["throughput"].update(pose_mlx=throughput["a"], mlx_lm=throughput["b"], ratio=throughput["ratio"],
                                 rounds=len(rates(records, "mlx_lm")))
    rows = ratio_of(rates(records, "rows +1"), rates(records, "rows off" if align else "default"))
    results["row_length"].update(tokens_per_s=[rows["b"], rows["a"]], ratio=rows["ratio"], alignment=(
        "off (" + " ".join(align) + ")" if align else "no alignment flag in pose_mlx.finetune"))
    if align:
        aligned = ratio_of(rates(records, "default"), rates(records, "rows off"))
        results["alignment"] = {"flag_off": list(align), "default_tokens_per_s": aligned["a"],
                                "off_tokens_per_s": aligned["b"], "ratio": aligned["ratio"]}
    first = next((r for r in records if r.get("first_compiled")), {})
    eager = plan[1] if len(plan) > 1 else {}
    warm = [r["first_update_seconds"] for r in records if r.get("label") == "default"
            and "first_update_seconds" in r and r is not first]
    results["first_update_seconds"] = first.get("first_update_seconds")
    results["first_update_seconds_eager"] = eager.get("first_update_seconds")
    results["first_update_seconds_warm"] = statistics.median(warm) if warm else None
    eager_run = next((r for r in records if r.get("label") == "eager, checkpointing"), {})
    results["compile_payback"] = payback(first, eager_run, throughput["a"])
    results["mfu"] = mfu_of(results)
    results["conditions"], results["card_samples"] = watch.conditions(), list(watch.samples)
    derived = [f"{r['label']}: {r['error'].splitlines()[0]}" for r in records
               if r.get("error", "").startswith("skipped:") or "was stopped after" in r.get("error", "")]
    tests = results["tests"]
    if tests is not None and not tests["complete"]:
        derived.append(f"tests: stopped after {tests['seconds']:.0f} s, {tests['passed'] + tests['failed']} run")
    results["incomplete"] = stops + derived
    results["goals"] = goals(results)


def payback(first: dict, eager: dict, compiled_rate: float | None) -> dict | None:
    """What compiling costs and saves: the compiled first update's extra seconds over the eager one, the seconds
    a compiled update saves, and after how many updates it has paid for itself (None: never); None when not
    measured."""
    if "first_update_seconds" not in first or "s_per_update" not in eager or not compiled_rate:
        return None
    extra = max(first["first_update_seconds"] - eager["first_update_seconds"], 0.0)
    saved = eager["s_per_update"] - first["input_tokens"] / compiled_rate
    return {"extra_first_update_s": extra, "saved_s_per_update": saved,
            "updates": extra / saved if saved > 0 else None, "eager_beside_tests": eager.get("beside_tests")}


def mfu_of(results: dict) -> dict:
    """`mfu` at pose_mlx's median tokens/s (compiled, checkpointing) and the measured matmul peak."""
    window, size = results["config"]["window"], results["model"]
    counts = next((p for p in results["plan"] if p.get("parameters")), None)
    rate, peak = results["throughput"]["pose_mlx"], results["matmul_peak"]
    reasons = [why for why, missing in (("no plan with parameter counts", counts is None),
                                        ("pose_mlx's throughput was not measured", rate is None),
                                        ("the matmul peak was not measured", peak is None)) if missing]
    flops = None if counts is None else lora_flops(
        counts["parameters"], counts["trainable_parameters"], size["layers"], size["hidden"], window - 1, window - 1)
    return mfu(flops, window - 1, rate, peak and peak["tflops"], reasons)


# ------------------------------------------------------------------------------------------ the goals

#: The goals the GPU check is held to (the issue's numbers).
THROUGHPUT_RATIO, PLAN_TOLERANCE, FIRST_UPDATE_SECONDS, MFU_TARGET = 1.3, 0.10, 30.0, 0.40


def goals(results: dict) -> list[dict]:
    """Each goal with its value, target and whether it held (None: not measured). The plan goal counts the
    configurations predicted to fit the device (the others are not run)."""
    ratio = results["throughput"]["ratio"]
    runnable = [p for p in results["plan"] if p.get("fits_device")]
    measured = [abs(p["error"]) for p in runnable if p.get("error") is not None]
    tests = results["tests"] or {}
    failing = tests["failed"] + tests["errors"] if tests else None
    first, cost = results["first_update_seconds"], results["compile_payback"]
    share = results["mfu"]["mfu"]
    return [
        {"goal": "pose_mlx tokens/s / mlx_lm lora's", "value": ratio, "target": f">= {THROUGHPUT_RATIO}",
         "held": None if ratio is None else ratio >= THROUGHPUT_RATIO},
        {"goal": "every plan within +-10% of the measured peak", "value": max(measured, default=None),
         "target": f"|measured / predicted - 1| <= {PLAN_TOLERANCE} for each configuration that fits the device",
         "held": None if not runnable or len(measured) < len(runnable) else max(measured) <= PLAN_TOLERANCE,
         "measured": f"{len(measured)} of {len(runnable)}"},
        {"goal": "no failing test", "value": failing, "target": "0 failed and 0 errors over the whole suite",
         "held": None if not tests.get("complete") else failing == 0, "failed_names": tests.get("failed_names", [])},
        {"goal": "first compiled update", "value": first,
         "target": f"<= {FIRST_UPDATE_SECONDS} s (or --no-compile by default where compiling does not pay back)",
         "held": None if first is None else first <= FIRST_UPDATE_SECONDS,
         "compile_payback_updates": cost and cost["updates"]},
        {"goal": "model FLOP utilisation (7B-shaped LoRA run)", "value": share, "target": f">= {MFU_TARGET}",
         "held": None if share is None else share >= MFU_TARGET},
    ]
