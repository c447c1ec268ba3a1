"""Static loss scaling in the training loop: exact in float32, and what keeps float16 gradients (a small model's
version of benchmarks/bench_grad_precision.py, whose SmolLM2-135M numbers set the default scale)."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from pose_mlx import extend, use_positions
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config
from pose_mlx.training.data import Batch
from pose_mlx.training.loop import FLOAT16_LOSS_SCALE, NonFinite, TrainConfig, loss_scale_for, make_update

T, VOCAB = 256, 256


def tiny(dtype=mx.float32, embed_factor: float = 1.0):
    """A 2-block LoRA model in `dtype` (LoRA matrices float32, as mlx-lm makes them; B random so that A gets
    gradients too); `embed_factor` shrinks the tied embeddings, hence the logits and every gradient."""
    model = build_model(model_config(VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=T),
                        seed=0)
    extend(model, "linear", T, 4 * T)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * embed_factor
    model.set_dtype(dtype)
    mx.random.seed(0)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.02
    return model


def gradients(model, loss_scale: float, compile: bool = False) -> dict:
    """The gradient of the mean loss on one random T-token row, read off one SGD step of rate 1 (no clipping)."""
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    config = TrainConfig(steps=1, lr=1.0, warmup=0, max_grad_norm=1e9, compile=compile, loss_scale=loss_scale,
                         progress=False)
    update = make_update(model, optim.SGD(learning_rate=1.0), config, use_positions)
    tokens = np.random.default_rng(0).integers(3, VOCAB, size=(1, T + 1)).astype(np.int32)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], np.arange(T, dtype=np.int32)[None], np.ones((1, T), np.float32),
                  np.zeros(1, np.int64))
    result = update(iter([batch]))
    grads = {k: before[k] - np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    return grads, result


def relative_errors(grads: dict, reference: dict) -> np.ndarray:
    return np.array([np.linalg.norm(grads[k] - reference[k]) / np.linalg.norm(reference[k]) for k in reference])


@pytest.mark.parametrize("compile", [False, True])
def test_scaling_changes_nothing_in_float32(compile):
    """In float32, S * L's gradient divided by S is L's gradient, and the reported loss is L, not S * L."""
    plain, r1 = gradients(tiny(), 1.0, compile)
    scaled, r2 = gradients(tiny(), FLOAT16_LOSS_SCALE, compile)
    assert relative_errors(scaled, plain).max() < 1e-5
    assert r2.loss == pytest.approx(r1.loss, rel=1e-6) and r2.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)
    assert 4.0 < r1.loss < 7.0  # about ln(256) = 5.5 for an untrained model: the loss is unscaled


@pytest.mark.parametrize("compile", [False, True])
def test_scaling_keeps_float16_gradients(compile):
    """Small logits (shrunk embeddings): a token's logit gradient (p - y) / T falls into float16's subnormal range,
    where the backward pass loses digits; scaled by 4096 the float16 gradients match float32's. (The chunked loss
    forms the logit gradient in float32 and rounds it to float16 once, which loses fewer digits than MLX's float16
    loss did: the embeddings are shrunk far enough that it still loses many.)"""
    reference, _ = gradients(tiny(embed_factor=0.003), 1.0)
    unscaled, _ = gradients(tiny(mx.float16, embed_factor=0.003), 1.0, compile)
    scaled, _ = gradients(tiny(mx.float16, embed_factor=0.003), FLOAT16_LOSS_SCALE, compile)
    assert relative_errors(unscaled, reference).max() > 0.05
    assert relative_errors(scaled, reference).max() < 0.01


def test_default_scale_follows_the_models_precision():
    """4096 for a model that computes in float16 (a quantized one with float16 scales too), 1 in float32 and in
    bfloat16 (float32's exponent range); a requested scale wins."""
    assert loss_scale_for(tiny()) == 1.0
    assert loss_scale_for(tiny(mx.bfloat16)) == 1.0
    assert loss_scale_for(tiny(mx.float16)) == FLOAT16_LOSS_SCALE
    quantized = build_model(model_config(VOCAB, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128),
                            seed=0)
    quantized.set_dtype(mx.float16)
    nn.quantize(quantized, group_size=32, bits=4)
    assert loss_scale_for(quantized) == FLOAT16_LOSS_SCALE
    assert loss_scale_for(tiny(mx.float16), requested=8.0) == 8.0


def test_non_finite_names_the_loss_scale():
    """A float16 run that overflows is told to lower the scale it ran with; a float32 one only the learning rate."""
    assert "--loss-scale below 4096" in str(NonFinite("the gradient norm", 3, None, FLOAT16_LOSS_SCALE))
    assert "--loss-scale" not in str(NonFinite("the gradient norm", 3, None))
