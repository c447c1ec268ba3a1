"""Data-parallel fine-tuning: 2 ranks launched with `mlx.launch` or `python -m pose_mlx.launch` (ring backend, this
machine) with per-rank batch b give the per-step losses of 1 process with batch 2b over the same examples
(<= 1e-4), also across a SIGKILL and --resume of the whole group. Runs the real CLI in subprocesses."""


import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _finetune_helpers import read_log, text_dir, tiny_model  # noqa: F401
from pose_mlx.plan import lock_path
from pose_mlx.training.data import ExampleStream, TokenizedCorpus

STEPS = 12
LAUNCH = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Scripts run from a temporary folder import the pose_mlx of this checkout.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def _args(model, data, out, cache, batch, *extra):
    return ["-m", "pose_mlx.finetune", "--model", str(model), "--target", "4x", "--data", str(data),
            "--output", str(out), "--cache-dir", str(cache), "--window", "16", "--steps", str(STEPS),
            "--lr", "3e-3", "--warmup", "2", "--save-every", "3", "--batch-size", str(batch), "--full",
            "--no-progress", *extra]


#: Process groups started by the running test (each launcher in a session of its own, with its ranks).
LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_orphans():
    """When a test ends, passed or failed, every group it started is killed: ranks of a failed test would
    otherwise spin in the ring backend for the rest of the suite."""
    yield
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _start(command):
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=ENV)
    LAUNCHED.append(proc)
    return proc


def _launch(args, launcher="mlx.launch"):
    if launcher == "pose_mlx.launch":
        return _start([sys.executable, "-m", "pose_mlx.launch", "-n", "2", "--", sys.executable, *args])
    return _start([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, *args])


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
    with pytest.raises(ValueError, match=r"^rank must be in \[0, world=2\), got 2$"):
        ExampleStream(corpus, 12, 48, rank=2, world=2)


@pytest.fixture(scope="module")
def reference(tiny_model, text_dir, tmp_path_factory):
    """Losses of one process with batch 2."""
    out = tmp_path_factory.mktemp("single") / "out"
    subprocess.run([sys.executable, *_args(tiny_model, text_dir, out, out.parent / "cache", 2)], check=True,
                   capture_output=True, env=ENV)
    return [r["loss"] for r in read_log(out / "train_log.jsonl")]


@pytest.mark.parametrize("launcher", ["mlx.launch", "pose_mlx.launch"])
def test_two_ranks_match_one_process_with_twice_the_batch(reference, tiny_model, text_dir, tmp_path, launcher):
    if launcher == "mlx.launch" and LAUNCH is None:
        pytest.skip("mlx.launch is not installed")
    out = tmp_path / "out"
    proc = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1), launcher)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert all(r["tokens"] == 2 * 15 for r in log)  # both ranks' target tokens
    np.testing.assert_allclose([r["loss"] for r in log], reference, atol=1e-4, rtol=0)
    assert stderr.count("wrote ") == 1  # only rank 0 exports
    assert (out / "model.safetensors").is_file() and not (tmp_path / "out.partial").exists()


def _wait_until_released(lock, timeout=30):
    """Until no process holds the flock of `lock` (the kernel drops it once its holder has exited)."""
    import fcntl

    start = time.time()
    while lock.exists():
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.time() - start < timeout, f"{lock} is still held {timeout} s after the kill"
        time.sleep(0.01)


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
    _wait_until_released(lock_path(out))  # the ranks, not waited for, may still be exiting
    killed_at = len(read_log(log))
    assert 5 <= killed_at < 40 and not out.exists(), "the kill did not land mid-run"
    done = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1, *steps, "--resume"))
    stdout, stderr = done.communicate(timeout=180)
    assert done.returncode == 0, stderr
    assert (out / "train_log.jsonl").is_file(), (killed_at, stdout[-3000:], stderr[-3000:])
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
                          capture_output=True, text=True, env=ENV)
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
    state = json.loads((tmp_path / "out.partial" / "checkpoint" / "state.json").read_text())
    assert state["step"] == len(read_log(log)) < 400


def test_ctrl_c_under_pose_mlx_launch_saves_once_and_resumes(tiny_model, text_dir, tmp_path):
    """Ctrl-C in a terminal (SIGINT to the launcher's process group): the launcher waits, both ranks stop at the same
    step, rank 0 saves and alone prints "stopped:", the launcher exits with 130; `--resume` under the launcher then
    finishes the run (to a raised --steps) and exports."""
    out = tmp_path / "out"
    log = tmp_path / "out.partial" / "log.jsonl"
    proc = _launch(_args(tiny_model, text_dir, out, tmp_path / "cache", 1, "--steps", "400"), "pose_mlx.launch")
    start = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() - start < 120, "the group did not progress"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.count("stopped: interrupted by SIGINT") == 1, stderr
    saved = json.loads((tmp_path / "out.partial" / "checkpoint" / "state.json").read_text())["step"]
    assert saved == len(read_log(log)) < 400 and not out.exists()
    done = _launch(["-m", "pose_mlx.finetune", "--resume", "--output", str(out), "--steps", str(saved + 2),
                    "--no-progress"], "pose_mlx.launch")
    _, stderr = done.communicate(timeout=180)
    assert done.returncode == 0, stderr
    assert [r["step"] for r in read_log(out / "train_log.jsonl")] == list(range(1, saved + 3))
    assert (out / "model.safetensors").is_file()


def test_pose_mlx_launch_stops_the_group_when_a_rank_fails(tmp_path):
    """A rank that exits with an error while the other waits forever: after --grace seconds the other is
    terminated, and the launcher exits with the failed rank's code."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['MLX_RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(600)\n")
    start = time.time()
    proc = _start([sys.executable, "-m", "pose_mlx.launch", "-n", "2", "--grace", "1", "--", sys.executable,
                   str(script)])
    proc.communicate(timeout=60)
    assert proc.returncode == 3 and time.time() - start < 30


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")
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
    lines = _run_ranks(script)
    # (3 * [2, 4] + 1 * [10, 0]) / 4 = [4, 3] on both ranks; the plain mean of the ranks would be [6, 2]
    assert lines == ["rank 0 4.000000 3.000000 4.0", "rank 1 4.000000 3.000000 4.0"]


def _run_ranks(script, *args, ranks=2):
    """stdout lines starting with "rank " of `script` run by `ranks` processes (mlx.launch ring), sorted."""
    command = [sys.executable, str(script), *map(str, args)]
    if ranks > 1:
        command = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--", *command]
    proc = _start(command)
    stdout, stderr = proc.communicate(timeout=180)
    # the launcher relays both ranks into one pipe: a line of one rank may arrive glued to the other's
    lines = sorted(part.splitlines()[0] for part in re.split(r"(?=rank \d+ )", stdout) if part.startswith("rank "))
    assert len(lines) == ranks, stdout + stderr
    return lines


FLAT_SCRIPT = """
import json, pose_mlx, mlx.core as mx, numpy as np
from mlx.utils import tree_flatten
from pose_mlx.training.distributed import flat_all_sum, init

world = init()
r = world.rank
tree = {"w": mx.array(np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1) - 5.5),
        "blocks": [mx.array([1.5, -2.0, 3.25, 0.5, 8.0], dtype=mx.bfloat16) * (2 * r + 1),
                   mx.array(np.full((2, 2, 2), 0.25 + r, dtype=np.float16)),
                   mx.array(7.0 - 3 * r)],
        "ids": mx.array([1, 2, 3], dtype=mx.int32) * (r + 2)}
count = mx.array([3.0, 1.0][r])
leaves = [x for _, x in tree_flatten(tree)]
out = {
    "flat": [(str(x.dtype), np.array(x.astype(mx.float32)).tolist()) for _, x in tree_flatten(world.all_sum(tree))],
    "per_parameter": [np.array(mx.distributed.all_sum(x).astype(mx.float32)).tolist() for x in leaves],
    "buckets": [np.array(x.astype(mx.float32)).tolist() for x in flat_all_sum(leaves, world.group, limit=5)],
    "mean": [(str(x.dtype), np.array(x.astype(mx.float32)).tolist())
             for _, x in tree_flatten(world.weighted_mean({k: v for k, v in tree.items() if k != "ids"}, count))],
    "mean_per_parameter": [np.array((mx.distributed.all_sum(x.astype(mx.float32) * count) / mx.distributed.all_sum(count))).tolist()
                           for x in leaves[:-1]],
    "inputs": [np.array(x.astype(mx.float32)).tolist() for x in leaves],
}
print(f"rank {r} " + json.dumps(out))
"""


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")
def test_flattened_all_reduce_equals_per_parameter(tmp_path):
    """One flattened all-reduce of a tree of mixed shapes and dtypes (float32, bfloat16, float16, a scalar, int32)
    gives what an all_sum per parameter gives, leaf dtypes kept, also cut in buckets of 5 elements; the token-weighted
    mean over 2 ranks with 3 and 1 tokens is (3 x_0 + x_1) / 4 per leaf, computed here in float64 from both ranks'
    inputs."""
    script = tmp_path / "flat.py"
    script.write_text(FLAT_SCRIPT)
    lines = _run_ranks(script)
    results = [json.loads(line.split(" ", 2)[2]) for line in lines]
    assert results[0]["flat"] == results[1]["flat"] and results[0]["mean"] == results[1]["mean"]
    ours = results[0]
    assert [dtype for dtype, _ in ours["flat"]] == ["mlx.core.float32", "mlx.core.bfloat16", "mlx.core.float16",
                                                     "mlx.core.float32", "mlx.core.int32"]
    for (_, flat), per_parameter, bucketed in zip(ours["flat"], ours["per_parameter"], ours["buckets"]):
        np.testing.assert_array_equal(np.array(flat), np.array(per_parameter))  # these sums are exact in every dtype
        np.testing.assert_array_equal(np.array(bucketed), np.array(per_parameter))
    inputs = [[np.array(x, dtype=np.float64) for x in r["inputs"]] for r in results]
    tolerance = {"mlx.core.bfloat16": 1e-2, "mlx.core.float16": 1e-3, "mlx.core.float32": 1e-6}
    assert len(ours["mean"]) == 4
    for (dtype, mean), old, x0, x1 in zip(ours["mean"], ours["mean_per_parameter"], *inputs):
        expected = (3 * x0 + 1 * x1) / 4
        np.testing.assert_allclose(np.array(mean), expected, rtol=tolerance[dtype], atol=0)
        np.testing.assert_allclose(np.array(mean), np.array(old), rtol=tolerance[dtype], atol=0)
    plain = (inputs[0][0] + inputs[1][0]) / 2  # the unweighted mean differs: the weighting is really applied
    assert np.abs(np.array(ours["mean"][0][1]) - plain).max() > 1


STOP_SCRIPT = """
import os, signal, sys
import numpy as np
import pose_mlx
from pose_mlx import extend, use_positions
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config
from pose_mlx.training.checkpoint import read_state
from pose_mlx.training.data import ExampleStream, TokenizedCorpus
from pose_mlx.training.distributed import init
from pose_mlx.training.loop import Interrupted, TrainConfig, train

world = init()
signal_at, steps, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tokens = np.random.default_rng(0).integers(3, 64, size=4 * 200).astype(np.int32)
corpus = TokenizedCorpus(tokens, np.arange(5, dtype=np.int64) * 200, np.arange(4), "t", {})


class Stream:
    \"\"\"This rank's batches; the last rank sends itself SIGTERM while drawing batch `signal_at` (inside an update).\"\"\"

    def __init__(self):
        self.inner = ExampleStream(corpus, 16, 64, batch_size=1, seed=0, rank=world.rank, world=world.size)

    def __iter__(self):
        for drawn, batch in enumerate(self.inner, 1):
            if drawn == signal_at and world.rank == world.size - 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


model = build_model(model_config(64, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=16), seed=0)
extend(model, "linear", 16, 64)
model.unfreeze()
config = TrainConfig(steps=steps, lr=1e-3, warmup=0, progress=False)
try:
    train(model, Stream(), config, run_dir, use_positions, world=world)
    outcome = "finished"
except Interrupted as stopped:
    outcome = f"interrupted {stopped.step}"
saved = read_state(os.path.join(run_dir, "checkpoint"))["step"] if world.is_main else None
print(f"rank {world.rank} {outcome} saved {saved}")
"""


@pytest.mark.parametrize("ranks, signal_at, expected", [
    (1, 2, "interrupted 2"),  # one process sees its signal at once
    (2, 2, "interrupted 3"),  # the flag travels with the next update's all-reduce: both ranks stop after it
    (2, 5, "interrupted 5"),  # a signal during the last update is caught by the check after the loop
    (2, 0, "finished"),
])
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, ranks, signal_at, expected):
    """SIGTERM reaches only the last rank, inside update `signal_at` of 5: every rank raises Interrupted at the
    same step, rank 0 has saved the checkpoint of that step."""
    if ranks > 1 and LAUNCH is None:
        pytest.skip("mlx.launch is not installed")
    script = tmp_path / "stop.py"
    script.write_text(STOP_SCRIPT)
    (tmp_path / "run").mkdir()
    lines = _run_ranks(script, signal_at, 5, tmp_path / "run", ranks=ranks)
    step = expected.split()[-1] if expected != "finished" else "5"
    assert lines == [f"rank 0 {expected} saved {step}"] + [f"rank {r} {expected} saved None" for r in range(1, ranks)]
