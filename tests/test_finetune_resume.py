"""Kill/resume: a run killed with SIGKILL (or stopped by SIGTERM or Ctrl-C) and resumed reproduces the per-step losses
of an uninterrupted run (<= 1e-5). Runs the real CLI in subprocesses."""


import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _finetune_helpers import read_log, text_dir, tiny_model  # noqa: F401

STEPS = 60


def _cmd(model, data, out, cache, *extra):
    return [sys.executable, "-m", "pose_mlx.finetune", "--model", str(model), "--target", "4x", "--data", str(data),
            "--output", str(out), "--cache-dir", str(cache), "--window", "16", "--steps", str(STEPS),
            "--lr", "3e-3", "--warmup", "5", "--save-every", "7", "--batch-size", "2", "--lora-layers", "1",
            "--no-progress", *extra]


def _wait_for_steps(proc, log, n, timeout=60.0):
    """Wait until the run has logged >= n steps (and has written at least one checkpoint)."""
    start = time.time()
    state = log.parent / "checkpoint" / "state.json"
    while time.time() - start < timeout:
        if proc.poll() is not None:
            pytest.fail(f"run ended early with code {proc.returncode}: {proc.stderr.read()}")
        if log.exists() and state.exists() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.01)
    pytest.fail("run did not progress")


@pytest.fixture(scope="module")
def reference(tiny_model, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    subprocess.run(_cmd(tiny_model, text_dir, out, out.parent / "cache"), check=True, capture_output=True)
    return [r["loss"] for r in read_log(out / "train_log.jsonl")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_run_resumes_with_identical_losses(reference, tiny_model, text_dir, tmp_path, sig):
    out = tmp_path / "out"
    log = tmp_path / "out.partial" / "log.jsonl"
    proc = subprocess.Popen(_cmd(tiny_model, text_dir, out, tmp_path / "cache"), stderr=subprocess.PIPE, text=True)
    _wait_for_steps(proc, log, 10)
    os.kill(proc.pid, sig)
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    killed_at = len(read_log(log))
    assert 10 <= killed_at < STEPS, "the kill did not land mid-run"
    if sig != signal.SIGKILL:  # SIGTERM / Ctrl-C (SIGINT): save the step it finished, then exit 128 + signum
        assert code == 128 + sig and "--resume" in err and "Traceback" not in err
        saved = json.loads((tmp_path / "out.partial" / "checkpoint" / "state.json").read_text())["step"]
        assert saved == killed_at
    else:
        assert code == -signal.SIGKILL
    assert not out.exists()
    done = subprocess.run(_cmd(tiny_model, text_dir, out, tmp_path / "cache", "--resume"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in log], reference, atol=1e-5, rtol=0)
    assert not (tmp_path / "out.partial").exists()
