"""Frequency schedules (pose_mlx.rope) against independent formulas, hand values, limits and mlx-lm's own ropes."""

import math
import subprocess
import sys

import numpy as np
import pytest

from pose_mlx.rope import SCHEDULES, dynamic_ntk_base, scaled_inv_freq, schedule_parameters

import mlx.core as mx  # noqa: E402
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE  # noqa: E402

ALL = ["none", "linear", "ntk", "dynamic", "yarn", "abf", "llama3", "longrope", "dprope"]
# (head_dim, base, factor, original_length): Llama-2-like, the simulator's tiny model, a large-base model,
# a case where the YaRN correction dims coincide (min == max guard) and one where they are clipped to d - 1.
CASES = [(128, 1e4, 8.0, 4096), (32, 312.0, 8.0, 128), (64, 5e5, 4.0, 8192), (8, 1e4, 2.0, 6), (8, 100.0, 3.0, 10**9)]


def theta(d, base):
    return np.array([base ** (-2.0 * i / d) for i in range(d // 2)])


def hf_yarn_gamma(d, base, length, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """Extrapolation weight per dim from the YaRN correction-dim ramp, written out from the HF description."""
    def dim_of(rot):
        return d * math.log(length / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi = hi + 0.001
    return np.array([1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(d // 2)])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_extends_and_takes_exactly_its_parameters(name):
    """Each registered schedule is documented, slows no frequency down by more than s nor speeds one up
    (theta / s <= theta' <= theta), accepts its declared parameters at their defaults and refuses others."""
    d, base, s, length = 64, 1e4, 4.0, 512
    fn_doc = SCHEDULES[name].__doc__
    assert fn_doc and len(fn_doc.split()) > 5
    params = schedule_parameters(name)
    inv, att = scaled_inv_freq(name, d, base, s, length, **params)
    th = theta(d, base)
    assert np.all(np.isfinite(inv)) and att >= 1.0
    lower = th / s if name != "abf" else th / 50.0 ** 1  # ABF lowers frequencies by its own beta, not by s
    if name in ("ntk", "dynamic"):
        lower = th / s ** (d / (d - 2))
    assert np.all(inv <= th * (1 + 1e-12)) and np.all(inv >= lower * (1 - 1e-12)), name
    with pytest.raises(ValueError, match="unknown parameter"):
        scaled_inv_freq(name, d, base, s, length, not_a_parameter=1)


@pytest.mark.parametrize("method", [m for m in ALL if m != "dprope"])  # dprope: see its own test
def test_factor_one_is_identity(method):
    for d, base, _, length in CASES[:3]:
        inv, att = scaled_inv_freq(method, d, base, 1.0, length)
        assert inv.dtype == np.float64 and inv.shape == (d // 2,)
        np.testing.assert_allclose(inv, theta(d, base), rtol=1e-12)
        assert att == 1.0


def test_none_and_linear():
    d, base, s, length = CASES[0]
    inv, att = scaled_inv_freq("none", d, base, s, length)
    np.testing.assert_allclose(inv, theta(d, base), rtol=1e-12)
    assert att == 1.0
    inv, att = scaled_inv_freq("linear", d, base, s, length)
    # PI: angle at position m equals the unscaled angle at position m / s.
    m = np.arange(0, 32768, 977.0)
    np.testing.assert_allclose(np.outer(m, inv), np.outer(m / s, theta(d, base)), rtol=1e-12)
    assert att == 1.0


def test_ntk_base_hand_value():
    # 1e4 * 8 ** (128/126) = 1e4 * 8 * exp(ln 8 / 63) = 82,684.6 (computed by hand to 5 digits).
    inv, att = scaled_inv_freq("ntk", 128, 1e4, 8.0, 4096)
    new_base = inv[1] ** (-64.0)  # theta_1 = base' ** (-2/128)
    assert new_base == pytest.approx(82_685, abs=1.0)
    assert inv[0] == 1.0 and att == 1.0
    # The lowest frequency is interpolated exactly by s (the reason for the exponent d/(d-2)).
    assert inv[-1] == pytest.approx(theta(128, 1e4)[-1] / 8.0, rel=1e-12)
    # Every other dim lies between extrapolation and interpolation.
    th = theta(128, 1e4)
    assert np.all(inv[1:-1] < th[1:-1]) and np.all(inv[1:-1] > th[1:-1] / 8.0)


def test_dynamic_base_rule_and_static_frequencies():
    d, base, s, length = 128, 1e4, 8.0, 4096
    assert dynamic_ntk_base(base, d, s, length, 100) == base
    assert dynamic_ntk_base(base, d, s, length, length) == base
    # One past the original length: base * (1 + s / L) ** (d/(d-2)), barely above base.
    assert dynamic_ntk_base(base, d, s, length, length + 1) == pytest.approx(base * (1 + s / length) ** (128 / 126))
    # At s * L tokens: ratio s*s - s + 1 = 57.
    assert dynamic_ntk_base(base, d, s, length, int(s * length)) == pytest.approx(base * 57 ** (128 / 126))
    grow = [dynamic_ntk_base(base, d, s, length, n) for n in range(length, 4 * length, 512)]
    assert np.all(np.diff(grow) > 0)
    inv_dyn, att = scaled_inv_freq("dynamic", d, base, s, length)
    inv_ntk, _ = scaled_inv_freq("ntk", d, base, s, length)
    np.testing.assert_array_equal(inv_dyn, inv_ntk)
    assert att == 1.0


@pytest.mark.parametrize("d, base, s, length", CASES)
def test_yarn_matches_independent_formula_and_mlx_lm(d, base, s, length):
    th = theta(d, base)
    for truncate in (True, False):
        g = hf_yarn_gamma(d, base, length, truncate=truncate)
        inv, att = scaled_inv_freq("yarn", d, base, s, length, truncate=truncate)
        np.testing.assert_allclose(inv, (1 - g) * th / s + g * th, rtol=1e-12)
        assert att == pytest.approx(0.1 * math.log(s) + 1)
        inv_w, att_w = scaled_inv_freq("yarn", d, base, s, length, truncate=truncate, blend="wavelength")
        np.testing.assert_allclose(inv_w, th / ((1 - g) * s + g), rtol=1e-12)
        assert att_w == att
    ours, att = scaled_inv_freq("yarn", d, base, s, length)
    rope = YarnRoPE(d, base=base, scaling_factor=s, original_max_position_embeddings=length,
                    max_position_embeddings=int(s * length))
    theirs = 1.0 / np.array(rope._freqs.astype(mx.float32), dtype=np.float64)
    np.testing.assert_allclose(ours, theirs, rtol=2e-6)
    assert att == pytest.approx(rope.mscale, rel=1e-12)


def test_yarn_ramp_endpoints_follow_rotation_counts():
    """Untruncated YaRN: dims turning >= beta_fast times in L extrapolate, <= beta_slow times interpolate."""
    d, base, s, length = 128, 1e4, 16.0, 4096
    th = theta(d, base)
    rotations = length * th / (2 * math.pi)
    inv, _ = scaled_inv_freq("yarn", d, base, s, length, truncate=False)
    fast, slow = rotations >= 32, rotations <= 1
    assert fast.any() and slow.any()
    np.testing.assert_allclose(inv[fast], th[fast], rtol=1e-12)
    np.testing.assert_allclose(inv[slow], th[slow] / s, rtol=1e-12)
    ratio = inv / th  # extrapolation weight mapped to [1/s, 1], non-increasing with the dim index
    assert np.all(np.diff(ratio) <= 1e-15)


def test_yarn_attention_factor_params():
    s = 8.0
    _, att = scaled_inv_freq("yarn", 64, 1e4, s, 2048, mscale=0.5)
    assert att == pytest.approx(0.05 * math.log(s) + 1)
    _, att = scaled_inv_freq("yarn", 64, 1e4, s, 2048, attention_factor=1.25)
    assert att == 1.25
    rope = YarnRoPE(64, base=1e4, scaling_factor=s, original_max_position_embeddings=2048, mscale=0.5)
    assert scaled_inv_freq("yarn", 64, 1e4, s, 2048, mscale=0.5)[1] == pytest.approx(rope.mscale)


def test_abf_default_and_beta():
    d, base = 128, 1e4
    inv, att = scaled_inv_freq("abf", d, base, 4.0, 4096)
    np.testing.assert_allclose(inv, theta(d, base * 50), rtol=1e-12)  # Xiong et al. (arXiv 2309.16039) train with beta = 50
    assert att == 1.0
    inv, _ = scaled_inv_freq("abf", d, base, 4.0, 4096, beta=2.5)
    np.testing.assert_allclose(inv, theta(d, 25_000.0), rtol=1e-12)
    inv, _ = scaled_inv_freq("abf", d, base, 1.0, 4096, beta=2.5)  # an explicit beta applies even at s = 1
    np.testing.assert_allclose(inv, theta(d, 25_000.0), rtol=1e-12)


def llama3_reference(d, base, s, length, low=1.0, high=4.0):
    out = []
    for t in theta(d, base):
        wavelength = 2 * math.pi / t
        if wavelength < length / high:
            out.append(t)
        elif wavelength > length / low:
            out.append(t / s)
        else:
            smooth = (length / wavelength - low) / (high - low)
            out.append((1 - smooth) * t / s + smooth * t)
    return np.array(out)


@pytest.mark.parametrize("d, base, s, length", [(128, 5e5, 8.0, 8192), (32, 312.0, 8.0, 128), (64, 1e4, 4.0, 2048)])
def test_llama3_matches_reference_and_mlx_lm(d, base, s, length):
    ours, att = scaled_inv_freq("llama3", d, base, s, length)
    np.testing.assert_allclose(ours, llama3_reference(d, base, s, length), rtol=1e-12)
    assert att == 1.0
    rope = Llama3RoPE(d, max_position_embeddings=int(s * length), base=base,
                      scaling_config={"factor": s, "original_max_position_embeddings": length,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    np.testing.assert_allclose(ours, 1.0 / np.array(rope._freqs.astype(mx.float32), dtype=np.float64), rtol=2e-6)
    mid = scaled_inv_freq("llama3", d, base, s, length, low_freq_factor=2.0, high_freq_factor=8.0)[0]
    np.testing.assert_allclose(mid, llama3_reference(d, base, s, length, 2.0, 8.0), rtol=1e-12)


def test_longrope_matches_mlx_lm():
    d, base, s, length = 96, 1e4, 32.0, 4096
    lam = np.random.default_rng(0).uniform(1.0, s, d // 2)
    ours, att = scaled_inv_freq("longrope", d, base, s, length, long_factor=list(lam))
    np.testing.assert_allclose(ours, theta(d, base) / lam, rtol=1e-12)
    assert att == pytest.approx(math.sqrt(1 + math.log(s) / math.log(length)))
    rope = SuScaledRoPE(d, base=base, max_position_embeddings=int(s * length),
                        original_max_position_embeddings=length, long_factor=list(lam))
    np.testing.assert_allclose(ours, 1.0 / np.array(rope._freqs, dtype=np.float64), rtol=2e-6)
    assert att == pytest.approx(rope._scale, rel=1e-6)
    default, _ = scaled_inv_freq("longrope", d, base, s, length)
    np.testing.assert_allclose(default, theta(d, base) / s, rtol=1e-12)
    assert scaled_inv_freq("longrope", d, base, s, length, attention_factor=1.0)[1] == 1.0


def test_dprope_chooses_interpolation_or_extrapolation_per_dim():
    d, base, s, length = 64, 1e4, 4.0, 512
    th = theta(d, base)
    inv, att = scaled_inv_freq("dprope", d, base, s, length)
    assert inv.shape == (d // 2,) and att == 1.0
    is_extra, is_inter = np.isclose(inv, th, rtol=1e-12), np.isclose(inv, th / s, rtol=1e-12)
    assert np.all(is_extra | is_inter)
    assert is_extra[0] and is_inter[-1]  # highest frequency extrapolates, lowest interpolates
    one, _ = scaled_inv_freq("dprope", d, base, 1.0, length, bins=90)
    np.testing.assert_allclose(one, th, rtol=1e-12)


@pytest.mark.parametrize("call, word", [
    (lambda: scaled_inv_freq("rope2", 64, 1e4, 2.0, 512), "linear, ntk"),
    (lambda: scaled_inv_freq("linear", 64, 1e4, 0.5, 512), "factor"),
    (lambda: scaled_inv_freq("linear", 63, 1e4, 2.0, 512), "head_dim"),
    (lambda: scaled_inv_freq("linear", 64, 1.0, 2.0, 512), "base"),
    (lambda: scaled_inv_freq("linear", 64, 1e4, 2.0, 0), "original_length"),
    (lambda: scaled_inv_freq("linear", 64, 1e4, 2.0, 512, beta=3.0), "beta"),
    (lambda: scaled_inv_freq("yarn", 64, 1e4, 2.0, 512, beta_fast=0.5), "beta_fast"),
    (lambda: scaled_inv_freq("yarn", 64, 1e4, 2.0, 512, blend="cos"), "blend"),
    (lambda: scaled_inv_freq("yarn", 64, 1e4, 2.0, 512, mscal=1.0), "mscal"),
    (lambda: scaled_inv_freq("abf", 64, 1e4, 2.0, 512, beta=-1.0), "beta"),
    (lambda: scaled_inv_freq("llama3", 64, 1e4, 2.0, 512, low_freq_factor=5.0), "low_freq_factor"),
    (lambda: scaled_inv_freq("longrope", 64, 1e4, 2.0, 512, long_factor=[2.0] * 31), "long_factor"),
    (lambda: scaled_inv_freq("ntk", 2, 1e4, 2.0, 512), "head_dim"),
])
def test_bad_arguments_name_the_argument(call, word):
    with pytest.raises(ValueError, match=word):
        call()


def test_module_does_not_import_mlx():
    code = "import sys, pose_mlx.rope; sys.exit(int(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
