"""pose_mlx.kernels.layers: RMSNorm and the rotary embedding, on the C++ kernels and on MLX ops, against float64
NumPy, values and gradients; the rotary tables shared by every layer; RMSNorm routed for training."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from pose_mlx import extend, use_positions
from pose_mlx.kernels import layers, route, rows

from conftest import build_model
from test_kernels import _rel, path  # noqa: F401  (the fixture: the C++ kernels, then the MLX-op fallback)


def _norm64(x, w, eps):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, dtype=np.float64)


@pytest.mark.parametrize("shape", [(2, 37, 96), (5, 8), (1, 3, 4, 576)])
def test_rms_norm_and_its_gradients_against_float64(path, shape):
    keys = mx.random.split(mx.random.key(0), 3)
    x, dy = (mx.random.normal(shape, key=key) * 3 for key in keys[:2])
    w = mx.random.normal(shape[-1:], key=keys[2])
    eps = 1e-5
    assert _rel(layers.rms_norm(x, w, eps), _norm64(x, w, eps)) < 1e-6
    _, (dx, dw) = mx.vjp(lambda a, b: layers.rms_norm(a, b, eps), [x, w], [dy])
    # y = x r w with r = (mean(x^2) + eps)^(-1/2): dx = r w dy - x r^3 / N sum(w dy x), dw = sum over rows dy x r
    x64, w64, dy64 = (np.asarray(a, dtype=np.float64) for a in (x, w, dy))
    r = 1 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    want_dx = r * w64 * dy64 - x64 * r ** 3 / shape[-1] * (w64 * dy64 * x64).sum(-1, keepdims=True)
    want_dw = (dy64 * x64 * r).reshape(-1, shape[-1]).sum(0)
    assert _rel(dx, want_dx) < 1e-5 and _rel(dw, want_dw) < 1e-5


def _rotate64(x, cos, sin, dims, traditional, scale):
    """Each pair (a, b) of the first dims features of x (B, H, L, D) -> (s a c - s b s', s a s' + s b c)."""
    x = np.asarray(x, dtype=np.float64)
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    if c.ndim == 3:
        c, s = c[:, None], s[:, None]
    half = dims // 2
    first = np.arange(half) * 2 if traditional else np.arange(half)
    second = first + 1 if traditional else first + half
    out = x.copy()
    a, b = x[..., first] * scale, x[..., second] * scale
    out[..., first], out[..., second] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, per_row", [(16, False), (12, True)])
def test_rotation_and_its_gradient_against_float64(path, traditional, dims, per_row):
    keys = mx.random.split(mx.random.key(2), 3)
    x, dy = (mx.random.normal((2, 3, 11, 16), key=key) for key in keys[:2])
    positions = mx.random.randint(0, 30000, (2, 11) if per_row else (11,), key=keys[2]).astype(mx.float32)
    angles = positions[..., None] * mx.array(10000.0 ** (-np.arange(0, dims, 2) / dims), dtype=mx.float32)
    cos, sin = mx.cos(angles), mx.sin(angles)
    rotate = lambda a: layers.rotate(a, cos, sin, dims, traditional, 1.25)
    assert _rel(rotate(x), _rotate64(x, cos, sin, dims, traditional, 1.25)) < 1e-6
    # a rotation is linear: its gradient is the transposed map, s R(-angle), applied to dy
    (dx,) = mx.vjp(rotate, [x], [dy])[1]
    back = _rotate64(dy, cos, -np.asarray(sin), dims, traditional, 1.25)
    back[..., dims:] = np.asarray(dy)[..., dims:]
    assert _rel(dx, back) < 1e-6


def test_every_layer_rotates_through_the_kernels_with_one_table_of_angles(monkeypatch):
    model = build_model("llama")
    extend(model, "yarn", 64, 256)
    ids = mx.arange(3, 43)
    tokens = mx.zeros((1, 40), dtype=mx.int32)
    holder = model.model.layers[0].self_attn.rope._holder
    tables = []
    real = layers.rotate
    monkeypatch.setattr(layers, "rotate", lambda x, cos, sin, *args: tables.append((cos, sin)) or real(x, cos, sin, *args))
    with use_positions(model, ids):
        mx.eval(model(tokens))
        assert len(tables) == 2 * len(model.model.layers) > 2  # queries and keys of every layer
        assert all(c is tables[0][0] and s is tables[0][1] for c, s in tables)  # one (cos, sin) for all of them
        assert len(holder.tables) == 1
        ((cos, sin),) = holder.tables.values()
        assert cos.shape == sin.shape == (40, model.model.layers[0].self_attn.rope.dims // 2)
    assert holder.tables == {}  # not kept once the positions are no longer set


def test_training_routes_rms_norm_through_the_kernels_and_restores_it(monkeypatch):
    model = build_model("llama")
    norm = model.model.layers[0].input_layernorm
    x = mx.random.normal((2, 5, norm.weight.shape[0]))
    calls = []
    real = layers.rms_norm
    monkeypatch.setattr(layers, "rms_norm", lambda *args: calls.append(1) or real(*args))
    original = nn.RMSNorm.__call__
    with route.training_route(model):
        inside = norm(x)
    assert nn.RMSNorm.__call__ is original
    assert bool(calls) == (rows.native(mx.zeros(1)) is not None)
    assert _rel(inside, mx.fast.rms_norm(x, norm.weight, norm.eps)) < 1e-6
