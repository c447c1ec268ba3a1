"""Rotary-angle histograms, KL disturbance and DPRoPE factors (Wu et al., arXiv 2410.01490). Runtime ~2 s."""

import numpy as np
import pytest

from pose_mlx.analysis import angle_histograms, disturbances, dprope_factors, floored, kl_divergence, rope_inv_freq


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


def test_kl_hand_values_and_floor():
    """KL(p || q) by hand; the floor makes an empty bin 2^-14 / L instead of 0."""
    p = np.array([[0.5, 0.5]])
    q = np.array([[0.25, 0.75]])
    assert kl_divergence(p, q)[0] == pytest.approx(0.5 * np.log(2) + 0.5 * np.log(2 / 3))
    assert kl_divergence(p, p)[0] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="positive"):
        kl_divergence(np.array([[1.0, 0.0]]), p)
    np.testing.assert_allclose(floored(np.array([[1.0, 0.0]]), 100), [[1.0 + 2.0**-14 / 100, 2.0**-14 / 100]])


def test_dprope_rule_against_independent_kl():
    """The authors' rule: per dimension, KL(P_pre || P_candidate) with every bin's count starting at 2^-14,
    extrapolation unless interpolation's divergence is strictly smaller."""
    d, base, lc, lt = 16, 1e4, 256, 2048
    theta = base ** (-np.arange(0, d, 2) / d)
    s = lt / lc
    tiny = 2.0 ** -14

    def dist(inv_freq, length):
        counts = np.full((len(inv_freq), 90), tiny)
        for i, t in enumerate(inv_freq):
            for m in range(length):
                counts[i, int(np.floor((m * t) % (2 * np.pi) * 90 / (2 * np.pi))) % 90] += 1
        return counts / length

    def kl(p, q):
        return np.array([sum(a * np.log(a / b) for a, b in zip(pr, qr)) for pr, qr in zip(p, q)])

    pre = dist(theta, lc)
    d_ext, d_int = kl(pre, dist(theta, lt)), kl(pre, dist(theta / s, lt))
    expected = np.where(d_ext <= d_int, 1.0, s)
    got = dprope_factors(theta, lc, lt, bins=90)
    assert set(np.unique(got)) <= {1.0, s}
    np.testing.assert_array_equal(got, expected)


def test_dprope_direction_matters_at_d64_2k_to_16k():
    """The reverse divergence, KL(P_candidate || P_pre), picks differently on some dimensions of this setting, so
    the direction is not a detail (the authors' code measures KL(P_pre || P_candidate))."""
    theta = rope_inv_freq(64, 1e4)
    got = dprope_factors(theta, 2048, 16384)
    pre = floored(angle_histograms(theta, 2048), 2048)
    ext, inter = floored(angle_histograms(theta, 16384), 16384), floored(angle_histograms(theta / 8, 16384), 16384)
    reverse = np.where(kl_divergence(ext, pre) <= kl_divergence(inter, pre), 1.0, 8.0)
    assert 0 < np.sum(reverse != got) < 32


def test_dprope_extremes_paper_setting():
    f = dprope_factors(rope_inv_freq(128, 1e4), 4096, 131072)
    assert f.shape == (64,)
    assert f[0] == 1.0  # wavelength 2*pi << Lc: extrapolation keeps the angle distribution uniform
    assert f[-1] == 32.0  # wavelength > Lt: only interpolation stays inside the pre-trained angles


def test_disturbances_extra_candidates():
    theta = rope_inv_freq(8, 1e4)
    out = disturbances({"same": theta, "ntk": rope_inv_freq(8, 4e4)}, theta, 512, 512)
    np.testing.assert_allclose(out["same"], 0.0, atol=1e-12)  # a distribution against itself
    assert np.all(out["ntk"][1:] > 0)  # a lower frequency reaches other angles


def test_bad_arguments():
    with pytest.raises(ValueError, match="inv_freq"):
        angle_histograms(np.zeros((2, 2)), 10)
    with pytest.raises(ValueError, match="length"):
        angle_histograms([0.1], 0)
    with pytest.raises(ValueError, match="bins"):
        angle_histograms([0.1], 10, bins=0)
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(7, 1e4)
    with pytest.raises(ValueError, match="target_length"):
        dprope_factors(rope_inv_freq(8, 1e4), 20, 10)


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
