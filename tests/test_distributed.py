"""Data-parallel fine-tuning: 2 ranks launched with `mlx.launch` (ring backend, this machine) with per-rank batch b
give the per-step losses of 1 process with batch 2b over the same examples (<= 1e-4), also across a SIGKILL and
--resume of the whole group. Runs the real CLI in subprocesses."""


import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _finetune_helpers import read_log, text_dir, tiny_model  # noqa: F401
from pose_mlx.training.data import ExampleStream, TokenizedCorpus

STEPS = 12
LAUNCH = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")


def _args(model, data, out, cache, batch, *extra):
    return ["-m", "pose_mlx.finetune", "--model", str(model), "--target", "4x", "--data", str(data),
            "--output", str(out), "--cache-dir", str(cache), "--window", "16", "--steps", str(STEPS),
            "--lr", "3e-3", "--warmup", "2", "--save-every", "3", "--batch-size", str(batch), "--full",
            "--no-progress", *extra]


def _launch(args, **popen):
    return subprocess.Popen([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)


def _corpus(lengths):
    tokens = np.arange(sum(lengths), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedCorpus(tokens, offsets, np.arange(len(lengths)), "test", {})


def test_shards_together_are_the_single_stream():
    corpus = _corpus([40, 55, 70, 90])
    single = ExampleStream(corpus, 12, 48, batch_size=6, seed=5)
    shards = [ExampleStream(corpus, 12, 48, batch_size=2, seed=5, rank=r, world=3) for r in range(3)]
    for _ in range(4):
        whole = single.next_batch()
        parts = [s.next_batch() for s in shards]
        for name in ("inputs", "targets", "positions", "mask", "docs"):
            np.testing.assert_array_equal(np.concatenate([getattr(p, name) for p in parts]), getattr(whole, name))
    assert all(s.state_dict()["rng"] == single.state_dict()["rng"] for s in shards)
    with pytest.raises(ValueError, match="rank"):
        ExampleStream(corpus, 12, 48, rank=2, world=2)


@pytest.fixture(scope="module")
def reference(tiny_model, text_dir, tmp_path_factory):
    """Losses of one process with batch 2."""
    out = tmp_path_factory.mktemp("single") / "out"
    subprocess.run([sys.executable, *_args(tiny_model, text_dir, out, out.parent / "cache", 2)], check=True,
                   capture_output=True)
    return [r["loss"] for r in read_log(out / "train_log.jsonl")]


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")
def test_two_ranks_match_one_process_with_twice_the_batch(reference, tiny_model, text_dir, tmp_path):
    out = tmp_path / "out"
    proc = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1))
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert all(r["tokens"] == 2 * 15 for r in log)  # both ranks' target tokens
    np.testing.assert_allclose([r["loss"] for r in log], reference, atol=1e-4, rtol=0)
    assert stderr.count("wrote ") == 1  # only rank 0 exports
    assert (out / "model.safetensors").is_file() and not (tmp_path / "out.partial").exists()


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")
def test_group_killed_and_resumed_keeps_the_losses(tiny_model, text_dir, tmp_path):
    """SIGKILL of the launcher and both ranks mid-run, then --resume by a new group: the losses of an
    uninterrupted 2-rank run of the same length (<= 1e-5; longer runs drift from the 1-process run by float
    summation order, which is why the 1-process comparison above is kept short)."""
    steps = ["--steps", "40"]
    whole = _launch(_args(tiny_model, text_dir, tmp_path / "whole", tmp_path / "cache", 1, *steps))
    _, stderr = whole.communicate(timeout=180)
    assert whole.returncode == 0, stderr
    out = tmp_path / "out"
    log = tmp_path / "out.partial" / "log.jsonl"
    state = tmp_path / "out.partial" / "checkpoint" / "state.json"
    proc = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1, *steps))
    start = time.time()
    while not (state.exists() and log.exists() and len(log.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() - start < 120, "the group did not progress"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
    proc.wait(timeout=30)
    killed_at = len(read_log(log))
    assert 5 <= killed_at < 40 and not out.exists(), "the kill did not land mid-run"
    done = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1, *steps, "--resume"))
    _, stderr = done.communicate(timeout=180)
    assert done.returncode == 0, stderr
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 41))
    np.testing.assert_allclose([r["loss"] for r in log],
                               [r["loss"] for r in read_log(tmp_path / "whole" / "train_log.jsonl")], atol=1e-5, rtol=0)


def test_resume_with_another_world_size_is_refused(tiny_model, text_dir, tmp_path):
    """A run started by 2 ranks cannot be resumed by 1 process (its batches would differ)."""
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    from pose_mlx.settings import parse_invocation, save_run_file

    settings = parse_invocation(_args(tiny_model, text_dir, out, tmp_path / "cache", 1)[2:]).settings
    save_run_file(settings, partial, world_size=2)
    code = subprocess.run([sys.executable, *_args(tiny_model, text_dir, out, tmp_path / "cache", 1, "--resume")],
                          capture_output=True, text=True)
    assert code.returncode == 2 and "had 2 ranks" in code.stderr and "Traceback" not in code.stderr



@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to find the ranks")
def test_stopped_ranks_report_once(tiny_model, text_dir, tmp_path):
    """SIGTERM to both ranks (as a cluster scheduler sends it): every rank stops at the same step, rank 0 saves
    the checkpoint and alone prints the "stopped:" line, and no rank is cut short by the launcher (which
    terminates the group as soon as one rank exits with an error)."""
    out = tmp_path / "out"
    log = tmp_path / "out.partial" / "log.jsonl"
    proc = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1, "--steps", "400"))
    start = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() - start < 120, "the group did not progress"
        time.sleep(0.01)
    group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ranks = [int(pid) for pid in group if int(pid) != proc.pid]
    assert len(ranks) == 2, group
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert not out.exists()
    assert stderr.count("stopped: interrupted by SIGTERM") == 1, stderr
    state = __import__("json").loads((tmp_path / "out.partial" / "checkpoint" / "state.json").read_text())
    assert state["step"] == len(read_log(log)) < 400


def test_weighted_mean_with_unequal_counts(tmp_path):
    """Two ranks holding 3 and 1 target tokens: sum_r n_r x_r / sum_r n_r, not the plain mean of the ranks."""
    script = tmp_path / "mean.py"
    script.write_text(
        "import pose_mlx, mlx.core as mx\n"
        "from pose_mlx.training.distributed import init\n"
        "world = init()\n"
        "count = mx.array([3.0, 1.0][world.rank])\n"
        "value = {'a': mx.array([[2.0, 4.0], [10.0, 0.0]][world.rank])}\n"
        "mean = world.weighted_mean(value, count)['a'].tolist()\n"
        "print(f'rank {world.rank} {mean[0]:.6f} {mean[1]:.6f} {world.all_sum(count).item():.1f}')\n")
    proc = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    # (3 * [2, 4] + 1 * [10, 0]) / 4 = [4, 3] on both ranks; the plain mean of the ranks would be [6, 2]
    assert lines == ["rank 0 4.000000 3.000000 4.0", "rank 1 4.000000 3.000000 4.0"], proc.stdout + proc.stderr
