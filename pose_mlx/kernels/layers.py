"""RMSNorm and the rotary embedding at explicit positions: one pass each way on the CPU, MLX ops elsewhere.

MLX's CPU backend computes both from several element-wise operations and reductions, each a pass over memory on
one thread; the C++ primitives of `cpu_layers.cpp` do each in one pass, rows split over threads (float32 on the
CPU where the kernels are built). Both implementations compute, to float32 rounding:

    rms_norm(x, w, eps) = x / sqrt(mean(x^2) + eps) * w          (that of `mx.fast.rms_norm`, rows of N)
    rotate(x, cos, sin, dims, traditional, scale): each pair (a, b) of the first `dims` features of x (B, H, L, D)
        -> (s a cos - s b sin, s a sin + s b cos), s = scale; pairs (x_i, x_{i + dims/2}), or (x_{2i}, x_{2i+1})
        when `traditional`; cos and sin (L, dims/2), or (B, L, dims/2) per row of the batch
"""

from __future__ import annotations

import mlx.core as mx

from . import rows


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    kernels = rows.native(x, weight)
    if kernels is None:
        return mx.fast.rms_norm(x, weight, eps)
    return kernels.rms_norm(x, weight, float(eps))


def norm_call(original):
    """A call for `nn.RMSNorm` computing through `rms_norm` (`original`, its own call, is not needed)."""

    def call(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)

    return call


def rotate(x: mx.array, cos: mx.array, sin: mx.array, dims: int, traditional: bool, scale: float = 1.0) -> mx.array:
    kernels = rows.native(x, cos, sin)
    if kernels is not None and x.ndim == 4:
        return kernels.rope(x, cos, sin, dims, traditional, float(scale))
    if cos.ndim == 3:  # per row of the batch: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    half = dims // 2
    rot = x[..., :dims].astype(mx.float32)
    if scale != 1.0:
        rot = rot * scale
    if traditional:
        pairs = rot.reshape(*rot.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    out = out.astype(x.dtype)
    if dims < x.shape[-1]:
        out = mx.concatenate([out, x[..., dims:]], axis=-1)
    return out


__all__ = ["norm_call", "rms_norm", "rotate"]
