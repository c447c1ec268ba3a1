"""A LoRA layer in two accumulating products: fewer passes over the activations, forward and backward.

mlx-lm's `LoRALinear` computes y = x W^T (+ b), z = (x A) B, then s * z, then y + s z: two passes over an (L, out)
array beside the products, and in its gradient two more (s * dy, and the sum of the base's and the adapter's
input gradients). On MLX's CPU backend those passes run on one thread and cost more than the adapter's products
(about 40 ms per SmolLM2-135M block at 1,024 tokens). `lora_linear` computes the same function as

    h = x A,   y = addmm(x W^T (+ b), h, s B)                       (s folded into the r x out matrix B)

and its vector-Jacobian product, keeping h from the forward pass, as

    g = dy (s B)^T,   dA = x^T g,   dB = s h^T dy,   dx = addmm(dy W, g, A^T)   (and dW = dy^T x, db = sum dy)

so that no (L, out) or (L, in) array is passed over outside a product. Exact to float32 rounding.

`fused_call` is what `kernels.route.training_route` binds as `LoRALinear.__call__` on the CPU: `lora_linear` for a
float32 layer over an unquantized `nn.Linear` (with dropout at work, the adapter's product accumulated into the
base's by autodiff's own VJP), and mlx-lm's own call for every other layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def _rows(x: mx.array) -> mx.array:
    return x.reshape(-1, x.shape[-1])


@mx.custom_function
def _lora(x, weight, lora_a, lora_b, *bias, scale: float):
    h = x @ lora_a
    base = mx.addmm(bias[0], x, weight.T) if bias else x @ weight.T
    return mx.addmm(base, h, lora_b * scale), h


@_lora.vjp
def _lora_vjp(primals, cotangents, outputs, *, scale: float):
    x, weight, lora_a, lora_b, *bias = primals
    dy, h = cotangents[0], outputs[1]
    g = dy @ (lora_b * scale).T
    d_x = mx.addmm(dy @ weight, g, lora_a.T)
    d_a = (_rows(g).T @ _rows(x)).T  # (r, in) then transposed: MKL packs nothing of x for an r-row product
    d_b = (_rows(h).T @ _rows(dy)) * scale
    d_bias = [_rows(dy).sum(axis=0)] if bias else []
    return (d_x, _rows(dy).T @ _rows(x), d_a, d_b, *d_bias)


def lora_linear(x: mx.array, weight: mx.array, lora_a: mx.array, lora_b: mx.array, scale: float,
                bias: mx.array | None = None) -> mx.array:
    """x W^T (+ bias) + scale * (x A) B, for x (..., in), W (out, in), A (in, r), B (r, out); differentiable."""
    extra = (bias,) if bias is not None else ()
    return _lora(x, weight, lora_a, lora_b, *extra, scale=float(scale))[0]


def _applies(layer, x: mx.array) -> bool:
    base = layer.linear
    if type(base) is not nn.Linear:
        return False
    arrays = [x, base.weight, layer.lora_a, layer.lora_b] + ([base.bias] if "bias" in base else [])
    return all(a.dtype == mx.float32 for a in arrays)


def fused_call(original):
    """`LoRALinear.__call__` through `lora_linear` where it applies (module docstring), else `original`."""

    def call(layer, x):
        if not _applies(layer, x):
            return original(layer, x)
        base, dropped = layer.linear, layer.dropout(x)
        if dropped is not x:  # dropout at work: the adapter reads another input than the base
            return mx.addmm(base(x), dropped @ layer.lora_a, layer.lora_b * layer.scale)
        return lora_linear(x, base.weight, layer.lora_a, layer.lora_b, layer.scale,
                           base.bias if "bias" in base else None)

    return call


__all__ = ["fused_call", "lora_linear"]
