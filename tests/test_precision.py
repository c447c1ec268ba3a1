"""The suite's precision settings (tests/conftest.py, tests/_precision.py) hold on the backend running it."""

import os

import numpy as np
import pytest

import mlx.core as mx

from _precision import UNIT_ROUNDOFF, logit_tolerance, tf32_active, unit_roundoff
from conftest import on_cpu


def test_float32_matrix_products_are_float32_on_this_backend():
    """1 + k 2^-20 needs 20 mantissa bits: TF32 (10 bits) would round every entry of A to 1.0 before multiplying.
    With TF32 off, A @ I and I @ A are A exactly on every backend (one nonzero product per output)."""
    k = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) % 7 + 1
    a = 1.0 + k * np.float32(2.0**-20)
    assert len(np.unique(a)) == 7
    eye = mx.eye(64, dtype=mx.float32)
    np.testing.assert_array_equal(np.array(mx.array(a) @ eye), a)
    np.testing.assert_array_equal(np.array(eye @ mx.array(a)), a)
    assert os.environ["MLX_ENABLE_TF32"] == "0" and not tf32_active()


def test_unit_roundoff_follows_the_tf32_switch(monkeypatch):
    assert unit_roundoff(mx.float32) == 2.0**-24
    assert (unit_roundoff(mx.float16), unit_roundoff(mx.bfloat16)) == (2.0**-11, 2.0**-8)
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")  # what MLX would do without the suite's setting
    assert tf32_active() == (not on_cpu())
    assert unit_roundoff(mx.float32) == (2.0**-24 if on_cpu() else 2.0**-11)


def test_logit_tolerance_scales_with_the_dtype_and_the_logits():
    reference = np.array([[0.5, -4.0, 2.0]])
    assert logit_tolerance(mx.float16, reference) == 8 * 2.0**-11 * 4.0
    assert logit_tolerance(mx.bfloat16, 10 * reference) == 8 * 2.0**-8 * 40.0
    assert set(UNIT_ROUNDOFF) == {mx.float32, mx.float16, mx.bfloat16}
    with pytest.raises(ValueError, match="16-bit"):  # float32 comparisons keep their own bounds
        logit_tolerance(mx.float32, reference)
