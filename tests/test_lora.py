"""LoRA adapters (`pose_mlx.training.lora`) against hand computations: a fresh adapter changes nothing (B = 0),
only the adapters train, fusing writes W + scale * B^T A^T (computed here in NumPy from the stored factors; mlx-lm
stores A as (in, r) and B as (r, out)), and the unfused save reloads in mlx-lm to the same logits."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from _finetune_helpers import tiny_model  # noqa: F401
from conftest import build_model
from pose_mlx.training.lora import LoraSpec, add_lora, fuse_lora, lora_modules, save_unfused

PROJECTIONS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"}  # every linear layer of a llama block: mlx-lm's default keys
TOKENS = mx.array([[5, 17, 3, 44, 90, 2, 61, 8]])


def _logits(model) -> np.ndarray:
    return np.array(model(TOKENS))


def _randomize_b(model, seed: int = 1) -> None:
    """Give every adapter a random B (as training would), so that it changes the output."""
    rng = np.random.default_rng(seed)
    for _, m in lora_modules(model):
        m.lora_b = mx.array(rng.normal(0, 0.5, m.lora_b.shape).astype(np.float32))
    mx.eval(model.parameters())


def test_a_fresh_adapter_leaves_the_model_unchanged_and_only_adapters_train():
    model = build_model("llama", num_hidden_layers=3)
    before = _logits(model)
    add_lora(model, LoraSpec(rank=4, scale=2.0, num_layers=2), seed=0)
    names = {name for name, _ in lora_modules(model)}
    assert names == {f"model.layers.{i}.{p}" for i in (1, 2) for p in PROJECTIONS}  # the last 2 of 3 blocks
    for _, m in lora_modules(model):
        assert m.lora_a.shape == (m.linear.weight.shape[1], 4) and m.lora_b.shape == (4, m.linear.weight.shape[0])
        assert not np.any(np.array(m.lora_b)) and np.any(np.array(m.lora_a)) and m.scale == 2.0
    np.testing.assert_array_equal(_logits(model), before)  # B = 0: W x + scale * (x A) 0 = W x
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert trainable == {f"{name}.lora_{ab}" for name in names for ab in "ab"}


def test_the_adapters_random_a_comes_from_the_seed():
    a, b, c = (build_model("llama") for _ in range(3))
    for model, seed in ((a, 7), (b, 7), (c, 8)):
        add_lora(model, LoraSpec(rank=2, scale=1.0, num_layers=1), seed=seed)
    first, again, other = ([np.array(m.lora_a) for _, m in lora_modules(x)] for x in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    assert not any(np.array_equal(x, y) for x, y in zip(first, other))


def test_fusing_writes_w_plus_scale_b_a():
    model = build_model("llama")
    add_lora(model, LoraSpec(rank=3, scale=1.5, num_layers=1), seed=0)
    _randomize_b(model)
    with_adapters = _logits(model)
    expected = {}
    for name, m in lora_modules(model):
        w, a, b = (np.array(x, dtype=np.float64) for x in (m.linear.weight, m.lora_a, m.lora_b))
        expected[name] = w + 1.5 * b.T @ a.T  # (out, in): y = W x + scale * B^T A^T x
        assert np.abs(expected[name] - w).max() > 0.1  # the update is not negligible
    fuse_lora(model)
    assert not lora_modules(model)
    layers = dict(model.named_modules())
    for name, want in expected.items():
        assert type(layers[name]) is nn.Linear
        np.testing.assert_allclose(np.array(layers[name].weight), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_logits(model), with_adapters, rtol=1e-4, atol=1e-4)
    fuse_lora(model)  # nothing left to fuse: a no-op
    np.testing.assert_allclose(_logits(model), with_adapters, rtol=1e-4, atol=1e-4)


def test_fusing_into_a_quantized_base_requantizes_w_plus_scale_b_a():
    """8-bit base in groups of 32: the fused layer is quantized alike, and its dequantized weight is
    dequant(W) + scale * B^T A^T up to one quantization step of its group (the step: the group's range / 255)."""
    model = build_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    nn.quantize(model, group_size=32, bits=8)
    add_lora(model, LoraSpec(rank=2, scale=2.0, num_layers=1), seed=0)
    _randomize_b(model)
    expected = {}
    for name, m in lora_modules(model):
        q = m.linear
        assert isinstance(q, nn.QuantizedLinear)
        w = np.array(mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8), dtype=np.float64)
        expected[name] = (w, w + 2.0 * np.array(m.lora_b, np.float64).T @ np.array(m.lora_a, np.float64).T)
    fuse_lora(model)
    layers = dict(model.named_modules())
    for name, (w, want) in expected.items():
        q = layers[name]
        assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (8, 32)
        got = np.array(mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8), dtype=np.float64)
        groups = want.reshape(want.shape[0], -1, 32)
        step = (groups.max(-1) - groups.min(-1)) / 255
        error = np.abs(got - want).reshape(groups.shape).max(-1)
        assert np.all(error <= step + 1e-6), name
        assert np.abs(got - w).max() > 10 * step.max()  # the update is far above the quantization step


def test_save_unfused_keeps_the_base_and_reloads_in_mlx_lm(tiny_model, tmp_path):  # noqa: F811
    from mlx_lm import load

    model, _ = load(str(tiny_model))
    base = dict(tree_flatten(model.parameters()))
    spec = LoraSpec(rank=4, scale=3.0, num_layers=1)
    add_lora(model, spec, seed=0)
    _randomize_b(model)
    want = _logits(model)
    folder = tmp_path / "unfused"
    save_unfused(model, folder, spec)
    assert len(lora_modules(model)) == len(PROJECTIONS)  # the model keeps its adapters
    np.testing.assert_array_equal(_logits(model), want)
    saved = mx.load(str(folder / "model.safetensors"))
    assert set(saved) == set(base)  # the base weights under their own names, no adapter in them
    for key, value in base.items():
        np.testing.assert_array_equal(np.array(saved[key]), np.array(value))
    adapters = mx.load(str(folder / "adapters.safetensors"))
    assert set(adapters) == {f"{n}.lora_{ab}" for n, _ in lora_modules(model) for ab in "ab"}
    for name, m in lora_modules(model):
        np.testing.assert_array_equal(np.array(adapters[f"{name}.lora_b"]), np.array(m.lora_b))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config == {"fine_tune_type": "lora", "num_layers": 1,
                      "lora_parameters": {"rank": 4, "scale": 3.0, "dropout": 0.0}}
    for path in tiny_model.iterdir():  # config and tokenizer, as the export adds them
        if not path.name.endswith(".safetensors") and not (folder / path.name).exists():
            shutil.copy(path, folder / path.name)
    reloaded, _ = load(str(folder), adapter_path=str(folder))
    np.testing.assert_allclose(_logits(reloaded), want, rtol=1e-5, atol=1e-5)

