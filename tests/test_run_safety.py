"""Nothing lost: every way a fine-tuning run could destroy a model, data or a run is refused, with the failure it
prevents reproduced; and a run resumes from its folder alone."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from _finetune_helpers import read_log, text_dir, tiny_model  # noqa: F401
from pose_mlx.finetune import main

FAST = ["--window", "16", "--steps", "3", "--lr", "1e-3", "--warmup", "1", "--no-progress"]


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_quoted_boolean_in_yaml_is_refused_and_the_output_kept(tiny_model, tmp_path, capsys):
    """`overwrite: "false"` is a string, not a boolean: it once read as true and deleted the output."""
    out = tmp_path / "out"
    assert _run(capsys, "--model", tiny_model, "--target", "4x", "--sampler", "none", "--output", out)[0] == 0
    before = _tree(out)
    config = tmp_path / "run.yaml"
    config.write_text(f'model: {tiny_model}\ntarget: 8x\nsampler: none\noutput: {out}\noverwrite: "false"\n')
    code, err = _run(capsys, "--config", config)
    assert code == 2 and "overwrite must be true or false (unquoted)" in _one_error(err)
    assert _tree(out) == before
    config.write_text(f'model: {tiny_model}\ntarget: 8x\nsteps: "10"\ndata: x\n')
    code, err = _run(capsys, "--config", config)
    assert code == 2 and "steps must be a whole number" in _one_error(err)


@pytest.mark.parametrize("where", ["model", "model-parent", "data", "data-parent", "inside-data"])
def test_overwrite_never_touches_the_model_or_the_data(tiny_model, text_dir, tmp_path, capsys, where):
    """--output equal to / containing the model folder, or equal to / containing / inside the data folder, is
    refused even with --overwrite, and nothing of theirs changes."""
    import shutil

    model, data = tmp_path / "models" / "m", tmp_path / "corpus" / "texts"
    shutil.copytree(tiny_model, model)
    shutil.copytree(text_dir, data)
    output = {"model": model, "model-parent": model.parent, "data": data, "data-parent": data.parent,
              "inside-data": data / "extended"}[where]
    before = {"model": _tree(model), "data": _tree(data)}
    code, err = _run(capsys, "--model", model, "--target", "4x", "--data", data, "--output", output, "--overwrite",
                     "--cache-dir", tmp_path / "c", *FAST)
    assert code == 2 and ("is or contains the model" in err or "data" in _one_error(err)), err
    assert {"model": _tree(model), "data": _tree(data)} == before
    assert not (data / "extended").exists()


def test_an_exported_model_inside_the_data_folder_is_not_read_as_data(tiny_model, text_dir, tmp_path, capsys):
    """A folder pose_mlx wrote (it holds pose_mlx.json) under --data is skipped: its train_log.jsonl is no text."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(text_dir, data)
    first = [f"--model={tiny_model}", "--target=4x", f"--data={data}", f"--cache-dir={tmp_path / 'c'}", *FAST]
    assert main(first + [f"--output={tmp_path / 'a'}"]) == 0
    shutil.copytree(tmp_path / "a", data / "previous-run")  # holds train_log.jsonl and pose_mlx.json
    assert main(first + [f"--output={tmp_path / 'b'}"]) == 0, capsys.readouterr().err
    # the same corpus as before the exported folder was copied in: none of its files is read
    assert json.loads((tmp_path / "a" / "pose_mlx.json").read_text())["data_fingerprint"] == \
        json.loads((tmp_path / "b" / "pose_mlx.json").read_text())["data_fingerprint"]


@pytest.mark.parametrize("flags", [["--lr", "1e6"], ["--full", "--lr", "100"]], ids=["lora-1e6", "full-100"])
def test_a_collapsed_model_is_never_exported(tiny_model, text_dir, tmp_path, capsys, flags):
    """Such learning rates once exported a dead model (finite weights, the same logits for every token) with exit
    0; now the run stops with a message and a non-zero exit and nothing is exported."""
    out = tmp_path / "dead"
    code, err = _run(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                     "--cache-dir", tmp_path / "c", "--window", "16", "--steps", "8", "--warmup", "1",
                     "--no-progress", *flags)
    line = _one_error(err)
    assert code == 2 and ("collapsed" in line or "not finite" in line), line
    assert not out.exists()


def test_a_second_run_on_the_same_output_is_refused(tiny_model, tmp_path, capsys):
    """A lock held by a live run (here: this process) stops a second run; it leaves the first one's files alone."""
    from pose_mlx.plan import take_lock

    out = tmp_path / "out"
    held = take_lock(out)
    code, err = _run(capsys, "--model", tiny_model, "--target", "4x", "--sampler", "none", "--output", out)
    assert code == 2 and f"another run (pid {os.getpid()}" in _one_error(err)
    assert held.path.exists() and not out.exists()
    held.release()


def test_a_stale_lock_is_taken_over_with_a_message(tiny_model, tmp_path, capsys):
    """A process holding the lock is SIGKILLed and never reaped (a zombie, which signal 0 still finds, as when
    the launcher of a killed group is gone and nobody reaps its ranks): its lock file does not stop the next run."""
    from pose_mlx.plan import lock_path

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pose_mlx.plan import take_lock; "
                               f"take_lock(__import__('pathlib').Path({str(out)!r})); print(flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE)
    holder.stdout.readline()  # it holds the lock
    holder.kill()
    os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # it has died, and is left unreaped
    os.kill(holder.pid, 0)  # a zombie: still "alive" to a pid check
    code, err = _run(capsys, "--model", tiny_model, "--target", "4x", "--sampler", "none", "--output", out)
    holder.wait()
    assert code == 0, err
    assert "taking over the lock" in err and str(holder.pid) in err
    assert (out / "config.json").is_file() and not lock_path(out).exists()  # released at the end


def _interrupted_run(tiny_model, text_dir, tmp_path, steps=4, save_every=2, lr="1e30"):
    """A run folder left by a run that stopped after a checkpoint (lr 1e30: non-finite after a few steps)."""
    out = tmp_path / "o"
    args = ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out, "--cache-dir",
            tmp_path / "c", "--window", "16", "--steps", str(steps), "--save-every", str(save_every), "--lr", lr,
            "--warmup", "0", "--no-progress"]
    return out, [str(a) for a in args]


def test_resume_needs_only_the_output_folder(tiny_model, text_dir, tmp_path, capsys):
    """`--resume --output DIR` continues from the settings saved in the run folder; --steps may be raised, other
    changes are refused with the old and new values; the summary line reports the run."""
    import signal

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pose_mlx.finetune", "--model", str(tiny_model), "--target", "4x", "--data",
           str(text_dir), "--output", str(out), "--cache-dir", str(tmp_path / "c"), "--window", "16", "--steps",
           "400", "--save-every", "5", "--lr", "1e-3", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "out.partial" / "checkpoint" / "state.json"
    import time

    start = time.time()
    while not state.exists() and time.time() - start < 120:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    saved = json.loads(state.read_text())["step"]
    code, err = _run(capsys, "--resume", "--output", out, "--lr", "2e-3")
    assert code == 2 and "--lr was 0.001, now 0.002" in _one_error(err)
    code, err = _run(capsys, "--resume", "--output", out, "--steps", str(saved + 3))
    assert code == 0, err
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, saved + 4))
    summary = [line for line in err.splitlines() if line.startswith("trained ")]
    assert len(summary) == 1 and f"trained 3 steps ({saved + 1}-{saved + 3})" in summary[0] and str(out) in summary[0]
    assert f"{saved + 3} steps" in summary[0].split(";")[1]  # and the run's total
    assert "final loss" in summary[0] and "peak memory" in summary[0] and "last eval loss none" in summary[0]
    code, err = _run(capsys, "--resume", "--output", out, "--steps", "1")
    assert code == 2 and "already complete" in _one_error(err)


def test_a_flipped_byte_in_the_checkpoint_is_named_on_resume(tiny_model, text_dir, tmp_path, capsys):
    out, args = _interrupted_run(tiny_model, text_dir, tmp_path, steps=3, save_every=1, lr="1e-3")
    args[args.index("--steps") + 1] = "2"
    assert main(args) == 0
    capsys.readouterr()
    # rebuild an unfinished run: a fresh run stopped by a non-finite loss keeps its checkpoints
    out2, args2 = _interrupted_run(tiny_model, text_dir, tmp_path / "second", steps=6, save_every=1)
    (tmp_path / "second").mkdir()
    main(args2)
    capsys.readouterr()
    ckpt = tmp_path / "second" / "o.partial" / "checkpoint"
    state = json.loads((ckpt / "state.json").read_text())
    weights = ckpt / state["files"]["weights"]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x55
    weights.write_bytes(bytes(data))
    code, err = _run(capsys, "--resume", "--output", out2)
    line = _one_error(err)
    assert code == 2 and weights.name in line and "is damaged" in line


def test_a_torn_log_line_does_not_block_resume(tiny_model, text_dir, tmp_path, capsys):
    """A run killed while writing its log leaves half a line; --resume drops it and continues."""
    import signal
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pose_mlx.finetune", "--model", str(tiny_model), "--target", "4x", "--data",
           str(text_dir), "--output", str(out), "--cache-dir", str(tmp_path / "c"), "--window", "16", "--steps",
           "400", "--save-every", "3", "--lr", "1e-3", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "out.partial" / "checkpoint" / "state.json"
    start = time.time()
    while not state.exists() and time.time() - start < 120:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    log = tmp_path / "out.partial" / "log.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 99, "loss": 1.2')  # torn
    saved = json.loads(state.read_text())["step"]
    code, err = _run(capsys, "--resume", "--output", out, "--steps", str(saved + 2))
    assert code == 0, err
    assert [r["step"] for r in read_log(out / "train_log.jsonl")] == list(range(1, saved + 3))


def test_temporary_leftovers_of_a_killed_run_are_removed(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "out"
    export_tmp = tmp_path / ".out.export-999999"
    export_tmp.mkdir()
    (export_tmp / "model.safetensors").write_bytes(b"half")
    old = tmp_path / ".out.old-999999"
    old.mkdir()
    code, err = _run(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                     "--cache-dir", tmp_path / "c", *FAST)
    assert code == 0, err
    assert not export_tmp.exists() and not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


def test_exported_weights_are_finite(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                "--cache-dir", tmp_path / "c", *FAST)[0] == 0
    weights = mx.load(str(out / "model.safetensors"))
    assert all(np.isfinite(np.array(w)).all() for w in weights.values())


@pytest.mark.parametrize("is_main", [True, False])
def test_a_stop_is_said_by_the_rank_that_saved_and_every_rank_waits_before_exiting(capsys, is_main):
    """The training loop's `Interrupted` goes through the one stop handler (`errors.command`): rank 0, which saved
    the checkpoint, prints the one line; every rank then waits at the group's barrier (a launcher ends the group
    as soon as one rank exits with an error, which must not cut that line off); exit code 128 + the signal."""
    import signal

    from pose_mlx.errors import Stopped, command
    from pose_mlx.training.loop import Interrupted

    said_before_barrier = []

    class Group:  # a rank of a two-process group: its barrier records what was printed before it was reached
        size = 2

        def __init__(self):
            self.is_main = is_main

        def barrier(self):
            said_before_barrier.append(capsys.readouterr().err)

    @command("prog")
    def stopped(argv):
        raise Interrupted(signal.SIGTERM, 7, Group())

    assert issubclass(Interrupted, Stopped)
    assert stopped([]) == 128 + signal.SIGTERM
    line = ("prog: stopped: interrupted by SIGTERM; checkpoint saved at step 7; to continue, run the same command with "
            "--resume\n")
    assert said_before_barrier == [line if is_main else ""]
    assert capsys.readouterr().err == ""
