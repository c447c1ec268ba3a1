"""Kill/resume: a run killed with SIGKILL (or stopped by SIGTERM or Ctrl-C) and resumed reproduces the per-step losses
of an uninterrupted run (<= 1e-5). Runs the real CLI in subprocesses."""


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


def _tree(folder):
    """{relative path: bytes} of every file under `folder` (and the set of folders, as None)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_resume_acts_on_the_named_copy_not_on_the_folder_in_run_json(tiny_model, text_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """`cp -r run.partial backup.partial; --resume --output backup` resumes the copy and exports `backup`, although
    the copy's run.json names `run`: the original run folder stays byte for byte as it was, `run` never appears,
    and the copy's losses are those of an uninterrupted run (so it was resumed, not restarted)."""
    import pose_mlx.training.loop as loop
    from pose_mlx import finetune

    steps, stop_at = 8, 4

    def argv(out, *extra):
        return ["--model", str(tiny_model), "--target", "4x", "--data", str(text_dir), "--output", str(out),
                "--cache-dir", str(tmp_path / "cache"), "--window", "16", "--steps", str(steps), "--lr", "3e-3",
                "--warmup", "2", "--save-every", "3", "--batch-size", "2", "--lora-layers", "1", "--no-progress",
                *extra]

    assert finetune.main(argv(tmp_path / "reference")) == 0
    reference = [r["loss"] for r in read_log(tmp_path / "reference" / "train_log.jsonl")]

    append = loop.append_log

    def ctrl_c_at_step(log, record):  # Ctrl-C arriving during step `stop_at`: the loop saves it and stops
        append(log, record)
        if record["step"] == stop_at:
            os.kill(os.getpid(), signal.SIGINT)

    run, backup = tmp_path / "run", tmp_path / "backup"
    with monkeypatch.context() as patch:
        patch.setattr(loop, "append_log", ctrl_c_at_step)
        assert finetune.main(argv(run)) == 128 + signal.SIGINT
    capsys.readouterr()
    original = tmp_path / "run.partial"
    assert json.loads((original / "checkpoint" / "state.json").read_text())["step"] == stop_at
    shutil.copytree(original, tmp_path / "backup.partial")
    before = _tree(original)

    assert finetune.main(["--resume", "--output", str(backup)]) == 0, capsys.readouterr().err
    assert _tree(original) == before, "the run folder the copy came from was changed"
    assert not run.exists() and not (tmp_path / ".run.lock").exists()
    assert not (tmp_path / "backup.partial").exists() and (backup / "pose_mlx.json").is_file()
    log = read_log(backup / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["loss"] for r in log], reference, atol=1e-5, rtol=0)
    assert json.loads((backup / "run.json").read_text())["settings"]["output"] == str(backup)


def test_ctrl_c_prints_the_command_that_continues_the_run(tiny_model, text_dir, tmp_path, monkeypatch, capsys):
    """The stop line ends with the exact command line to paste (the output quoted for the shell: here it holds a
    space), and running that command line finishes the run."""
    import shlex

    import pose_mlx.training.loop as loop
    from pose_mlx import finetune

    out = tmp_path / "my run"
    append = loop.append_log

    def ctrl_c_at_step_2(log, record):
        append(log, record)
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "append_log", ctrl_c_at_step_2)
        code = finetune.main(["--model", str(tiny_model), "--target", "4x", "--data", str(text_dir), "--output",
                              str(out), "--cache-dir", str(tmp_path / "cache"), "--window", "16", "--steps", "4",
                              "--lr", "1e-3", "--warmup", "1", "--no-progress"])
    assert code == 128 + signal.SIGINT
    last = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = "pose_mlx.finetune: stopped: interrupted by SIGINT; checkpoint saved at step 2; to continue, run "
    assert last == prefix + f"python -m pose_mlx.finetune --resume --output '{out}'"
    command = shlex.split(last.removeprefix(prefix))
    assert command[:3] == ["python", "-m", "pose_mlx.finetune"]
    assert finetune.main(command[3:]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_log(out / "train_log.jsonl")] == [1, 2, 3, 4]


def test_a_finished_run_trains_longer_with_a_larger_steps(tiny_model, text_dir, tmp_path, monkeypatch, capsys):
    """`--resume --steps 10` on a finished 6-step LoRA run (which said "nothing to resume") continues it from the
    checkpoint its output kept to step 10: the same batches and LR as continuing a 6-step run stopped after its
    last update with --steps 10 (the tested path for a raised --steps: the linear decay of a 10-step run from
    the step reached); the output is replaced by the longer run's."""
    import pose_mlx.training.loop as loop
    from pose_mlx import finetune

    def argv(out, *extra):
        return ["--model", str(tiny_model), "--target", "4x", "--data", str(text_dir), "--output", str(out),
                "--cache-dir", str(tmp_path / "cache"), "--window", "16", "--steps", "6", "--lr", "3e-3",
                "--warmup", "2", "--save-every", "4", "--batch-size", "2", "--lora-layers", "1", "--no-progress",
                *extra]

    done = tmp_path / "done"
    assert finetune.main(argv(done)) == 0
    assert json.loads((done / "checkpoint" / "state.json").read_text())["step"] == 6
    capsys.readouterr()
    assert finetune.main(["--resume", "--output", str(done)]) == 2
    assert capsys.readouterr().err.strip() == (f"pose_mlx.finetune: error: output folder {done} is already complete "
                                               "(6 steps); nothing to resume: pass --steps above 6 with --resume to "
                                               "train it longer")
    assert finetune.main(["--resume", "--output", str(done), "--steps", "10"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "training: 4 updates (7-10) x 30 tokens = 120 tokens on " in out
    # what this invocation trained, then the run's whole (it said "trained 10 steps, 300 tokens")
    assert re.search(r"^trained 4 steps \(7-10\), 120 tokens in \d+ s; 10 steps, 300 tokens in all; final loss ", err,
                     re.MULTILINE), err
    longer = read_log(done / "train_log.jsonl")
    assert [r["step"] for r in longer] == list(range(1, 11))
    assert json.loads((done / "pose_mlx.json").read_text())["steps"] == 10
    assert json.loads((done / "checkpoint" / "state.json").read_text())["step"] == 10
    assert not (tmp_path / "done.partial").exists()

    append = loop.append_log

    def ctrl_c_at_step_6(log, record):  # Ctrl-C during the last update: saved, not exported
        append(log, record)
        if record["step"] == 6:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        patch.setattr(loop, "append_log", ctrl_c_at_step_6)
        assert finetune.main(argv(stopped)) == 128 + signal.SIGINT
    assert finetune.main(["--resume", "--output", str(stopped), "--steps", "10"]) == 0
    reference = read_log(stopped / "train_log.jsonl")
    for key in ("loss", "lr"):
        np.testing.assert_allclose([r[key] for r in longer], [r[key] for r in reference], atol=1e-5, rtol=0)
    schedule = loop.learning_rate_schedule(3e-3, 2, 10)
    assert longer[6]["lr"] == pytest.approx(float(schedule(np.array(6))), rel=1e-5)  # update 7: 3e-3 * 4 / 8


def test_a_finished_run_without_a_checkpoint_says_so(tiny_model, text_dir, tmp_path, capsys):
    """Full fine-tuning keeps no checkpoint in its output (it would hold the weights again and twice their size of
    optimizer state): --resume --steps says there is nothing to continue from."""
    from pose_mlx import finetune

    out = tmp_path / "full"
    assert finetune.main(["--model", str(tiny_model), "--target", "4x", "--data", str(text_dir), "--output",
                          str(out), "--cache-dir", str(tmp_path / "cache"), "--window", "16", "--steps", "2",
                          "--full", "--no-progress"]) == 0
    assert not (out / "checkpoint").exists()
    capsys.readouterr()
    assert finetune.main(["--resume", "--output", str(out), "--steps", "4"]) == 2
    assert capsys.readouterr().err.strip() == (f"pose_mlx.finetune: error: output folder {out} is already complete "
                                               "and kept no checkpoint to train it longer from (only LoRA runs keep "
                                               "theirs); nothing to resume")
