"""`pose_mlx.kernels.lora`: the LoRA layer in two accumulating products against mlx-lm's LoRA layer, computed
independently from its formula, and the training route that binds it."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear

from pose_mlx.kernels import route
from pose_mlx.kernels.lora import lora_linear
from pose_mlx.training.lora import LoraSpec, add_lora

from conftest import build_model, cpu_only


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _operands(bias: bool, seed: int = 0):
    keys = iter(mx.random.split(mx.random.key(seed), 6))
    x = mx.random.normal((2, 9, 24), key=next(keys))
    weight, a = mx.random.normal((20, 24), key=next(keys)), mx.random.normal((24, 4), key=next(keys))
    b = mx.random.normal((4, 20), key=next(keys))  # non-zero, unlike a fresh adapter: every gradient is exercised
    cot = mx.random.normal((2, 9, 20), key=next(keys))
    return x, weight, a, b, (mx.random.normal((20,), key=next(keys)) if bias else None), cot


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_lora_linear_has_the_value_and_gradients_of_the_lora_formula(bias):
    """y = x W^T + b + s (x A) B in plain MLX ops (autodiff's gradients) is the reference, to float32 rounding."""
    x, weight, a, b, bias_, cot = _operands(bias)
    scale = 3.0

    def reference(x, weight, a, b, *bias_):
        y = x @ weight.T + (bias_[0] if bias_ else 0.0)
        return ((y + scale * ((x @ a) @ b)) * cot).sum()

    def ours(x, weight, a, b, *bias_):
        return (lora_linear(x, weight, a, b, scale, bias_[0] if bias_ else None) * cot).sum()

    primals = [x, weight, a, b] + ([bias_] if bias else [])
    argnums = tuple(range(len(primals)))
    want_value, want = mx.value_and_grad(reference, argnums=argnums)(*primals)
    value, got = mx.value_and_grad(ours, argnums=argnums)(*primals)
    assert _rel(value, want_value) < 1e-6
    for name, g, w in zip(["x", "W", "A", "B", "bias"], got, want):
        assert g.shape == w.shape and _rel(g, w) < 1e-5, name


def _layer(dropout: float = 0.0, quantized: bool = False):
    base = nn.Linear(32, 40, bias=True)
    if quantized:
        base = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
    layer = LoRALinear.from_base(base, r=4, dropout=dropout, scale=2.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(3))
    return layer


class _Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def _layer_gradients(layer, x, cot, fused: bool):
    """(value, gradients of the adapters and of x) of sum(layer(x) * cot), through the fused route or not."""

    def loss(params, x):
        layer.update(params)
        return (layer(x) * cot).sum()

    params = layer.trainable_parameters()
    if not fused:
        return mx.value_and_grad(loss, argnums=(0, 1))(params, x)
    with route.fused_lora(_Holder(layer)) as names:
        assert names == ["mlx_lm.tuner.lora.LoRALinear.__call__"]
        return mx.value_and_grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_the_fused_route_gives_mlx_lm_s_layer_its_own_gradients(dropout):
    """The same value and gradients as mlx-lm's own call (with dropout: the same random mask from the same seed)."""
    layer = _layer(dropout)
    x = mx.random.normal((2, 7, 32), key=mx.random.key(1))
    cot = mx.random.normal((2, 7, 40), key=mx.random.key(2))
    mx.random.seed(5)
    want_value, (want_params, want_x) = _layer_gradients(layer, x, cot, fused=False)
    mx.random.seed(5)
    value, (params, d_x) = _layer_gradients(layer, x, cot, fused=True)
    assert _rel(value, want_value) < 1e-6 and _rel(d_x, want_x) < 1e-5
    for (name, g), (_, w) in zip(tree_flatten(params), tree_flatten(want_params)):
        assert _rel(g, w) < 1e-5, name
    assert LoRALinear.__call__.__name__ == "__call__"  # mlx-lm's own call is back


@pytest.mark.parametrize("case", ["quantized", "float16"])
def test_layers_the_fused_call_does_not_cover_keep_mlx_lm_s_call_exactly(case):
    layer = _layer(quantized=case == "quantized")
    x = mx.random.normal((3, 32), key=mx.random.key(4))
    if case == "float16":
        layer.set_dtype(mx.float16)
        x = x.astype(mx.float16)
    want = layer(x)
    with route.fused_lora(_Holder(layer)):
        got = layer(x)
    assert got.dtype == want.dtype and mx.array_equal(got, want)


@cpu_only("the LoRA layers are rebound on the CPU only")
def test_training_route_binds_the_fused_lora_call_for_lora_models_and_restores_it():
    original = LoRALinear.__call__
    model = build_model("llama")
    with route.training_route(model) as swapped:
        assert LoRALinear.__call__ is original  # no LoRA layer: nothing rebound
        assert not any("LoRALinear" in name for name in swapped)
    add_lora(model, LoraSpec(rank=4, scale=2.0, num_layers=-1), seed=0)
    with route.training_route(model) as swapped:
        assert LoRALinear.__call__ is not original and swapped[-1].endswith("LoRALinear.__call__")
    assert LoRALinear.__call__ is original
    with route.training_route(model, "mlx"):
        assert LoRALinear.__call__ is original
