"""The simulator's base-model gates against hand-computed values."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from pose_mlx.model.source import build_model
from pose_mlx.sim.gates import (attention_logits, causal_mask, far_attention, no_context_ppl, sink_share,
                                unigram_ppl)
from pose_mlx.toy import model_config


def _model(kv_heads=None, seed=0):
    model = build_model(model_config(32, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                                     intermediate_size=32), seed=seed)
    mx.eval(model.parameters())
    return model


def _zeroed(model, part):
    model.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(model.parameters()) if part in k]))
    return model


def test_unigram_ppl_by_hand():
    # counts 0: 2, 1: 1, 2: 0 of N = 3, V = 3: p(0) = 3/6, p(2) = 1/6; ppl = exp(-(ln 1/2 + ln 1/6) / 2) = sqrt 12
    assert unigram_ppl(np.array([0, 0, 1]), np.array([0, 2]), 3) == pytest.approx(math.sqrt(12))
    # no training text: uniform, ppl = V
    assert unigram_ppl(np.array([], np.int64), np.array([4, 1, 1]), 7) == pytest.approx(7)
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 3\)$"):  # 5 in the training text
        unigram_ppl(np.array([0, 5]), np.array([0]), 3)
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 3\)$"):  # -1 in the test text
        unigram_ppl(np.array([0]), np.array([-1]), 3)
    with pytest.raises(ValueError, match="^no test tokens$"):
        unigram_ppl(np.array([0]), np.array([], np.int64), 3)


def test_no_context_ppl_uniform_and_against_the_model_s_first_position():
    # zero weights: zero logits, every token 1/V
    assert no_context_ppl(_zeroed(_model(), ""), np.array([3, 5, 5, 31]), 1) == pytest.approx(32, rel=1e-5)
    # a random model: the loss of each token placed right after BOS in a full forward pass (causal: the first
    # position sees only BOS), through mlx's cross entropy
    model, test = _model(seed=3), np.array([3, 5, 5, 31, 0])
    logits = mx.repeat(model(mx.array([[1] + [0] * 4]))[0, :1], len(test), axis=0)
    loss = nn.losses.cross_entropy(logits, mx.array(test)).mean().item()
    assert no_context_ppl(model, test, 1) == pytest.approx(math.exp(loss), rel=1e-5)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_sink_share_of_uniform_attention(kv_heads):
    """Zero keys: every query attends uniformly to its causal prefix, weight 1 / (i + 1) on token 0 at query i;
    the mean over queries 1..n-1 is (H_n - 1) / (n - 1)."""
    n = 9
    model = _zeroed(_model(kv_heads), "k_proj")
    expected = sum(1 / (i + 1) for i in range(1, n)) / (n - 1)
    assert sink_share(model, np.arange(3, 3 + n)) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="^sink_share needs one sequence of at least 2 tokens$"):
        sink_share(model, np.array([3]))


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_far_attention_of_uniform_attention(kv_heads):
    """Zero keys: every logit is 0, so the largest far and near logits are equal (excess 0) and the far share is
    the share of far keys. n = 10, window 4: queries 8 and 9 see 9 and 10 keys, of which 5 and 6 are >= 4 back."""
    model = _zeroed(_model(kv_heads), "k_proj")
    got = far_attention(model, np.arange(3, 13), 4)
    expected = (5 / 9 + 6 / 10) / 2
    assert got["uniform_share"] == pytest.approx(expected)
    assert got["far_share"] == pytest.approx(expected, rel=1e-5) and got["far_logit_excess"] == pytest.approx(0)
    # a trained-like model differs from uniform: random keys move weight between near and far
    other = far_attention(_model(kv_heads, seed=4), np.arange(3, 13), 4)
    assert other["uniform_share"] == pytest.approx(expected) and other["far_share"] != pytest.approx(expected)
    with pytest.raises(ValueError, match=r"^far_attention needs one sequence longer than the window \(4\)"):
        far_attention(model, np.arange(4), 4)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_attention_logits_are_the_module_s_own(kv_heads):
    """The softmax of the logits that sink_share and far_attention read reproduces the module's output:
    o_proj(weights @ v)."""
    attn = _model(kv_heads, seed=2).model.layers[0].self_attn
    x = mx.random.normal((2, 7, 16), key=mx.random.key(0))
    weights = mx.softmax(attention_logits(attn, x, causal_mask(7)), axis=-1)
    v = attn.v_proj(x).reshape(2, 7, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = mx.repeat(v, attn.n_heads // attn.n_kv_heads, axis=1)
    mine = attn.o_proj((weights @ v).transpose(0, 2, 1, 3).reshape(2, 7, -1))
    np.testing.assert_allclose(np.array(mine), np.array(attn(x, mask="causal")), atol=1e-5)
