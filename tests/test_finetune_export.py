"""Export: plain `mlx_lm.load(output)` reproduces the extended in-memory model (<= 1e-4) beyond the original
window for every schedule mlx-lm can express; the others round-trip through `pose_mlx.load`."""

import pose_mlx  # noqa: F401  (fast BLAS before mlx)

import json
import math
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from _finetune_helpers import tiny_model  # noqa: F401
from pose_mlx.export import export_model
from pose_mlx.patch import extend, load as pose_load

ORIG, TARGET = 32, 256
HEAD_DIM = 8  # tiny_model: hidden 32 / 4 heads
SEQ = list(range(5, 5 + 3 * ORIG))  # 96 tokens, 3x the original window

EXACT = {  # test id -> (schedule, parameters)
    "none": ("none", {}),
    "linear": ("linear", {}),
    "ntk": ("ntk", {}),
    "abf": ("abf", {"beta": 40.0}),
    "yarn": ("yarn", {}),
    "yarn-params": ("yarn", {"beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.3}),
    "llama3": ("llama3", {}),
    "llama3-params": ("llama3", {"low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    "longrope": ("longrope", {"long_factor": [1.0, 2.0, 4.0, 8.0]}),
}
INEXACT = {"yarn-wavelength": ("yarn", {"blend": "wavelength"}), "dprope": ("dprope", {}), "dynamic": ("dynamic", {})}


def _logits(model, ids=SEQ):
    return np.array(model(mx.array([ids])).astype(mx.float32))


def _extended(tiny_model, schedule, params):
    model, _ = load(str(tiny_model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, schedule, ORIG, TARGET, **params)
    return model


def _export(model, tiny_model, out):
    config = json.loads((tiny_model / "config.json").read_text())
    return export_model(model, config, tiny_model, out, record={"steps": 0})


@pytest.mark.parametrize("name", sorted(EXACT))
def test_mlx_lm_load_reproduces_schedule(tiny_model, tmp_path, name):
    schedule, params = EXACT[name]
    model = _extended(tiny_model, schedule, params)
    info = _export(model, tiny_model, tmp_path / "out")
    assert info["mlx_lm_exact"] is True
    loaded, _ = load(str(tmp_path / "out"))
    expected = _logits(model)
    np.testing.assert_allclose(_logits(loaded), expected, atol=1e-4, rtol=0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["max_position_embeddings"] == TARGET
    if config.get("rope_scaling"):
        assert config["rope_scaling"]["original_max_position_embeddings"] == ORIG
    record = json.loads((tmp_path / "out" / "pose_mlx.json").read_text())
    assert record["schedule"]["method"] == schedule and record["steps"] == 0


def test_ntk_and_abf_export_as_rope_theta(tiny_model, tmp_path):
    """Static NTK: theta' = b * s^(d/(d-2)) (d = head dim); ABF (paper 001): theta' = beta * b; no rope_scaling."""
    base = json.loads((tiny_model / "config.json").read_text())["rope_theta"]
    _export(_extended(tiny_model, "ntk", {}), tiny_model, tmp_path / "ntk")
    config = json.loads((tmp_path / "ntk" / "config.json").read_text())
    s = TARGET / ORIG
    assert math.isclose(config["rope_theta"], base * s ** (HEAD_DIM / (HEAD_DIM - 2)), rel_tol=1e-5)
    assert "rope_scaling" not in config
    _export(_extended(tiny_model, "abf", {"beta": 40.0}), tiny_model, tmp_path / "abf")
    assert math.isclose(json.loads((tmp_path / "abf" / "config.json").read_text())["rope_theta"], 40.0 * base,
                        rel_tol=1e-5)


@pytest.mark.parametrize("name", sorted(INEXACT))
def test_inexpressible_schedules_load_with_pose_mlx(tiny_model, tmp_path, name):
    schedule, params = INEXACT[name]
    model = _extended(tiny_model, schedule, params)
    info = _export(model, tiny_model, tmp_path / "out")
    assert info["mlx_lm_exact"] is False
    reloaded, _ = pose_load(tmp_path / "out")
    np.testing.assert_allclose(_logits(reloaded), _logits(model), atol=1e-4, rtol=0)
    plain, _ = load(str(tmp_path / "out"))
    assert np.abs(_logits(plain) - _logits(model)).max() > 1e-4  # why pose_mlx.load is needed


def test_fused_lora_export_matches_in_memory(tiny_model, tmp_path):
    """LoRA with non-zero B is folded into the weights: mlx_lm.load(output) == the LoRA model in memory."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx.utils import tree_flatten

    model = _extended(tiny_model, "linear", {})
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    rng = np.random.default_rng(0)
    lora_b = [(k, mx.array(rng.normal(scale=0.05, size=v.shape).astype(np.float32)))
              for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")]
    assert lora_b
    model.load_weights(lora_b, strict=False)
    expected = _logits(model)
    _export(model, tiny_model, tmp_path / "out")
    loaded, _ = load(str(tmp_path / "out"))
    base, _ = load(str(tiny_model))
    assert np.abs(_logits(base) - expected).max() > 1e-3  # the adapters matter
    np.testing.assert_allclose(_logits(loaded), expected, atol=1e-4, rtol=0)
