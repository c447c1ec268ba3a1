"""Bad input to the fine-tuning CLI: one `error:` line, exit code 2, no traceback, nothing half-written."""


import json

import pytest

from _finetune_helpers import ORIGINAL, read_log, text_dir, tiny_model, with_config  # noqa: F401
from pose_mlx import toy
from pose_mlx.model.source import build_model
from pose_mlx.finetune import main

FAST = ["--window", "16", "--steps", "3", "--lr", "1e-3", "--warmup", "1", "--no-progress"]


def fails(capsys, *argv, match: str) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("pose_mlx.finetune: error:")]
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert match in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("target, match", [(str(ORIGINAL), "must be larger"), ("16", "must be larger"),
                                           ("32q", "is not a length"), ("1x", "must be larger"),
                                           ("1000000000000", "outside"), ("8.5", "whole number")])
def test_bad_target(tiny_model, tmp_path, capsys, target, match):
    fails(capsys, "--model", tiny_model, "--target", target, "--sampler", "none", "--output", tmp_path / "o",
          match=match)
    assert not (tmp_path / "o").exists()


def test_unknown_alias_and_missing_folder(tmp_path, capsys):
    fails(capsys, "--model", "llama-99b", "--target", "8x", match="not a known alias")
    fails(capsys, "--model", tmp_path / "nowhere", "--target", "8x", match="no such folder or file")
    (tmp_path / "empty").mkdir()
    fails(capsys, "--model", tmp_path / "empty", "--target", "8x", match="no config.json")


def test_hub_unreachable_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fails(capsys, "--model", "nobody-here/no-model", "--target", "8x", match="Hugging Face hub")


def test_model_without_rope(tiny_model, tmp_path, capsys):
    """gpt2 uses learned absolute positions: the ValueError from extend is reported as one line."""
    tok = toy.copy_tokenizer(tiny_model, tmp_path / "tok")
    config = {"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "n_positions": 64, "n_ctx": 64,
              "vocab_size": 512, "layer_norm_epsilon": 1e-5}
    folder = toy.save_model_folder(build_model(config, seed=0), config, tok, tmp_path / "gpt2")
    fails(capsys, "--model", folder, "--target", "256", "--original", "64", "--sampler", "none", "--output",
          tmp_path / "o", match="no RoPE")
    assert not (tmp_path / "o").exists()


def test_original_unknown(tiny_model, tmp_path, capsys):
    folder = with_config(tiny_model, tmp_path / "m", max_position_embeddings=None)
    fails(capsys, "--model", folder, "--target", "8x", match="--original")
    # with the flag it works
    assert main([f"--model={folder}", "--target=8x", "--original=32", "--sampler=none",
                 f"--output={tmp_path / 'o'}"]) == 0


def test_existing_output_left_untouched(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out, *FAST,
          match="exists")
    # --overwrite never removes a folder pose_mlx did not write
    fails(capsys, "--model", tiny_model, "--target", "4x", "--sampler", "none", "--output", out, "--overwrite",
          match="not written by pose_mlx")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # a folder this project wrote is replaced by --overwrite
    ours = tmp_path / "ours"
    assert main([f"--model={tiny_model}", "--target=4x", "--sampler=none", f"--output={ours}"]) == 0
    assert main([f"--model={tiny_model}", "--target=8x", "--sampler=none", f"--output={ours}", "--overwrite"]) == 0
    assert json.loads((ours / "pose_mlx.json").read_text())["target"] == 8 * ORIGINAL


def test_no_long_enough_document(tiny_model, text_dir, tmp_path, capsys):
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", tmp_path / "o",
          "--cache-dir", tmp_path / "c", "--min-length", "10000000", *FAST, match="10000000")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_nothing_readable(tiny_model, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"")
    (data / "b.txt").write_bytes(bytes(range(256)) * 10)
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", data, "--output", tmp_path / "o",
          "--cache-dir", tmp_path / "c", *FAST, match="no readable document (0 files read, skipped 1 empty, 1 binary")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_non_finite_loss_stops_and_keeps_checkpoint(tiny_model, text_dir, tmp_path, capsys):
    """lr 1e30 makes a loss or gradient inf/NaN: the error names that step; the last checkpoint kept holds only
    finite weights; the log stays valid JSON (non-finite numbers as null)."""
    import math

    import mlx.core as mx
    import numpy as np

    out = tmp_path / "o"
    line = fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                 "--cache-dir", tmp_path / "c", "--save-every", "1", "--window", "16", "--steps", "5",
                 "--lr", "1e30", "--warmup", "0", "--no-progress", match="not finite")
    lines = (out.with_name("o.partial") / "log.jsonl").read_text().splitlines()
    log = [json.loads(x) for x in lines]  # strict JSON: no bare NaN
    bad_step = log[-1]["step"]
    assert f"step {bad_step}" in line and any(v is None for v in log[-1].values())
    assert all(math.isfinite(r["loss"]) for r in log[:-1])
    state = json.loads((tmp_path / "o.partial" / "checkpoint" / "state.json").read_text())
    assert state["step"] < bad_step and f"checkpoint (step {state['step']})" in line
    weights = mx.load(str(tmp_path / "o.partial" / "checkpoint" / state["files"]["weights"]))
    assert all(np.isfinite(np.array(w)).all() for w in weights.values())
    assert not out.exists()


def test_resume_without_partial_and_partial_without_resume(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "o"
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out, "--resume",
          *FAST, match="no unfinished run")
    (tmp_path / "o.partial").mkdir()
    (tmp_path / "o.partial" / "run.json").write_text("{}")
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
          *FAST, match="--resume")


def test_warnings_double_scaling_and_factor(tiny_model, tmp_path, capsys):
    """The plan's warning lines say it; `extend`'s Python warning (ScalingReplaced) is silenced during the run
    only: the process's warning filters are the same afterwards."""
    import warnings as py_warnings

    from pose_mlx.model.patch import ScalingReplaced

    folder = with_config(tiny_model, tmp_path / "m", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with py_warnings.catch_warnings(record=True) as caught:
        py_warnings.simplefilter("always")
        filters = list(py_warnings.filters)
        code = main([f"--model={folder}", "--target=8x", "--original=32", "--sampler=none",
                     f"--output={tmp_path / 'o'}", "--schedule-param", "factor=4"])
        assert py_warnings.filters == filters
    assert not [w for w in caught if issubclass(w.category, ScalingReplaced)]
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert any("rope_scaling" in w and "replaced" in w for w in warnings)
    assert any("factor 4" in w and "8" in w for w in warnings)


def test_resume_with_changed_settings_is_refused(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out, "--cache-dir",
            tmp_path / "c", "--save-every", "1", "--window", "16", "--steps", "2", "--lr", "1e30", "--warmup", "0",
            "--no-progress"]
    assert main([str(a) for a in args]) == 2  # stops at a non-finite loss, leaving a resumable run
    capsys.readouterr()
    args[args.index("--lr") + 1] = "1e-3"
    fails(capsys, *args, "--resume", match="--lr was 1e+30, now 0.001")


@pytest.mark.parametrize("flags, match", [
    (["--steps", "abc"], "--steps"),  # argparse type error: one line too (not the usage block)
    (["--sampler", "bogus"], "--sampler"),
    (["--method", "bogus"], "--sampler"),
    (["--window", "0"], "--window"),  # 0 must not silently mean "the default"
    (["--min-length", "0"], "--min-length"),
    (["--max-grad-norm", "0"], "--max-grad-norm"),  # clipping to 0 would zero every update
    (["--loss-scale", "0.5"], "--loss-scale"),  # a scale below 1 would push float16 gradients further down
    (["--lr", "0"], "--lr"),
    (["--steps", "0"], "--steps"),
    (["--eval-every", "2", "--eval-batches", "0"], "--eval-batches"),
    (["--eval-every", "2", "--heldout", "1.5"], "--heldout"),
    (["--lora-layers", "0"], "--lora-layers"),
    (["--lora-layers", "99"], "--lora-layers"),  # the tiny model has 2 blocks
    (["--schedule", "foo"], "--schedule"),
    (["--schedule", "yarn", "--schedule-param", "beta_fast=0.5"], "beta_fast"),
    (["--seed", "-1"], "--seed"),
    (["--lora-rank", "1e8"], "--lora-rank"),
    (["--lora-rank", "100000000"], "--lora-rank"),
    (["--lora-layers", "-5"], "--lora-layers"),
    (["--min-length", "-5"], "--min-length"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
])
def test_out_of_range_flags(tiny_model, text_dir, tmp_path, capsys, flags, match):
    fails(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", tmp_path / "o",
          "--cache-dir", tmp_path / "c", *FAST, *flags, match=match)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_skipped_files_are_counted(tiny_model, text_dir, tmp_path, capsys):
    """Empty, binary and non-UTF-8 files next to good ones: training runs and one warning counts the unreadable ones
    (an empty file is not unreadable)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(text_dir, data)
    (data / "empty.txt").write_bytes(b"")
    (data / "binary.txt").write_bytes(bytes(range(256)) * 10)
    (data / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 20)
    code = main([str(a) for a in ("--model", tiny_model, "--target", "4x", "--data", data, "--output",
                                  tmp_path / "o", "--cache-dir", tmp_path / "c", *FAST)])
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:") and "skipped" in line]
    assert len(warnings) == 1, err
    assert warnings[0].endswith(": skipped 2 unreadable files or lines (1 binary, 1 not UTF-8)"), warnings[0]
