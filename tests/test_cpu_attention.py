"""pose_mlx.eval.cpu_attention and pose_mlx.eval.forward against MLX's own attention and full forward passes."""

import importlib

import numpy as np
import pytest

import pose_mlx.eval.cpu_attention as ca
from pose_mlx.eval import longctx
from pose_mlx.eval.forward import PLAIN_HEAD_MODULES, eval_logits, output_head

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import make_prompt_cache

from conftest import build_model, cpu_only, on_cpu

#: Tests of the NumPy attention itself: off the CPU `attention` and `fast_attention` hand every call to MLX's own
#: kernel (by design), so there these tests would compare MLX with itself or find the NumPy path never taken.
numpy_path = cpu_only("pose_mlx.eval.cpu_attention's NumPy attention runs only on the CPU backend")

# (B, H, Hkv, Lq, Lk, D, Dv): GQA, a cache offset (Lq < Lk), one query, odd sizes, Dv != D, several tiles
SHAPES = [
    (1, 6, 2, 9, 9, 16, 16),
    (2, 4, 2, 7, 13, 8, 8),
    (1, 6, 1, 1, 33, 16, 16),
    (2, 3, 3, 5, 5, 4, 6),
    (1, 9, 3, 150, 413, 64, 64),
]
MASKS = ["none", "causal", "bool", "additive"]


def _inputs(shape, seed=0):
    b, h, hkv, lq, lk, d, dv = shape
    keys = iter(mx.random.split(mx.random.key(seed), 5))
    q = mx.random.normal((b, h, lq, d), key=next(keys))
    k = mx.random.normal((b, hkv, lk, d), key=next(keys))
    v = mx.random.normal((b, hkv, lk, dv), key=next(keys))
    return q, k, v, keys


def _mask(kind, shape, keys):
    b, h, _, lq, lk, _, _ = shape
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool":  # per batch, shared by the heads
        return mx.random.uniform(shape=(b, 1, lq, lk), key=next(keys)) > 0.3
    return mx.random.normal((lq, lk), key=next(keys))  # additive, broadcast over batch and heads


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _reference(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@numpy_path
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
def test_attention_matches_mlx_kernel(shape, kind):
    q, k, v, keys = _inputs(shape)
    mask = _mask(kind, shape, keys)
    out = ca.attention(q, k, v, 0.3, mask)
    assert out.shape == (shape[0], shape[1], shape[3], shape[6]) and out.dtype == mx.float32
    assert _rel(out, _reference(q, k, v, 0.3, mask)) <= 1e-5


@numpy_path
def test_causal_mask_is_bottom_right_aligned():
    """Query i of Lq sees keys 0..Lk-Lq+i: the last query sees everything, the first Lk-Lq+1 keys."""
    q, k, v, _ = _inputs((1, 2, 1, 4, 10, 8, 8))
    out = np.array(ca.attention(q, k, v, 0.5, "causal"))
    for i in range(4):
        visible = 10 - 4 + i + 1
        expected = ca.attention(q[:, :, i : i + 1], k[:, :, :visible], v[:, :, :visible], 0.5, None)
        assert _rel(out[:, :, i : i + 1], expected) <= 1e-6


@numpy_path
def test_fully_masked_row_averages_values_like_mlx():
    q, k, v, _ = _inputs((1, 2, 2, 3, 5, 4, 4))
    mask = mx.array([[True] * 5, [False] * 5, [True, False, True, False, False]])
    out = ca.attention(q, k, v, 0.5, mask)
    assert _rel(out[:, :, 1], v.mean(axis=2)) <= 1e-6
    assert _rel(out, _reference(q, k, v, 0.5, mask)) <= 1e-5


@numpy_path
def test_half_precision_is_computed_in_float32_and_cast_back():
    q, k, v, _ = _inputs((1, 4, 2, 6, 11, 16, 16))
    half = [x.astype(mx.float16) for x in (q, k, v)]
    out = ca.attention(*half, 0.25, "causal")
    assert out.dtype == mx.float16
    exact = _reference(*[x.astype(mx.float32) for x in half], 0.25, "causal")
    assert _rel(out.astype(mx.float32), exact) <= 1e-3  # float16 rounding of the output only


@numpy_path
def test_worker_threads_give_the_same_result_as_one_thread(monkeypatch):
    shape = (1, 9, 3, 300, 700, 64, 64)
    q, k, v, _ = _inputs(shape)
    monkeypatch.setattr(ca, "INLINE_ELEMENTS", 0)
    monkeypatch.setattr(ca, "TILE_ROWS", 30)  # many tiles, shared between the workers
    threaded = np.array(ca.attention(q, k, v, 0.125, "causal"))
    monkeypatch.setattr(ca, "INLINE_ELEMENTS", 1 << 62)
    inline = np.array(ca.attention(q, k, v, 0.125, "causal"))
    np.testing.assert_array_equal(threaded, inline)  # the same tiles, the same arithmetic
    assert _rel(inline, _reference(q, k, v, 0.125, "causal")) <= 1e-5


@numpy_path
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[4]])
@pytest.mark.parametrize("kind", MASKS)
def test_gradients_match_mlx_kernel(shape, kind):
    q, k, v, keys = _inputs(shape, seed=3)
    mask = _mask(kind, shape, keys)
    weights = mx.random.normal((shape[0], shape[1], shape[3], shape[6]), key=next(keys))

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v, 0.3, mask) * weights).sum()

    fast = mx.grad(loss(ca.attention), argnums=(0, 1, 2))(q, k, v)
    reference = mx.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(fast, reference):
        assert got.shape == want.shape
        assert _rel(got, want) <= 1e-4


@numpy_path
def test_additive_mask_gets_its_gradient():
    shape = SHAPES[1]
    q, k, v, keys = _inputs(shape)
    bias = _mask("additive", shape, keys)
    d_fast = mx.grad(lambda m: ca.attention(q, k, v, 0.3, m).sum())(bias)
    d_ref = mx.grad(lambda m: _reference(q, k, v, 0.3, m).sum())(bias)
    assert _rel(d_fast, d_ref) <= 1e-4


def test_inside_compile_and_vmap_it_is_mlx_kernel():
    q, k, v, _ = _inputs((2, 4, 2, 8, 8, 8, 8))
    compiled = mx.compile(lambda q, k, v: ca.attention(q, k, v, 0.3, "causal"))
    assert _rel(compiled(q, k, v), _reference(q, k, v, 0.3, "causal")) <= 1e-6
    grad = mx.compile(mx.grad(lambda q: ca.attention(q, k, v, 0.3, "causal").sum()))
    want = mx.grad(lambda q: _reference(q, k, v, 0.3, "causal").sum())(q)
    assert _rel(grad(q), want) <= 1e-5
    mapped = mx.vmap(lambda q: ca.attention(q, k[:1], v[:1], 0.3, None))(q[:, None])
    assert _rel(mapped[:, 0], _reference(q, mx.repeat(k[:1], 2, 0), mx.repeat(v[:1], 2, 0), 0.3, None)) <= 1e-6


def test_unsupported_inputs_fall_back_to_mlx(monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("the NumPy path must not run")

    q, k, v, _ = _inputs((1, 2, 1, 6, 4, 8, 8))  # Lq > Lk with a causal mask
    assert not ca.supported(q, k, v, "causal")
    assert ca.supported(q, k, v, None) and not ca.supported(q, k, v, mx.zeros((5, 4)))
    monkeypatch.setattr(ca, "_forward", fail)
    assert _rel(ca.attention(q, k, v, 0.5, "causal"), _reference(q, k, v, 0.5, "causal")) <= 1e-6
    monkeypatch.setattr(ca, "cpu_backend", lambda: False)  # what a GPU device looks like to the selection
    q, k, v, _ = _inputs((1, 2, 1, 4, 4, 8, 8))
    assert _rel(ca.attention(q, k, v, 0.5, "causal"), _reference(q, k, v, 0.5, "causal")) <= 1e-6


# --------------------------------------------------------------------------------------------- routing


def _count_fast_calls(monkeypatch) -> list:
    calls = []
    forward = ca._forward

    def counting(problem):
        calls.append(problem.lq)
        return forward(problem)

    monkeypatch.setattr(ca, "_forward", counting)
    return calls


@numpy_path
def test_fast_attention_swaps_and_restores_the_model_modules_name(monkeypatch):
    import mlx_lm.models.llama as llama

    model = build_model("llama")
    calls = _count_fast_calls(monkeypatch)
    assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    with ca.fast_attention(model) as swapped:
        assert swapped == ["mlx_lm.models.llama"]
        assert llama.scaled_dot_product_attention is ca.scaled_dot_product_attention
        with ca.fast_attention(model) as inner:  # nested: nothing left to swap, the outer swap stays
            assert inner == []
        assert llama.scaled_dot_product_attention is ca.scaled_dot_product_attention
        mx.eval(model(mx.array([[1, 2, 3, 4]])))
    assert calls == [4, 4]  # both layers took the NumPy path
    assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"):
        with ca.fast_attention(model):
            raise RuntimeError("boom")
    assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    mx.eval(model(mx.array([[1, 2, 3, 4]])))
    assert calls == [4, 4]  # outside the block: MLX's path


def test_fast_attention_is_inactive_off_the_cpu(monkeypatch):
    import mlx_lm.models.llama as llama

    model = build_model("llama")
    monkeypatch.setattr(ca, "cpu_backend", lambda: False)
    with ca.fast_attention(model) as swapped:
        assert swapped == []
        assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    monkeypatch.undo()
    with ca.fast_attention(model) as swapped:  # the real selection: the CPU backend takes the NumPy path, no other
        assert swapped == (["mlx_lm.models.llama"] if on_cpu() else [])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "starcoder2", "gemma"])
def test_families_calling_mlx_lm_attention_are_routed(family):
    model = build_model(family)
    module = importlib.import_module(type(model).__module__)
    assert [m.__name__ for m in ca.routed_modules(model)] == [module.__name__]


def test_family_computing_attention_itself_keeps_its_path():
    model = build_model("gemma2")
    with ca.fast_attention(model) as swapped:
        assert swapped == []
    tokens = mx.array([[5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(np.array(eval_logits(model, tokens)), np.array(model(tokens)))


# ------------------------------------------------------------------------------------ whole models


@numpy_path
def test_chunked_prefill_logits_with_and_without_fast_path(monkeypatch):
    model = build_model("llama", num_hidden_layers=3, max_position_embeddings=512)
    tokens = np.random.default_rng(0).integers(0, 97, size=230).astype(np.int32)
    calls = _count_fast_calls(monkeypatch)
    fast = longctx.chunked_logits(model, tokens, chunk=64)  # prefill runs under fast_attention
    assert calls and max(calls) == 64
    parts, cache = [], make_prompt_cache(model)
    for start in range(0, tokens.size, 64):  # MLX's path, the same chunks through the same cache
        parts.append(np.array(model(mx.array(tokens[None, start : start + 64]), cache=cache)[0]))
    assert _rel(fast, np.concatenate(parts)) <= 1e-5
    full = np.array(model(mx.array(tokens)[None])[0])  # one forward, no cache
    assert _rel(fast, full) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "starcoder2"])
@pytest.mark.parametrize("tied", [True, False])
def test_last_only_logits_are_the_last_row_of_the_full_forward(family, tied):
    model = build_model(family, tie_word_embeddings=tied)
    assert type(model).__module__ in PLAIN_HEAD_MODULES and output_head(model) is not None
    tokens = mx.array(np.random.default_rng(2).integers(0, 97, size=(2, 21)).astype(np.int32))
    full = model(tokens)
    last = eval_logits(model, tokens, last_only=True)
    assert last.shape == (2, 1, full.shape[-1])
    assert _rel(last[:, 0], full[:, -1]) <= 1e-5
    cache = make_prompt_cache(model)  # through a cache, as in prefill and generation
    eval_logits(model, tokens[:, :13], cache, last_only=True)
    assert _rel(eval_logits(model, tokens[:, 13:], cache, last_only=True)[:, 0], full[:, -1]) <= 1e-5


def test_last_only_for_other_families_slices_the_full_forward():
    model = build_model("gpt_neox")
    assert output_head(model) is None
    tokens = mx.array([[3, 4, 5, 6]])
    last = eval_logits(model, tokens, last_only=True)  # gpt_neox's attention is routed: equal to rounding
    assert last.shape == (1, 1, 97) and _rel(last[:, 0], model(tokens)[:, -1]) <= 1e-5


def test_prefill_returns_the_last_logits_with_fast_path():
    model = build_model("qwen3", num_hidden_layers=2)
    tokens = np.random.default_rng(4).integers(0, 97, size=100).astype(np.int32)
    last = longctx.prefill(model, tokens, make_prompt_cache(model), chunk=32)
    full = model(mx.array(tokens)[None])[0, -1]
    assert last.shape == (97,) and _rel(last, full) <= 1e-5


@numpy_path
def test_model_gradients_under_fast_attention_match():
    """A loss and its gradients through a whole model are the same with the NumPy attention (eager)."""
    model = build_model("llama", num_hidden_layers=2)
    tokens = mx.array(np.random.default_rng(5).integers(0, 97, size=(2, 40)).astype(np.int32))

    def loss(m):
        return nn.losses.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).mean()

    grad = nn.value_and_grad(model, loss)
    want_loss, want = grad(model)
    with ca.fast_attention(model) as swapped:
        assert swapped
        got_loss, got = grad(model)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    from mlx.utils import tree_flatten

    for (name, g), (_, w) in zip(tree_flatten(got), tree_flatten(want)):
        assert _rel(g, w) <= 1e-4, name


@numpy_path
@pytest.mark.parametrize("checkpoint", [False, True])
def test_training_updates_with_fast_attention_match_mlx(checkpoint):
    """`make_update` run eagerly inside `fast_attention` (NumPy forward and backward) takes the same LoRA steps
    as with MLX's attention under mx.compile: losses, gradient norms and weights; also with checkpointing."""
    import contextlib

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from pose_mlx import extend, use_positions
    from pose_mlx.training.data import ExampleStream, TokenizedCorpus
    from pose_mlx.training.loop import TrainConfig, _enable_grad_checkpoint, make_optimizer, make_update

    tokens = np.random.default_rng(0).integers(3, 97, size=4 * 300).astype(np.int32)
    corpus = TokenizedCorpus(tokens, np.arange(5, dtype=np.int64) * 300, np.arange(4), "t", {})
    runs = {}
    for fast in (False, True):
        model = build_model("llama", max_position_embeddings=64)
        extend(model, "linear", 64, 256)
        mx.random.seed(0)
        model.freeze()
        linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
        restore = _enable_grad_checkpoint(model) if checkpoint else None
        config = TrainConfig(steps=4, lr=3e-3, warmup=1, compile=not fast, progress=False)
        update = make_update(model, make_optimizer(config), config, use_positions)
        batches = iter(ExampleStream(corpus, 64, 256, chunks=2, batch_size=2, seed=1))
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            forward = ca._forward
            patch.setattr(ca, "_forward", lambda problem: calls.append(1) or forward(problem))
            with ca.fast_attention(model) if fast else contextlib.nullcontext():
                runs[fast] = [update(batches) for _ in range(4)], dict(tree_flatten(model.trainable_parameters()))
        assert bool(calls) == fast  # the NumPy path ran exactly when asked
        if restore:
            restore()
    (mlx_steps, mlx_weights), (fast_steps, fast_weights) = runs[False], runs[True]
    np.testing.assert_allclose(np.array(fast_steps)[:, :2], np.array(mlx_steps)[:, :2], rtol=1e-5, atol=1e-6)
    # AdamW moves a weight by about lr per step whatever its gradient's size, so rounding-level gradient
    # differences on near-zero gradients show up as a fraction of lr: allow 1% of one step
    for name, value in mlx_weights.items():
        np.testing.assert_allclose(np.array(fast_weights[name]), np.array(value), rtol=0, atol=0.01 * 3e-3,
                                   err_msg=name)
