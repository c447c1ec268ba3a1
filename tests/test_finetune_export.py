"""Export: plain `mlx_lm.load(output)` reproduces the extended in-memory model (<= 1e-4) beyond the original
window for every schedule mlx-lm can express (DPRoPE as per-dimension longrope factors); the others round-trip
through `pose_mlx.load`; Gemma-3's two bases survive; transformers reads the configs without complaint."""


import json
import math
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from _finetune_helpers import tiny_model  # noqa: F401
from pose_mlx.model.export import export_model
from pose_mlx.model.source import load as pose_load
from pose_mlx.model.patch import extend

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
    "dprope": ("dprope", {}),
}
INEXACT = {"yarn-wavelength": ("yarn", {"blend": "wavelength"}), "dynamic": ("dynamic", {})}


def _logits(model, ids=SEQ):
    return np.array(model(mx.array([ids])).astype(mx.float32))


def _extended(tiny_model, schedule, params):
    model, _ = load(str(tiny_model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, schedule, ORIG, TARGET, **params)
    return model


def _export(model, tiny_model, out, **options):
    config = json.loads((tiny_model / "config.json").read_text())
    return export_model(model, config, tiny_model, out, record={"steps": 0}, **options)


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
    record = json.loads((tmp_path / "out" / "pose_mlx.json").read_text())
    assert record["schedule"]["schedule"] == schedule and record["steps"] == 0
    assert (record["schedule"]["original"], record["schedule"]["target"]) == (ORIG, TARGET)


def test_ntk_and_abf_export_as_rope_theta(tiny_model, tmp_path):
    """Static NTK: theta' = b * s^(d/(d-2)) (d = head dim); ABF (Xiong et al., arXiv 2309.16039): theta' = beta * b; no rope_scaling."""
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
    reloaded, _ = pose_load(str(tmp_path / "out"))
    np.testing.assert_allclose(_logits(reloaded), _logits(model), atol=1e-4, rtol=0)
    plain, _ = load(str(tmp_path / "out"))
    assert np.abs(_logits(plain) - _logits(model)).max() > 1e-4  # why pose_mlx.load is needed


def test_fused_lora_export_matches_in_memory(tiny_model, tmp_path):
    """LoRA with non-zero B is folded into the weights (the training side's writer, handed to the export):
    mlx_lm.load(output) == the LoRA model in memory."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx.utils import tree_flatten

    from pose_mlx.training.lora import LoraSpec, weights_writer

    model = _extended(tiny_model, "linear", {})
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    rng = np.random.default_rng(0)
    lora_b = [(k, mx.array(rng.normal(scale=0.05, size=v.shape).astype(np.float32)))
              for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")]
    assert lora_b
    model.load_weights(lora_b, strict=False)
    expected = _logits(model)
    _export(model, tiny_model, tmp_path / "out", save_weights=weights_writer(LoraSpec(4, 2.0, 2), fuse=True))
    loaded, _ = load(str(tmp_path / "out"))
    base, _ = load(str(tiny_model))
    assert np.abs(_logits(base) - expected).max() > 1e-3  # the adapters matter
    np.testing.assert_allclose(_logits(loaded), expected, atol=1e-4, rtol=0)


def test_dprope_exports_as_per_dimension_factors(tiny_model, tmp_path):
    """DPRoPE's per-dimension choice is written as longrope factors (1 or s), with no attention scaling."""
    model = _extended(tiny_model, "dprope", {})
    _export(model, tiny_model, tmp_path / "out")
    scaling = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "longrope"
    s = TARGET / ORIG
    chosen = [1.0 if abs(f - 1) < 1e-9 else s for f in scaling["long_factor"]]
    np.testing.assert_allclose(scaling["long_factor"], chosen, rtol=1e-9)
    layer = model.pose_extension.layers[0]
    theta = layer.base ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_allclose(theta / np.array(scaling["long_factor"]), layer.inv_freq, rtol=1e-9)


GEMMA3 = dict(model_type="gemma3_text", hidden_size=32, num_hidden_layers=6, intermediate_size=48,
              num_attention_heads=4, head_dim=8, num_key_value_heads=1, vocab_size=512, sliding_window_pattern=3,
              sliding_window=16, rope_local_base_freq=100.0, rope_theta=1000.0, max_position_embeddings=ORIG,
              rms_norm_eps=1e-6, query_pre_attn_scalar=8)


@pytest.mark.parametrize("schedule", ["ntk", "abf"])
def test_gemma3_mixed_bases_survive_export(tiny_model, tmp_path, schedule):
    """Gemma-3 reads its local layers' base from rope_local_base_freq and its global ones' from rope_theta: both
    are recorded per layer and written back, and mlx_lm.load rebuilds the same model."""
    from mlx_lm.utils import save_model

    from pose_mlx.model.source import build_model

    folder = tmp_path / "gemma3"
    folder.mkdir()
    model = build_model(GEMMA3, seed=3)
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(GEMMA3))
    for f in tiny_model.glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    loaded, _ = load(str(folder))
    record = extend(loaded, schedule, ORIG, TARGET)
    assert {l.config_key for l in record.layers} == {"rope_theta", "rope_local_base_freq"}
    assert {l.base for l in record.layers} == {100.0, 1000.0}
    info = export_model(loaded, GEMMA3, folder, tmp_path / "out", record={"steps": 0})
    assert info["mlx_lm_exact"] is True
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    s, d = TARGET / ORIG, 8
    expected = {"ntk": lambda b: b * s ** (d / (d - 2)), "abf": lambda b: 50.0 * b}[schedule]
    assert math.isclose(config["rope_theta"], expected(1000.0), rel_tol=1e-6)
    assert math.isclose(config["rope_local_base_freq"], expected(100.0), rel_tol=1e-6)
    reloaded, _ = load(str(tmp_path / "out"))
    np.testing.assert_allclose(_logits(reloaded), _logits(loaded), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_transformers_reads_exported_config_without_warnings(tiny_model, tmp_path, name):
    """The exported rope_scaling / rope_theta load in transformers without a warning or an error."""
    import logging

    import transformers

    schedule, params = EXACT[name]
    _export(_extended(tiny_model, schedule, params), tiny_model, tmp_path / "out")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.logging.get_logger()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"))
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING], name
    assert config.max_position_embeddings == TARGET
