"""Position-id RoPE and mlx-lm patching: eq. (1) at arbitrary positions, every family, gradients, dynamic NTK."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import grad_checkpoint

from pose_mlx import extend, use_positions
from pose_mlx.errors import UserError
from pose_mlx.model.patch import PositionRoPE, ScalingReplaced, find_rope_modules, save_extension
from pose_mlx.training.positions import pose_position_ids

from conftest import FAMILY_CONFIGS, VOCAB, build_model

TOL = 1e-4


def tokens(length, batch=2, seed=1):
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)))


def rope_eq1(x, positions, inv_freq, traditional, dims):
    """NumPy RoPE, PoSE paper eq. (1): pair i of token t is rotated by positions[t] * theta_i.

    x: (B, H, L, D); pairs are (2i, 2i+1) when traditional, else (i, i + dims/2); dims < D leaves the rest.
    """
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    half = dims // 2
    for t, p in enumerate(positions):
        for i in range(half):
            a_idx, b_idx = (2 * i, 2 * i + 1) if traditional else (i, i + half)
            c, s = np.cos(p * inv_freq[i]), np.sin(p * inv_freq[i])
            a, b = x[:, :, t, a_idx], x[:, :, t, b_idx]
            out[:, :, t, a_idx] = a * c - b * s
            out[:, :, t, b_idx] = a * s + b * c
    return out


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [16, 8])
def test_pose_positions_match_numpy_eq1(traditional, dims):
    rng = np.random.default_rng(0)
    inv_freq = 50.0 ** (-np.arange(0, dims, 2) / dims)
    rope = PositionRoPE(dims, inv_freq, traditional)
    x = rng.standard_normal((2, 3, 12, 16)).astype(np.float32)
    positions = pose_position_ids(12, 96, chunks=3, rng=np.random.default_rng(5))
    assert np.any(np.diff(positions) > 1), "the sample should contain a skip"
    with use_positions(_Wrap(rope), positions):
        got = np.array(rope(mx.array(x)))
    np.testing.assert_allclose(got, rope_eq1(x, positions, inv_freq, traditional, dims), atol=2e-5)


class _Wrap(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.rope = rope


def test_fast_path_equals_explicit_contiguous_positions():
    inv_freq = 10000.0 ** (-np.arange(0, 32, 2) / 32) / 4
    rope = PositionRoPE(32, inv_freq, False, attention_factor=1.3)
    x = mx.random.normal((1, 2, 10, 32))
    fast = rope(x, offset=7)
    with use_positions(_Wrap(rope), np.arange(7, 17)):
        explicit = rope(x)
    np.testing.assert_allclose(np.array(fast), np.array(explicit), atol=1e-5)
    # the attention factor multiplies the rotated features (both q and k go through the layer)
    plain = PositionRoPE(32, inv_freq, False)(x, offset=7)
    np.testing.assert_allclose(np.array(fast), 1.3 * np.array(plain), atol=1e-5)


def test_batched_positions_rotate_each_row_by_its_own_ids():
    inv_freq = 100.0 ** (-np.arange(0, 8, 2) / 8)
    rope = PositionRoPE(8, inv_freq, False)
    x = np.random.default_rng(2).standard_normal((2, 1, 6, 8)).astype(np.float32)
    ids = np.stack([pose_position_ids(6, 40, rng=np.random.default_rng(s)) for s in (1, 2)])
    with use_positions(_Wrap(rope), ids):
        got = np.array(rope(mx.array(x)))
    for row in range(2):
        want = rope_eq1(x[row : row + 1], ids[row], inv_freq, False, 8)
        np.testing.assert_allclose(got[row : row + 1], want, atol=2e-5)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_family_none_schedule_is_unchanged_and_relative(family):
    model = build_model(family)
    x = tokens(20)
    ref = model(x)
    n_ropes = len(find_rope_modules(model))
    extend(model, "none", 64, 256)
    assert n_ropes == len(model.pose_extension.layers) >= 2
    assert all(isinstance(m, PositionRoPE) for _, m in find_rope_modules(model))
    # (i) no positions set -> the unpatched logits
    np.testing.assert_allclose(np.array(model(x)), np.array(ref), atol=TOL)
    # explicit contiguous positions take the cos/sin path: same logits (layout, partial dims are right)
    with use_positions(model, np.arange(20)):
        np.testing.assert_allclose(np.array(model(x)), np.array(ref), atol=TOL)
    # (ii) shifting every position by a constant leaves the logits unchanged
    with use_positions(model, np.arange(20) + 37):
        np.testing.assert_allclose(np.array(model(x)), np.array(ref), atol=TOL)
    # and a skip inside the window does change them
    skipped = np.concatenate([np.arange(10), np.arange(10) + 50])
    with use_positions(model, skipped):
        assert np.abs(np.array(model(x)) - np.array(ref)).max() > 1e-3
    # positions were cleared on leaving the block: the fast path is back
    np.testing.assert_allclose(np.array(model(x)), np.array(ref), atol=TOL)


def test_positions_are_not_parameters(tiny_llama):
    before = {k for k, _ in tree_flatten(tiny_llama.parameters())}
    extend(tiny_llama, "linear", 64, 512)
    with use_positions(tiny_llama, np.arange(8)):
        after = {k for k, _ in tree_flatten(tiny_llama.trainable_parameters())}
    assert after == before


def test_model_without_rope_gets_clear_error():
    config = dict(n_ctx=64, n_embd=32, n_head=4, n_layer=2, n_positions=64, layer_norm_epsilon=1e-5, vocab_size=VOCAB)
    model = build_model("gpt2", **config)
    with pytest.raises(UserError, match="no RoPE"):
        extend(model, "linear", 64, 256)


def test_use_positions_requires_extended_model(tiny_llama):
    with pytest.raises(ValueError, match="extend"):
        with use_positions(tiny_llama, np.arange(4)):
            pass


def test_bad_position_shapes(tiny_llama):
    extend(tiny_llama, "linear", 64, 256)
    with pytest.raises(ValueError, match="position_ids"):
        with use_positions(tiny_llama, np.zeros((1, 2, 3), dtype=np.int64)):
            pass
    with pytest.raises(ValueError, match="position ids cover"):
        with use_positions(tiny_llama, np.arange(5)):
            tiny_llama(tokens(6))


def loss_fn(model, x):
    logits = model(x[:, :-1])
    return nn.losses.cross_entropy(logits, x[:, 1:]).mean()


def test_gradients_with_checkpointing_match_and_use_positions(monkeypatch):
    x = tokens(24, seed=3)
    positions = pose_position_ids(23, 200, chunks=2, rng=np.random.default_rng(1))
    grads = {}
    for name in ("plain", "checkpoint"):
        model = build_model("llama", seed=4)
        extend(model, "linear", 32, 256)
        if name == "checkpoint":
            layer_cls = type(model.layers[0])
            monkeypatch.setattr(layer_cls, "__call__", layer_cls.__call__)  # undone after the test
            grad_checkpoint(model.layers[0])  # patches the class: every layer is checkpointed
        with use_positions(model, positions):
            loss, g = nn.value_and_grad(model, loss_fn)(model, x)
        mx.eval(loss, g)
        grads[name] = dict(tree_flatten(g))
    for key, value in grads["plain"].items():
        np.testing.assert_allclose(np.array(grads["checkpoint"][key]), np.array(value), atol=1e-5, err_msg=key)
    monkeypatch.undo()
    # the positions reached the gradient: contiguous positions give a different one
    model = build_model("llama", seed=4)
    extend(model, "linear", 32, 256)
    _, g_contig = nn.value_and_grad(model, loss_fn)(model, x)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(np.array(dict(tree_flatten(g_contig))[key]) - np.array(grads["plain"][key])).max() > 1e-6


def test_yarn_matches_mlx_lm_yarn():
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    reference = build_model("llama", seed=2, rope_scaling=scaling)
    model = build_model("llama", seed=2)
    extend(model, "yarn", 32, 128)
    x = tokens(100)
    ref = np.array(reference(x))
    np.testing.assert_allclose(np.array(model(x)), ref, atol=TOL)
    with use_positions(model, np.arange(100)):
        np.testing.assert_allclose(np.array(model(x)), ref, atol=TOL)


def test_existing_scaling_is_replaced_with_warning():
    model = build_model("llama", rope_scaling={"type": "linear", "factor": 2.0})
    assert find_rope_modules(model)[0][1].scale == 0.5
    with pytest.warns(ScalingReplaced, match="already applies a RoPE scaling .*replaced by 'linear'"):
        extend(model, "linear", 64, 512)
    rope = find_rope_modules(model)[0][1]
    theta = 500.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(np.array(rope._inv_freq), theta / 8, rtol=1e-6)


def test_cannot_extend_twice(tiny_llama):
    extend(tiny_llama, "linear", 64, 256)
    with pytest.raises(UserError, match="already extended"):
        extend(tiny_llama, "linear", 64, 512)


def test_dynamic_ntk_fast_path_matches_mlx_lm():
    scaling = {"type": "dynamic", "factor": 4.0}
    reference = build_model("llama", seed=6, rope_scaling=scaling, max_position_embeddings=32)
    model = build_model("llama", seed=6)
    extend(model, "dynamic", 32, 128)
    for length in (20, 90):
        x = tokens(length)
        np.testing.assert_allclose(np.array(model(x)), np.array(reference(x)), atol=TOL)


def test_save_extension_then_load_reapplies_schedule(tmp_path, tiny_llama):
    """A schedule mlx-lm cannot express (wavelength-blend YaRN) survives export through pose_mlx.json."""
    import json

    from mlx_lm.utils import load_model, save_model

    from pose_mlx.model.patch import apply_saved_extension

    extend(tiny_llama, "yarn", 64, 512, blend="wavelength")
    save_model(tmp_path, tiny_llama)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **FAMILY_CONFIGS["llama"]}))
    save_extension(tiny_llama, tmp_path, steps=0)
    record = json.loads((tmp_path / "pose_mlx.json").read_text())
    assert record["schedule"]["schedule"] == "yarn" and record["schedule"]["params"] == {"blend": "wavelength"}
    assert record["steps"] == 0
    reloaded, _ = load_model(tmp_path)
    x = tokens(100)
    assert np.abs(np.array(reloaded(x)) - np.array(tiny_llama(x))).max() > 1e-3  # plain config: unscaled
    apply_saved_extension(reloaded, tmp_path / "pose_mlx.json")
    np.testing.assert_allclose(np.array(reloaded(x)), np.array(tiny_llama(x)), atol=TOL)
