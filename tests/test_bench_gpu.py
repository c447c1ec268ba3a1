"""benchmarks.bench_gpu: its dry run end to end (every stage on a tiny llama, as a subprocess) writes the JSON the
GPU run writes, with sane numbers; its pytest-output and --help parsers against hand-written outputs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_gpu, common

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, "-m", "benchmarks.bench_gpu"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "gpu.json"
    proc = subprocess.run([*SCRIPT, "--dry-run", "--output", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_dry_run_writes_the_schema_with_sane_numbers(dry_run):
    result, stdout = dry_run
    assert result["benchmark"] == "gpu" and result["dry_run"] is True
    for key in ("date", "mlx_version", "mlx_lm_version", "python", "platform"):  # common.write_results' record
        assert result[key]
    assert isinstance(result["device"], str) and result["device"]
    assert result["mlx"] == result["mlx_version"]

    tests = result["tests"]
    for key in ("passed", "failed", "skipped"):
        assert type(tests[key]) is int and tests[key] >= 0
    assert tests["complete"] and tests["passed"] + tests["failed"] + tests["skipped"] > 0
    assert tests["exit_code"] == (1 if tests["failed"] else 0)

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
    # each timed run: tokens/s is (window - 1) over its median seconds per update
    timed = [r for r in result["runs"] if "s_per_update" in r]
    assert sorted(r["label"] for r in timed) == ["default", "default", "mlx_lm", "mlx_lm", "rows +1", "rows +1",
                                                 "rows off", "rows off"]  # finetune has --align-rows
    alignment = result["alignment"]
    assert alignment["flag_off"] == ["--align-rows", "off"]
    assert alignment["ratio"] == pytest.approx(alignment["default_tokens_per_s"] / alignment["off_tokens_per_s"])
    for r in timed:
        assert r["tokens_per_s"] == pytest.approx((r["window"] - 1) / r["s_per_update"])
    assert not [r for r in result["runs"] if "error" in r]
    # progress per stage, in order
    stages = [line for line in stdout.splitlines() if line.startswith("[")]
    order = ["model:", "tests:", "data:", "plan ", "tests: waiting", "pose_mlx eager, checkpointing",
             "pose_mlx default", "mlx_lm lora", "pose_mlx rows +1", "pose_mlx compiled, no checkpointing", "wrote"]
    assert [next(i for i, line in enumerate(stages) if s in line) for s in order] == sorted(
        next(i for i, line in enumerate(stages) if s in line) for s in order)


def test_dry_run_refuses_the_committed_path():
    committed = ROOT / "benchmarks" / "results" / "gpu" / "gpu.json"
    before = committed.read_bytes() if committed.exists() else None
    proc = subprocess.run([*SCRIPT, "--dry-run", "--output", str(committed)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not write" in proc.stderr
    assert (committed.read_bytes() if committed.exists() else None) == before


def test_pytest_summary_and_progress_are_counted():
    parse = bench_gpu.parse_pytest
    out = parse("....s.F\n[gw0] ...\nFAILED tests/test_x.py::test_y - assert 1 == 2\n"
                "1 failed, 5 passed, 1 skipped, 2 warnings in 3.21s\n")
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (5, 1, 1, 0)
    out = parse("= 2 failed, 40 passed, 3 skipped, 1 error in 12.00s =")
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (40, 2, 3, 1)
    # stopped before its summary: the -q progress characters, one per test
    out = parse("bringing up nodes...\n..s..F.......E    [ 20%]\n....ss")
    assert out["summary"] is None
    assert (out["passed"], out["failed"], out["skipped"], out["errors"]) == (15, 1, 3, 1)


def test_alignment_flag_is_found_in_help_text():
    off = bench_gpu.align_off
    assert off("--content CONTENT  PoSE content offsets: uniform, zero, aligned (v_i = u_i)") is None
    assert off("  --align-rows, --no-align-rows\n      pad rows to a multiple of 128") == ["--no-align-rows"]
    assert off("  --row-align ROW_ALIGN  multiple of 128 on CUDA") == ["--row-align", "off"]


def test_a_run_past_its_timeout_is_stopped():
    """common.run_tool, which bench_gpu and bench_vs_mlx_lm run every training child with."""
    from types import SimpleNamespace

    with pytest.raises(TimeoutError, match="stopped after 1 s"):
        common.run_tool([sys.executable, "-c", "import time; time.sleep(60)"], "pose_mlx", SimpleNamespace(threads=0),
                        timeout=1)
