"""benchmarks.bench_gpu and benchmarks.gpu_checks: the dry run end to end (every stage on a tiny llama, as a
subprocess) writes the JSON the GPU run writes, with every key the results format names and numbers that agree with
their definitions recomputed here; a budget too small, and SIGTERM, still leave the JSON of what was finished;
pytest's output (real, from a child) is counted and its failures named; the card watch against fake nvidia-smi
outputs and a real process tree; the goals against hand-made results."""

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_gpu, common, gpu_checks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, "-m", "benchmarks.bench_gpu"]
KEYS = ("device", "mlx", "tests", "plan", "throughput", "first_update_seconds", "mfu", "conditions", "goals",
        "incomplete", "card_samples")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "out"
    proc = subprocess.run([*SCRIPT, "--dry-run", "--output", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), proc.stdout, out


def test_dry_run_writes_the_schema_with_sane_numbers(dry_run):
    result, stdout, out = dry_run
    assert result["benchmark"] == "gpu" and result["dry_run"] is True
    for key in ("date", "mlx_version", "mlx_lm_version", "python", "platform"):  # common.write_results' record
        assert result[key]
    for key in KEYS:
        assert key in result
    assert isinstance(result["device"], str) and result["device"]
    assert result["mlx"] == result["mlx_version"]
    assert result["incomplete"] == []

    tests = result["tests"]
    for key in ("passed", "failed", "skipped"):
        assert type(tests[key]) is int and tests[key] >= 0
    assert tests["complete"] and tests["passed"] + tests["failed"] + tests["skipped"] > 0
    assert tests["exit_code"] == (1 if tests["failed"] else 0) and tests["failed_names"] == []
    assert (out / "logs" / tests["log"]).is_file()

    plan = result["plan"]
    assert [p["config"] for p in plan] == ["compiled, checkpointing", "eager, checkpointing",
                                           "compiled, no checkpointing", "eager, no checkpointing"]
    for entry in plan:  # a tiny llama fits anywhere: every configuration was predicted and measured
        assert type(entry["predicted_bytes"]) is int and entry["predicted_bytes"] > 0
        assert type(entry["measured_bytes"]) is int and entry["measured_bytes"] > 0
        assert entry["error"] == pytest.approx(entry["measured_bytes"] / entry["predicted_bytes"] - 1)
        assert entry["first_update_seconds"] > 0
    # checkpointing keeps less of the forward pass: the planner says so for both modes
    assert plan[0]["predicted_bytes"] < plan[2]["predicted_bytes"]
    assert plan[1]["predicted_bytes"] < plan[3]["predicted_bytes"]

    throughput = result["throughput"]
    assert throughput["rounds"] == 2  # the second round, in reverse order, ran too
    assert throughput["pose_mlx"] > 0 and throughput["mlx_lm"] > 0
    assert throughput["ratio"] == pytest.approx(throughput["pose_mlx"] / throughput["mlx_lm"], rel=1e-12)
    assert throughput["tokens_per_update"] == result["config"]["window"] - 1

    rows = result["row_length"]
    window = result["config"]["window"]
    assert rows["windows"] == [window, window + 1] and rows["input_tokens"] == [window - 1, window]
    assert all(t > 0 for t in rows["tokens_per_s"])
    assert rows["ratio"] == pytest.approx(rows["tokens_per_s"][1] / rows["tokens_per_s"][0], rel=1e-12)

    for key in ("first_update_seconds", "first_update_seconds_eager", "first_update_seconds_warm"):
        assert result[key] > 0 and math.isfinite(result[key])
    assert result["first_update_seconds"] == plan[0]["first_update_seconds"]
    # each timed run: tokens/s is (window - 1) over its median seconds per update; each has its log
    timed = [r for r in result["runs"] if "s_per_update" in r]
    assert sorted(r["label"] for r in timed) == ["compiled, no checkpointing", "default", "default",
                                                 "eager, checkpointing", "eager, no checkpointing", "mlx_lm", "mlx_lm",
                                                 "rows +1", "rows +1", "rows off", "rows off"]
    alignment = result["alignment"]
    assert alignment["flag_off"] == ["--align-rows", "off"]  # finetune has --align-rows
    assert alignment["ratio"] == pytest.approx(alignment["default_tokens_per_s"] / alignment["off_tokens_per_s"])
    for r in timed:
        assert r["tokens_per_s"] == pytest.approx((r["window"] - 1) / r["s_per_update"])
    assert not [r for r in result["runs"] if "error" in r]
    assert all((out / "logs" / r["log"]).is_file() for r in result["runs"])
    # the eager runs fit beside the test suite; nothing after the suite is marked so
    assert [r["label"] for r in result["runs"] if r.get("beside_tests")] == ["eager, checkpointing",
                                                                             "eager, no checkpointing"]
    payback = result["compile_payback"]
    eager = next(r for r in result["runs"] if r["label"] == "eager, checkpointing")
    assert payback["extra_first_update_s"] == pytest.approx(
        max(result["first_update_seconds"] - eager["first_update_seconds"], 0))
    assert payback["saved_s_per_update"] == pytest.approx(eager["s_per_update"] - (window - 1) / throughput["pose_mlx"])
    # progress per stage, in order
    stages = [line for line in stdout.splitlines() if line.startswith("[")]
    order = ["model:", "tests:", "data:", "plan ", "pose_mlx eager, checkpointing", "pose_mlx eager, no checkpointing",
             "tests: waiting", "matmul peak", "pose_mlx default", "mlx_lm lora", "pose_mlx compiled, no checkpointing",
             "pose_mlx rows off", "pose_mlx rows +1", "wrote"]
    assert [next(i for i, line in enumerate(stages) if s in line) for s in order] == sorted(
        next(i for i, line in enumerate(stages) if s in line) for s in order)


def test_dry_run_mfu_conditions_and_goals_follow_their_definitions(dry_run):
    result, _, _ = dry_run
    window, model = result["config"]["window"], result["model"]
    hidden, inter, rank = model["hidden"], model["intermediate"], result["config"]["lora_rank"]
    # LoRA on every linear layer of every block: rank x (in + out) each; q, k, v, o are hidden x hidden here
    lora = model["layers"] * rank * (4 * 2 * hidden + 3 * (hidden + inter))
    assert result["plan"][0]["trainable_parameters"] == lora
    tokens = window - 1
    flops = 4 * model["parameters"] * tokens + 6 * lora * tokens + 12 * model["layers"] * hidden * tokens * tokens
    mfu = result["mfu"]
    assert mfu["model_flops_per_update"] == flops
    assert mfu["tokens_per_s"] == result["throughput"]["pose_mlx"]
    assert mfu["achieved_tflops"] == pytest.approx(flops * mfu["tokens_per_s"] / tokens / 1e12)
    peak = result["matmul_peak"]
    assert mfu["peak_bf16_tflops"] == pytest.approx(peak["k"] * 2 * peak["n"] ** 3 / statistics.median(peak["times"])
                                                    / 1e12)
    assert mfu["mfu"] == pytest.approx(mfu["achieved_tflops"] / mfu["peak_bf16_tflops"])
    assert "4 P T + 6 R T + 12 L H S T" in mfu["convention"]

    assert result["conditions"].startswith(("alone: ", "shared: ", "unknown: "))
    if not gpu_checks.shutil.which("nvidia-smi"):
        assert result["conditions"] == "unknown: no nvidia-smi on this machine" and result["card_samples"] == []

    goals = {g["goal"]: g for g in result["goals"]}
    assert len(goals) == 5
    ratio = goals["pose_mlx tokens/s / mlx_lm lora's"]
    assert ratio["value"] == result["throughput"]["ratio"] and ratio["held"] == (ratio["value"] >= 1.3)
    plan = goals["every plan within +-10% of the measured peak"]
    assert plan["value"] == max(abs(p["error"]) for p in result["plan"])
    assert plan["held"] == (plan["value"] <= 0.10)
    assert goals["no failing test"]["held"] is (result["tests"]["failed"] == 0)
    first = goals["first compiled update"]
    assert first["value"] == result["first_update_seconds"] and first["held"] == (first["value"] <= 30)
    assert goals["model FLOP utilisation (7B-shaped LoRA run)"]["value"] == mfu["mfu"]


def test_dry_run_refuses_the_committed_folder():
    committed = ROOT / "benchmarks" / "results" / "gpu"
    before = sorted((p.name, p.stat().st_mtime) for p in committed.rglob("*")) if committed.exists() else None
    proc = subprocess.run([*SCRIPT, "--dry-run", "--output", str(committed)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not write" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert (sorted((p.name, p.stat().st_mtime) for p in committed.rglob("*")) if committed.exists() else None) == before


def test_a_budget_too_small_stops_and_still_writes_what_was_finished(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run([*SCRIPT, "--dry-run", "--skip-tests", "--budget", "25", "--output", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    for key in KEYS:
        assert key in result
    assert result["config"]["budget_s"] == 25 and result["total_seconds"] < 25 + 10
    assert seconds < 25 + 30  # the probe before the clock's start, the interpreter's start and end
    assert result["incomplete"] and all("left of the budget" in why or "stopped" in why
                                        for why in result["incomplete"])
    skipped = [f"{r['label']}: {r['error']}" for r in result["runs"] if r.get("error", "").startswith("skipped:")]
    assert set(skipped) <= set(result["incomplete"])
    assert result["throughput"]["ratio"] is None or result["throughput"]["rounds"] < 2


def test_sigterm_stops_the_running_child_and_writes_the_json(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen([*SCRIPT, "--dry-run", "--skip-tests", "--output", str(tmp_path / "out"), "--workdir",
                             str(work)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # a training child is running once the first run is announced
        if "pose_mlx eager, checkpointing" in line:
            break
    children, deadline = [], time.monotonic() + 60  # the child starts within seconds; longer on a loaded machine
    while not children and time.monotonic() < deadline:
        time.sleep(0.5)
        children = [p for p in gpu_checks.process_tree(proc.pid) if p != proc.pid]
    assert children
    time.sleep(1)  # into its work
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1].startswith("bench_gpu: stopped: SIGTERM")
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert any("stopped by SIGTERM" in why for why in result["incomplete"])
    assert result["plan"] and result["device"]
    assert not [p for p in children if Path(f"/proc/{p}").exists()]  # no training child left behind


def test_pytest_output_is_counted_and_failures_named(tmp_path):
    """A real pytest child on a file with every outcome, with and without its summary lines."""
    (tmp_path / "test_outcomes.py").write_text(textwrap.dedent("""
        import pytest
        def test_pass(): pass
        def test_fail(): assert 1 == 2
        @pytest.mark.skip(reason="no")
        def test_skip(): pass
        @pytest.fixture
        def broken(): raise RuntimeError("setup")
        def test_error(broken): pass
        @pytest.mark.parametrize("x", ["a b", "c"])
        def test_param(x): pass
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=",
                          "test_outcomes.py"], cwd=tmp_path, capture_output=True, text=True).stdout
    parsed = gpu_checks.parse_pytest(out)
    assert (parsed["passed"], parsed["failed"], parsed["skipped"], parsed["errors"]) == (3, 1, 1, 1)
    assert parsed["failed_names"] == ["test_outcomes.py::test_fail", "test_outcomes.py::test_error"]
    assert parsed["summary"].startswith("1 failed, 3 passed, 1 skipped, 1 error in ")
    # stopped before its summary: from the per-test lines
    cut = gpu_checks.parse_pytest(out[:out.index("test_param[c]")])
    assert cut["summary"] is None and (cut["passed"], cut["failed"], cut["skipped"], cut["errors"]) == (2, 1, 1, 1)
    assert cut["failed_names"] == ["test_outcomes.py::test_fail", "test_outcomes.py::test_error"]


def test_pytest_xdist_and_quiet_outputs_are_counted():
    xdist = ("[gw1] [ 16%] SKIPPED tests/t.py::test_c \n[gw0] [ 33%] PASSED tests/t.py::test_a \n"
             "[gw1] [ 50%] ERROR tests/t.py::test_d \n[gw1] [ 66%] PASSED tests/t.py::test_e[a b] \n"
             "[gw0] [ 83%] FAILED tests/t.py::test_b \n")
    out = gpu_checks.parse_pytest(xdist)
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (2, 1, 1, 1)
    assert out["failed_names"] == ["tests/t.py::test_d", "tests/t.py::test_b"]
    out = gpu_checks.parse_pytest("= 2 failed, 40 passed, 3 skipped, 1 error in 12.00s =\n"
                                  "FAILED tests/test_x.py::test_y - assert 1 == 2\nERROR tests/test_z.py - ImportError")
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (40, 2, 3, 1)
    assert out["failed_names"] == ["tests/test_x.py::test_y", "tests/test_z.py"]
    out = gpu_checks.parse_pytest("bringing up nodes...\n..s..F.......E    [ 20%]\n....ss")  # -q progress
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (15, 1, 3, 1)


def test_process_tree_holds_children_and_grandchildren():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
           "print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        tree = gpu_checks.process_tree(os.getpid())
        below = gpu_checks.process_tree(child.pid)
        assert child.pid in tree and len(below) == 2 and below <= tree
        assert os.getppid() not in tree
    finally:
        for pid in sorted(gpu_checks.process_tree(child.pid), reverse=True):
            os.kill(pid, signal.SIGKILL)
        child.wait()


def _watch(tmp_path, lines: str) -> gpu_checks.CardWatch:
    fake = tmp_path / "fake-smi"
    fake.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    fake.chmod(0o755)
    watch = gpu_checks.CardWatch(query=[str(fake)])
    watch.sample("start")
    watch.sample("runs")
    return watch


def test_card_watch_tells_alone_shared_and_unknown(tmp_path):
    me = os.getpid()
    alone = _watch(tmp_path, f"{me}, 1200 MiB\\n")
    assert alone.conditions().startswith("alone: no other process held the GPU in 2 samples")
    assert alone.samples[0]["own"] == [[me, "1200 MiB"]] and alone.samples[1]["stage"] == "runs"
    shared = _watch(tmp_path, f"{me}, 1200 MiB\\n1, 300 MiB\\n")
    assert shared.conditions() == "shared: other processes held the GPU in 2 of 2 samples (stages start, runs): " \
                                  "pid 1 (300 MiB)"
    blind = _watch(tmp_path, "")  # lists nothing, not even this process: it cannot see processes
    assert blind.conditions().startswith("unknown: ") and "listed no process of this benchmark's" in blind.conditions()
    missing = gpu_checks.CardWatch(query=[str(tmp_path / "no-such-smi")])
    missing.sample("start")
    assert missing.conditions() == f"unknown: no {tmp_path / 'no-such-smi'} on this machine"
    assert gpu_checks.parse_compute_apps("12, 100 MiB\n[N/A], [N/A]\n\n34, 5 MiB") == [(12, "100 MiB"), (34, "5 MiB")]


def _results(**change) -> dict:
    results = {"throughput": {"ratio": 1.4}, "tests": {"failed": 0, "errors": 0, "complete": True, "failed_names": []},
               "plan": [{"fits_device": True, "error": 0.05}, {"fits_device": True, "error": -0.09},
                        {"fits_device": False, "error": None}],
               "first_update_seconds": 12.0, "compile_payback": {"updates": 3.0}, "mfu": {"mfu": 0.41}}
    results.update(change)
    return results


def test_goals_hold_fail_and_wait():
    held = {g["goal"]: g["held"] for g in gpu_checks.goals(_results())}
    assert list(held.values()) == [True, True, True, True, True]  # the config over the device's memory not counted
    failed = gpu_checks.goals(_results(throughput={"ratio": 1.2}, first_update_seconds=31.0, mfu={"mfu": 0.27},
                                       tests={"failed": 1, "errors": 0, "complete": True, "failed_names": ["t::x"]},
                                       plan=[{"fits_device": True, "error": 0.11}]))
    assert [g["held"] for g in failed] == [False, False, False, False, False]
    assert failed[2]["failed_names"] == ["t::x"]
    waiting = gpu_checks.goals(_results(throughput={"ratio": None}, first_update_seconds=None, mfu={"mfu": None},
                                        tests=None, plan=[{"fits_device": True, "error": 0.01},
                                                          {"fits_device": True, "error": None}]))
    assert [g["held"] for g in waiting] == [None] * 5
    incomplete_suite = gpu_checks.goals(_results(tests={"failed": 0, "errors": 0, "complete": False}))
    assert incomplete_suite[2]["held"] is None


def test_alignment_flag_is_found_in_help_text():
    off = bench_gpu.align_off
    assert off("--content CONTENT  PoSE content offsets: uniform, zero, aligned (v_i = u_i)") is None
    assert off("  --align-rows, --no-align-rows\n      pad rows to a multiple of 128") == ["--no-align-rows"]
    assert off("  --row-align ROW_ALIGN  multiple of 128 on CUDA") == ["--row-align", "off"]


def test_clock_allows_the_time_left():
    clock = bench_gpu.Clock(100.0)
    assert clock.allow(30) == 30 and 99 < clock.allow(None) <= 100
    clock.start -= 95
    assert clock.allow(30) == pytest.approx(5, abs=0.5)
    with pytest.raises(bench_gpu.OutOfBudget, match="skipped: 5 s left of the budget"):
        clock.allow(30, need=20)
    assert bench_gpu.Clock(None).allow(30) == 30 and bench_gpu.Clock(None).allow(None) is None


def test_a_run_past_its_timeout_is_stopped(tmp_path):
    """common.run_tool, which bench_gpu and bench_vs_mlx_lm run every training child with: stopped, and logged."""
    log = tmp_path / "run.log"
    with pytest.raises(TimeoutError, match="stopped after 1 s"):
        common.run_tool([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                        "pose_mlx", SimpleNamespace(threads=0), timeout=1, log=log)
    assert "started" in log.read_text() and "exit -9" in log.read_text()


def test_a_run_left_by_an_exception_leaves_no_child(tmp_path):
    """common.run_tool kills its child when a signal's exception (SIGTERM's, Ctrl-C's) interrupts the wait."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            common.run_tool([sys.executable, "-c", code], "pose_mlx", SimpleNamespace(threads=0))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists()
