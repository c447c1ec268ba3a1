"""Rotary-angle histograms, KL disturbance and DPRoPE factors (seed 002). Runtime ~2 s."""

import numpy as np
import pytest

from pose_mlx.analysis import angle_histograms, disturbances, dprope_factors, kl_divergence, rope_inv_freq


def _loop_histogram(inv_freq, length, bins):
    out = np.zeros((len(inv_freq), bins))
    for i, theta in enumerate(inv_freq):
        angles = np.mod(np.arange(length) * theta, 2 * np.pi)
        out[i] = np.histogram(angles, bins=bins, range=(0, 2 * np.pi))[0] / length
    return out


def test_histogram_matches_numpy_histogram():
    inv_freq = rope_inv_freq(16, 500.0)
    got = angle_histograms(inv_freq, 3000, bins=36)
    np.testing.assert_allclose(got, _loop_histogram(inv_freq, 3000, 36), atol=2 / 3000)  # edge ties only
    np.testing.assert_allclose(got.sum(axis=1), 1.0)


def test_histogram_known_cases():
    # theta = 2*pi/8 with 8 bins: each position lands in its own bin, periodically
    h = angle_histograms([2 * np.pi / 8 + 1e-12], 80, bins=8)
    np.testing.assert_allclose(h, np.full((1, 8), 1 / 8))
    # tiny theta: all angles stay in bin 0
    assert angle_histograms([1e-9], 1000, bins=10)[0, 0] == 1.0


def test_kl_direction_and_smoothing():
    p_ext = np.array([[0.5, 0.5, 0.0]])
    p_pre = np.array([[1.0, 0.0, 0.0]])
    q = np.array([1.0, 1e-10, 1e-10]) / (1 + 2e-10)
    expected = 0.5 * np.log(0.5 / q[0]) + 0.5 * np.log(0.5 / q[1])
    assert kl_divergence(p_ext, p_pre)[0] == pytest.approx(expected)
    assert kl_divergence(p_pre, p_ext)[0] == pytest.approx(np.log(2))  # reverse direction differs
    assert kl_divergence(p_pre, p_pre)[0] == pytest.approx(0.0, abs=1e-9)


def test_dprope_rule_against_independent_kl():
    d, base, lc, lt = 16, 1e4, 256, 2048
    theta = base ** (-np.arange(0, d, 2) / d)
    s = lt / lc
    pre = _loop_histogram(theta, lc, 90)

    def kl(p, q):
        q = np.where(q > 0, q, 1e-10)
        q = q / q.sum(axis=1, keepdims=True)
        return np.array([sum(a * np.log(a / b) for a, b in zip(pr, qr) if a > 0) for pr, qr in zip(p, q)])

    d_ext = kl(_loop_histogram(theta, lt, 90), pre)
    d_int = kl(_loop_histogram(theta / s, lt, 90), pre)
    expected = np.where(d_ext <= d_int, 1.0, s)
    got = dprope_factors(d, base, lc, lt, bins=90)
    assert set(np.unique(got)) <= {1.0, s}
    np.testing.assert_array_equal(got, expected)


def test_dprope_extremes_paper_setting():
    f = dprope_factors(128, 1e4, 4096, 131072)
    assert f.shape == (64,)
    assert f[0] == 1.0  # wavelength 2*pi << Lc: extrapolation keeps the angle distribution uniform
    assert f[-1] == 32.0  # wavelength > Lt: only interpolation stays inside the pre-trained angles


def test_disturbances_extra_candidates():
    theta = rope_inv_freq(8, 1e4)
    out = disturbances({"same": theta}, theta, 512, 512)
    np.testing.assert_allclose(out["same"], 0.0, atol=1e-7)  # only the eps renormalisation


def test_bad_arguments():
    with pytest.raises(ValueError, match="inv_freq"):
        angle_histograms(np.zeros((2, 2)), 10)
    with pytest.raises(ValueError, match="length"):
        angle_histograms([0.1], 0)
    with pytest.raises(ValueError, match="bins"):
        angle_histograms([0.1], 10, bins=0)
    with pytest.raises(ValueError, match="head_dim"):
        dprope_factors(7, 1e4, 10, 20)
    with pytest.raises(ValueError, match="target_length"):
        dprope_factors(8, 1e4, 20, 10)


@pytest.mark.parametrize("length,bins", [(131072, 360), (12345, 100), (1000, 7)])
def test_counting_equals_direct_binning(length, bins):
    """The block / edge-crossing counts equal binning every angle floor(m * theta * bins / 2pi) mod bins."""
    theta = rope_inv_freq(128, 1e4)
    m = np.arange(length, dtype=np.float64)
    direct = np.stack([np.bincount(np.floor(m * t * bins / (2 * np.pi)).astype(np.int64) % bins, minlength=bins)
                       for t in theta]) / length
    np.testing.assert_array_equal(angle_histograms(theta, length, bins), direct)


def test_zero_frequency_all_in_first_bin():
    np.testing.assert_array_equal(angle_histograms([0.0], 50, bins=4), [[1.0, 0, 0, 0]])
