"""The row kernels of training: softmax rows with a causal limit, cross-entropy rows, SwiGLU; native or in MLX ops.

Each function has two implementations with one contract: the vectorized C++ primitives of `cpu_kernels.cpp`
(`build.load()`), used for float32 arrays when MLX's default device is the CPU and they could be built; and MLX
ops, used everywhere else (Metal, CUDA, 16-bit arrays, no compiler). Both are exact to float32 rounding.

Scores are (..., R, E): R rows of E columns. With `causal`, row r (its index along the second-last axis) sees the
columns [0, first + (r mod block) + 1), clamped to [0, E]: a block of queries stacked `R / block` times (the query
heads sharing one KV head), query i of the block at absolute position `first + i` minus the keys' offset.

    softmax_rows(S)            -> P = exp(S - lse) on the visible columns and 0 elsewhere; lse = log sum exp
    softmax_rows_grad(S, dP, lse, D) -> (P, dS = P * (dP - D))        the softmax's backward given D = rowsum(dO * O)
    cross_entropy_rows(Z, t)   -> (log sum_j exp Z_j, Z_t) per row
    cross_entropy_with_grad(Z, t, w) -> the same and dZ = w * (softmax(Z) - onehot(t)) per row
    swiglu(g, u)               -> silu(g) * u, differentiable
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import build

_NEG_INF = float("-inf")


def native(*arrays: mx.array):
    """The C++ kernels module when they apply to `arrays` (CPU device, all float32, built), else None."""
    if mx.default_device().type != mx.DeviceType.cpu or any(a.dtype != mx.float32 for a in arrays):
        return None
    return build.load()


def _visible(rows: int, width: int, first: int, block: int) -> mx.array:
    """(rows, width) boolean: the columns each causal row sees."""
    limit = mx.clip(first + mx.arange(rows) % block + 1, 0, width)
    return mx.arange(width)[None, :] < limit[:, None]


def softmax_rows(scores: mx.array, causal: bool, first: int = 0, block: int = 1) -> tuple[mx.array, mx.array]:
    kernels = native(scores)
    if kernels is not None:
        return kernels.softmax_rows(scores, causal, first, block)
    s = scores.astype(mx.float32)
    if causal:
        s = mx.where(_visible(s.shape[-2], s.shape[-1], first, block), s, _NEG_INF)
    top = mx.max(s, axis=-1, keepdims=True)
    top = mx.where(top == _NEG_INF, 0.0, top)
    p = mx.exp(s - top)
    total = mx.sum(p, axis=-1, keepdims=True)
    lse = (top + mx.log(total))[..., 0]
    return mx.where(total > 0, p / mx.maximum(total, 1e-38), 0.0), lse


def softmax_rows_grad(scores: mx.array, dprobs: mx.array, lse: mx.array, delta: mx.array, causal: bool,
                      first: int = 0, block: int = 1) -> tuple[mx.array, mx.array]:
    kernels = native(scores, dprobs, lse, delta)
    if kernels is not None:
        return kernels.softmax_rows_grad(scores, dprobs, lse, delta, causal, first, block)
    p = mx.exp(scores.astype(mx.float32) - lse[..., None])
    if causal:
        p = mx.where(_visible(p.shape[-2], p.shape[-1], first, block), p, 0.0)
    return p, p * (dprobs.astype(mx.float32) - delta[..., None])


def cross_entropy_rows(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    kernels = native(logits)
    if kernels is not None:
        return kernels.cross_entropy_rows(logits, targets)
    z = logits.astype(mx.float32)
    picked = mx.take_along_axis(z, targets.astype(mx.int32)[..., None], axis=-1)[..., 0]
    return mx.logsumexp(z, axis=-1), picked


def cross_entropy_with_grad(logits: mx.array, targets: mx.array, weights: mx.array) -> tuple[mx.array, ...]:
    """(lse, picked) as `cross_entropy_rows` and dZ = w * (softmax(Z) - onehot(t)), in one pass over the logits;
    a row of weight 0 gives lse = picked = 0 and dZ = 0."""
    kernels = native(logits, weights)
    if kernels is not None:
        return kernels.cross_entropy_with_grad(logits, targets, weights)
    lse, picked = cross_entropy_rows(logits, targets)
    onehot = mx.arange(logits.shape[-1]) == targets.astype(mx.int32)[..., None]
    used = weights != 0
    d_logits = (mx.exp(logits.astype(mx.float32) - lse[..., None]) - onehot) * weights[..., None]
    return mx.where(used, lse, 0.0), mx.where(used, picked, 0.0), d_logits


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up (mlx-lm's `swiglu`); differentiable in both arguments."""
    kernels = native(gate, up) if gate.shape == up.shape else None
    if kernels is not None:
        return kernels.swiglu(gate, up)
    return nn.silu(gate) * up


__all__ = ["cross_entropy_rows", "cross_entropy_with_grad", "native", "softmax_rows", "softmax_rows_grad", "swiglu"]
