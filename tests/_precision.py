"""The precision a comparison of model outputs may ask of MLX, per compute dtype and backend.

A forward pass rounds every product and activation to its compute dtype, so the logits of a model run in dtype d
differ from a float32 (or exact) reference of the same weights by a few unit roundoffs u(d) of the logits' scale:

    u(float32) = 2^-24,  u(float16) = 2^-11,  u(bfloat16) = 2^-8

except that float32 matrix products run as TF32 (u = 2^-11, float16's 10-bit mantissa) on a GPU with TF32 enabled
(CUDA, M5-class Metal). The suite turns TF32 off (tests/conftest.py sets MLX_ENABLE_TF32=0), so `unit_roundoff`
answers 2^-24 for float32 there; it reads the switch rather than assuming it.

`logit_tolerance(dtype, reference)` is REDUCED_ULPS x u(dtype) x max|reference| for float16/bfloat16: measured on
the 2-layer GGUF test models (hidden 64, logits up to 57) in the dtypes a GPU loads GGUF files in, against the
float32 reference, the largest error was 2.7e-3 of the scale with float16 and quantized layers (5.5 u), 9.8e-4
dequantized (2.0 u), 5.0e-3 with bfloat16 (1.3 u); 8 u covers each with margin and stays far below the
differences the tests must detect (the wrong RoPE layout, an unpermuted row: O(1) of the scale). float32
comparisons keep their own bounds (1e-4 and tighter), which no backend needs loosened with TF32 off.
"""

from __future__ import annotations

import os

import numpy as np

import mlx.core as mx

UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
REDUCED_ULPS = 8


def tf32_active() -> bool:
    """Whether float32 matrix products may run as TF32: off the CPU unless MLX_ENABLE_TF32=0."""
    return mx.default_device().type != mx.DeviceType.cpu and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def unit_roundoff(dtype) -> float:
    """Half the spacing of `dtype`'s numbers at 1, as MLX's matrix products on this backend deliver it."""
    if dtype == mx.float32 and tf32_active():
        return UNIT_ROUNDOFF[mx.float16]
    return UNIT_ROUNDOFF[dtype]


def logit_tolerance(dtype, reference) -> float:
    """Largest absolute difference allowed between logits computed in `dtype` (float16 or bfloat16) and the
    float32 `reference` logits of the same weights (see the module docstring for the measurement behind it)."""
    if dtype not in (mx.float16, mx.bfloat16):
        raise ValueError(f"logit_tolerance is for 16-bit compute dtypes, not {dtype}")
    return REDUCED_ULPS * unit_roundoff(dtype) * float(np.abs(np.asarray(reference)).max())
