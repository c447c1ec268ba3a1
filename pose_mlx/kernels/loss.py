"""The training loss over the vocabulary in row chunks: the float32 logits of a long row are never whole.

    loss = sum_t w_t * (log sum_j exp z_tj - z_t,y_t),   z_t = W h_t  (W the output head, vocab x hidden)

`chunked_cross_entropy(h, W, y, w)` computes it `sizes.chunk_rows(vocab)` rows at a time. Differentiated
(`gradient=True`), each chunk's logit gradient dz = w * (softmax(z) - onehot(y)) is formed while the chunk's
logits are at hand, in the same pass, and turned at once into dh = dz W (and dW = dz^T h when W is trained): the
loss is a scalar, so the backward only scales them by its cotangent and no logits are recomputed. Memory: one
chunk of logits (`sizes.CHUNK_BYTES`, 16 MB) instead of rows x vocab floats (1.6 GB at 8k rows and SmolLM2's
49,152 pieces), plus what MLX queues ahead.
"""

from __future__ import annotations

import mlx.core as mx

from . import rows, sizes

def _spans(n: int, size: int):
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _logits(hidden: mx.array, weight: mx.array) -> mx.array:
    return (hidden @ weight.T).astype(mx.float32)


def _forward(hidden, weight, targets, weights, chunk: int) -> mx.array:
    total = mx.array(0.0, mx.float32)
    for start, end in _spans(hidden.shape[0], chunk):
        h = mx.depends(hidden[start:end], total)  # one chunk after the other (MLX orders graphs breadth-first)
        lse, picked = rows.cross_entropy_rows(_logits(h, weight), targets[start:end])
        total = total + mx.sum(weights[start:end] * (lse - picked))
    return total


@mx.custom_function
def _with_gradients(hidden, weight, targets, weights, *, chunk: int, weight_grad: bool):
    total, d_hidden = mx.array(0.0, mx.float32), []
    d_weight = mx.zeros(weight.shape, mx.float32) if weight_grad else mx.zeros((1,), mx.float32)
    for start, end in _spans(hidden.shape[0], chunk):
        h = mx.depends(hidden[start:end], [total, *d_hidden[-1:], d_weight])  # one chunk after the other
        lse, picked, d_logits = rows.cross_entropy_with_grad(_logits(h, weight), targets[start:end],
                                                             weights[start:end])
        total = total + mx.sum(weights[start:end] * (lse - picked))
        d_logits = d_logits.astype(hidden.dtype)
        d_hidden.append(d_logits @ weight)
        if weight_grad:
            d_weight = d_weight + d_logits.T @ h
    return total, mx.concatenate(d_hidden), d_weight


@_with_gradients.vjp
def _with_gradients_vjp(primals, cotangents, outputs, *, chunk: int, weight_grad: bool):
    hidden, weight, targets, weights = primals
    scale = cotangents[0].astype(mx.float32)
    d_weight = (outputs[2] * scale).astype(weight.dtype) if weight_grad else mx.zeros_like(weight)
    return ((outputs[1] * scale).astype(hidden.dtype), d_weight, mx.zeros_like(targets), mx.zeros_like(weights))


def chunked_cross_entropy(hidden: mx.array, weight: mx.array, targets: mx.array, weights: mx.array,
                          gradient: bool = True, weight_grad: bool = False) -> mx.array:
    """sum_t weights_t * CE(hidden_t W^T, targets_t); hidden (..., d), targets and weights (...), W (vocab, d).

    `gradient` (default): differentiable (the gradients formed in the forward pass, see the module docstring),
    with respect to `hidden`, and to W too with `weight_grad`; False: a value only, not differentiable."""
    d = hidden.shape[-1]
    flat = (hidden.reshape(-1, d), weight, targets.reshape(-1), weights.reshape(-1).astype(mx.float32))
    chunk = sizes.chunk_rows(weight.shape[0])
    if not gradient:
        return _forward(*flat, chunk)
    return _with_gradients(*flat, chunk=chunk, weight_grad=weight_grad)[0]


__all__ = ["chunked_cross_entropy"]
