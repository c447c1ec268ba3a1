"""`--sampler plain`, the fair control for PoSE: ordinary fine-tuning (contiguous positions 0 .. window - 1, the
original RoPE frequencies while training) and the schedule applied only at export."""


import json

import mlx.core as mx
import numpy as np
import pytest

from _finetune_helpers import ORIGINAL, text_dir, tiny_model  # noqa: F401
from pose_mlx.finetune import main
from pose_mlx.model.export import rope_response
from pose_mlx.model.patch import extend, find_rope_modules, reschedule
from pose_mlx.model.source import load as pose_load
from pose_mlx.rope import rope_inv_freq, scaled_inv_freq
from pose_mlx.training.positions import sample_example


def test_plain_positions_are_contiguous_and_its_window_anywhere_in_the_document():
    """Positions 0 .. window - 1 always; with uniform content the window starts anywhere in 0 .. Lx - Lc (both
    ends reached over many draws); with zero content at the document's start."""
    rng = np.random.default_rng(0)
    starts = set()
    for _ in range(400):
        ex = sample_example(40, 32, 256, "plain", rng=rng)
        np.testing.assert_array_equal(ex.position_ids, np.arange(32))
        (start, length), = ex.spans
        assert length == 32 and 0 <= start <= 8
        np.testing.assert_array_equal(ex.token_index(), np.arange(start, start + 32))
        starts.add(start)
    assert starts == set(range(9))
    assert sample_example(40, 32, 256, "plain", content="zero", rng=1).spans == [(0, 32)]


def test_reschedule_gives_the_frequencies_extend_gives(tiny_model):
    """A model patched with the original frequencies and then rescheduled to YaRN rotates exactly like one
    extended with YaRN directly (angle per position and attention factor, every layer)."""
    trained, _ = pose_load(tiny_model, apply_schedule=False)
    direct, _ = pose_load(tiny_model, apply_schedule=False)
    extend(trained, "none", ORIGINAL, 8 * ORIGINAL)
    record = reschedule(trained, "yarn", ORIGINAL, 8 * ORIGINAL, beta_fast=16.0)
    reference = extend(direct, "yarn", ORIGINAL, 8 * ORIGINAL, beta_fast=16.0)
    assert record.schedule == "yarn" and record.params == {"beta_fast": 16.0}
    assert [layer.inv_freq for layer in record.layers] == [layer.inv_freq for layer in reference.layers]
    ours, theirs = dict(find_rope_modules(trained)), dict(find_rope_modules(direct))
    for layer in record.layers:
        for got, want in zip(rope_response(ours[layer.path], layer.dims, layer.traditional),
                             rope_response(theirs[layer.path], layer.dims, layer.traditional)):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="schedule 'none'"):
        reschedule(direct, "linear", ORIGINAL, 8 * ORIGINAL)


def test_plain_run_trains_at_original_frequencies_and_exports_the_schedule(tiny_model, text_dir, tmp_path,
                                                                           capsys, monkeypatch):
    """The training stage (eager, so the positions can be read) sees unscaled frequencies (theta_i = base^(-2i/d))
    and positions 0 .. 14 in every row (16-token windows: 15 inputs);
    the exported folder carries YaRN at 8x and its weights equal the LoRA-trained ones."""
    import pose_mlx.training.stage as stage

    seen = {}
    real = stage.fine_tune

    def spy(model, tokenizer, plan, at_positions):
        layers = model.pose_extension.layers
        seen["schedule"] = model.pose_extension.schedule
        seen["unscaled"] = all(np.allclose(layer.inv_freq, rope_inv_freq(layer.dims, layer.base), rtol=1e-7)
                               for layer in layers)

        def recording(m, ids):
            seen.setdefault("positions", []).append(np.array(ids))
            return at_positions(m, ids)
        return real(model, tokenizer, plan, recording)

    monkeypatch.setattr(stage, "fine_tune", spy)
    out = tmp_path / "adapt"
    code = main(["--model", str(tiny_model), "--target", "8x", "--schedule", "yarn", "--sampler", "plain",
                 "--data", str(text_dir), "--output", str(out), "--cache-dir", str(tmp_path / "cache"),
                 "--window", "16", "--steps", "3", "--lr", "1e-3", "--warmup", "1", "--no-progress", "--no-compile"])
    assert code == 0, capsys.readouterr().err
    assert seen["schedule"] == "none" and seen["unscaled"]
    assert seen["positions"] and all((np.asarray(p) == np.arange(15)).all() for p in seen["positions"])
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 8.0
    record = json.loads((out / "pose_mlx.json").read_text())
    assert record["sampler"] == "plain" and record["steps"] == 3 and record["mlx_lm_exact"] is True
    model, _ = pose_load(out)
    head_dim = 8
    want, _ = scaled_inv_freq("yarn", head_dim, 500.0, 8.0, ORIGINAL)
    np.testing.assert_allclose(model.pose_extension.layers[0].inv_freq, want, rtol=1e-6)
    assert not np.allclose(want, rope_inv_freq(head_dim, 500.0))
    base = mx.load(str(tiny_model / "model.safetensors"))
    trained = mx.load(str(out / "model.safetensors"))
    assert any(not np.array_equal(np.array(trained[k]), np.array(base[k])) for k in base)  # LoRA fused in


def test_a_plain_run_exported_unextended_is_extended_at_load(tiny_model, text_dir, tmp_path, capsys):
    """`--sampler plain --schedule none` exports the adapted model with its original RoPE; the evaluators'
    `--schedule dynamic --target 8x` extends it at load (from the recorded original window), and a folder
    exported with a real schedule still refuses a second one."""
    from pose_mlx.errors import UserError
    from pose_mlx.eval.longctx import load_eval_model

    out = tmp_path / "adapt"
    code = main(["--model", str(tiny_model), "--target", "8x", "--schedule", "none", "--sampler", "plain",
                 "--data", str(text_dir), "--output", str(out), "--cache-dir", str(tmp_path / "cache"),
                 "--window", "16", "--steps", "2", "--lr", "1e-3", "--warmup", "1", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    loaded = load_eval_model(str(out), "dynamic", "8x")
    assert (loaded.original, loaded.maximum) == (ORIGINAL, 8 * ORIGINAL)
    assert loaded.model.pose_extension.schedule == "dynamic" and "plain fine-tuning" in loaded.schedule
    as_saved = load_eval_model(str(out))
    assert as_saved.model.pose_extension.schedule == "none"
    yarn = tmp_path / "adapt-yarn"
    assert main(["--model", str(tiny_model), "--target", "8x", "--schedule", "yarn", "--sampler", "none",
                 "--output", str(yarn)]) == 0
    with pytest.raises(UserError, match="already extended"):
        load_eval_model(str(yarn), "dynamic", "8x")
