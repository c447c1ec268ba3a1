"""Training through pose_mlx.kernels (the loop's default, `kernels="auto"`) against MLX's own attention and loss
(`kernels="mlx"`): the same gradients on every family, the same losses over 20 updates, and the routing itself."""

import sys

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pose_mlx import extend, use_positions
from pose_mlx.kernels import loss, route, rows, sizes
from pose_mlx.training.lora import LoraSpec, add_lora, lora_modules
from pose_mlx.training.loop import TrainConfig, _enable_grad_checkpoint, make_optimizer, make_update, masked_loss

from conftest import FAMILY_CONFIGS, VOCAB, build_model, cpu_only


def _batch(seed: int, length: int = 24, target: int = 256):
    """Token ids, targets, a mask with a padded tail, and skipping position ids below `target`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(2, length + 1))
    mask = np.ones((2, length), np.float32)
    mask[1, -5:] = 0
    positions = np.sort(rng.choice(target, size=(2, length), replace=False), axis=1)
    return (mx.array(tokens[:, :-1]), mx.array(tokens[:, 1:]), mx.array(mask), mx.array(positions.astype(np.int32)))


def _gradients(model, kernels: str, batch):
    import mlx.nn as nn

    inputs, targets, mask, positions = batch

    def loss_fn(x, y, m):
        return masked_loss(model, x, y, m, kernels=kernels, gradient=True)

    with use_positions(model, positions), route.training_route(model, kernels):
        value, grads = nn.value_and_grad(model, loss_fn)(inputs, targets, mask)
    mx.eval(value, grads)
    return float(value.item()), dict(tree_flatten(grads))


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _add_trained_lora(model) -> None:
    """Rank-4 adapters in every block, their B non-zero (as after some training) so that A has a gradient too."""
    add_lora(model, LoraSpec(rank=4, scale=2.0, num_layers=-1), seed=0)
    for i, (_, layer) in enumerate(lora_modules(model)):
        layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape, key=mx.random.key(100 + i))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_family_has_mlx_s_gradients(family, lora):
    model = build_model(family, seed=1)
    extend(model, "yarn", 64, 256)
    if lora:
        _add_trained_lora(model)
    else:
        model.unfreeze()
    batch = _batch(0)
    value, grads = _gradients(model, "auto", batch)
    want, want_grads = _gradients(model, "mlx", batch)
    assert abs(value - want) <= 1e-6 * abs(want)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in want_grads.items():
        assert _rel(grads[name], g) <= 1e-5, name


@pytest.mark.parametrize("compile_, checkpoint, lora", [(True, False, False), (False, True, False),
                                                       (True, True, False), (True, False, True), (True, True, True)])
def test_twenty_updates_lose_what_mlx_s_path_loses(compile_, checkpoint, lora):
    def run(kernels):
        model = build_model("llama", seed=2, num_hidden_layers=3, tie_word_embeddings=True)
        extend(model, "yarn", 64, 256)
        if lora:
            _add_trained_lora(model)
        else:
            model.unfreeze()
        config = TrainConfig(steps=20, lr=1e-3, warmup=2, compile=compile_, grad_checkpoint=checkpoint,
                             kernels=kernels, progress=False)
        restore = _enable_grad_checkpoint(model) if checkpoint else None
        update = make_update(model, make_optimizer(config), config, use_positions)

        class Batch:
            def __init__(self, seed):
                self.inputs, self.targets, self.mask, self.positions = (np.array(a) for a in _batch(seed))

        # the adapters learn two rows (seen in turn) within 20 updates at a rate where training is stable: at 1e-2
        # Adam blows rounding up on either path, and the two paths part by percents
        losses = [update(iter([Batch(step % 2 if lora else step)])).loss for step in range(config.steps)]
        if restore:
            restore()
        return losses

    ours, theirs = run("auto"), run("mlx")
    assert theirs[-1] < theirs[0]  # it learns
    assert np.allclose(ours, theirs, rtol=1e-4, atol=0)


def test_training_route_swaps_the_family_names_and_restores_them():
    from mlx_lm.models import activations, base

    model = build_model("llama")
    module = sys.modules[type(model).__module__]
    norm_call = nn.RMSNorm.__call__
    with route.training_route(model) as swapped:
        assert module.scaled_dot_product_attention is route.blocked_attention  # the CPU has no fused backward
        native = rows.native(mx.zeros(1)) is not None
        assert (module.swiglu is rows.swiglu) == native
        assert (nn.RMSNorm.__call__ is not norm_call) == native
        norms = [f"{nn.RMSNorm.__module__}.RMSNorm.__call__"]
        assert swapped == ([module.__name__] * 2 + norms if native else [module.__name__])
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert module.swiglu is activations.swiglu
    assert nn.RMSNorm.__call__ is norm_call
    with route.training_route(model, "mlx") as swapped:
        assert swapped == [] and module.scaled_dot_product_attention is base.scaled_dot_product_attention


@cpu_only("peak memory is measured on the CPU's allocator")
def test_the_loss_never_holds_the_whole_logits(monkeypatch):
    """rows x vocab float32 logits (32 MB here) against chunks of 2 MB: the chunked loss's peak stays far below
    (a quarter of the whole logits allows the chunk, its gradient and the next chunk's logits)."""
    rows_, vocab, hidden = 512, 16384, 32
    monkeypatch.setattr(sizes, "CHUNK_BYTES", 2 << 20)
    keys = mx.random.split(mx.random.key(0), 3)
    h, w = mx.random.normal((rows_, hidden), key=keys[0]), mx.random.normal((vocab, hidden), key=keys[1])
    t, weights = mx.random.randint(0, vocab, (rows_,), key=keys[2]), mx.ones((rows_,))
    mx.eval(h, w, t, weights)

    def peak(fn):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        with route.in_order():  # as the training loop evaluates
            mx.eval(mx.grad(fn)(h))
        return mx.get_peak_memory() - base

    logits_bytes = rows_ * vocab * 4
    import mlx.nn as nn

    whole = peak(lambda a: (nn.losses.cross_entropy(a @ w.T, t) * weights).sum())
    chunked = peak(lambda a: loss.chunked_cross_entropy(a, w, t, weights, gradient=True))
    assert whole >= logits_bytes
    assert chunked < logits_bytes / 4


def test_the_blocked_path_holds_blocks_of_scores_and_chunks_of_logits():
    """Through pose_mlx.kernels (the CPU's default) the attention keeps no L x L matrix and the loss no whole logits:
    at the peak, at most `backward[0]` arrays of one block's scores (three per block of queries) and `head[0]` chunks
    of logits (each of them queued ahead by MLX), whatever the row's length; MLX's own path grows with L^2."""
    from pose_mlx import memory

    smol = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                torch_dtype="float32")
    counts = memory.BLOCKED_COUNTS[(True, True, True)]
    for rows in (8192, 32768):
        settings = memory.TrainSettings(window=1024, target=rows, sampler="full", grad_checkpoint=True)
        est = memory.training_memory(smol, settings)
        assert est.details["attention"] == "blocked"
        block = sizes.block_rows(1, 9, rows - 1, rows - 1)
        assert est.breakdown["attention_scores"] <= counts.backward[0] * 4 * 9 * block * (rows - 1)
        assert 4 * 9 * block * (rows - 1) <= max(sizes.BLOCK_BYTES, 4 * 9 * sizes.MIN_BLOCK * (rows - 1))
        assert est.breakdown["logits"] <= counts.backward_logits * sizes.CHUNK_BYTES
        unfused = memory.training_memory(smol, memory.TrainSettings(
            window=1024, target=rows, sampler="full", grad_checkpoint=True, kernels="mlx"))
        assert unfused.breakdown["attention_scores"] >= 4 * 9 * (rows - 1) ** 2  # at least one whole matrix
    assert est.peak < 24 * 2**30  # a full-length 32k update of SmolLM2-135M is planned on a 24 GB machine


@cpu_only("CUDA keeps MLX's fused attention: nothing is routed there")
def test_probe_evaluation_and_collapse_check_run_through_the_training_route(monkeypatch):
    """finetune's loss probe, its evaluations and its collapse check ran the model through MLX's own attention, so
    a 16k full-length run spent most of an hour on L x L scores before its first update (and held 10 GB): they
    take the training's route, with the same loss as MLX's path."""
    from types import SimpleNamespace

    from pose_mlx.kernels import attention
    from pose_mlx.training.loop import check_not_collapsed, evaluate, probe_loss

    calls = []
    original = attention.attention
    monkeypatch.setattr(attention, "attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = build_model("llama", seed=1)
    extend(model, "yarn", 64, 256)
    inputs, targets, mask, positions = _batch(0)
    batch = SimpleNamespace(inputs=np.array(inputs), targets=np.array(targets), mask=np.array(mask),
                            positions=np.array(positions))
    mine = probe_loss(model, batch, use_positions, "auto")
    assert calls
    calls.clear()
    assert probe_loss(model, batch, use_positions, "mlx") == pytest.approx(mine, rel=1e-5) and not calls
    assert evaluate(model, [batch, batch], use_positions, "auto") == pytest.approx(mine, rel=1e-5) and calls
    calls.clear()
    check_not_collapsed(model, batch, use_positions, before=mine, step=1, kernels="auto")
    assert calls
