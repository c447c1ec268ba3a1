"""PI's interpolation bound and the extrapolation sum B(s) (Chen et al., arXiv 2306.15595, Theorem 2.1). Runtime < 1 s."""

import numpy as np
import pytest

from pose_mlx.analysis import attention_score, extrapolation_sum, interpolation_bound, interpolation_denominator


def test_denominator_paper_value():
    assert round(interpolation_denominator(1e4), 2) == 294.73
    assert 32 * np.log(1e4) == pytest.approx(interpolation_denominator())


def test_interpolation_bound_holds_for_random_h():
    rng = np.random.default_rng(0)
    d = 64
    for _ in range(50):
        h = rng.normal(size=d // 2) + 1j * rng.normal(size=d // 2)
        s1 = float(rng.integers(0, 3000))
        s = s1 + rng.uniform(0, 1, size=20)
        a1, a2 = attention_score(s1, h), attention_score(s1 + 1, h)
        lam = s - s1
        err = np.abs(attention_score(s, h) - ((1 - lam) * a1 + lam * a2))
        assert np.all(err <= interpolation_bound(s, d, 1e4, h_max=np.abs(h).max()) + 1e-12)
    assert interpolation_bound(2.5, 4096) == pytest.approx(4096 / 294.73, rel=1e-4)


def test_extrapolation_sum_formula_and_bound():
    d, s = 8, 3.7
    theta = 1e4 ** (-np.arange(0, d, 2) / d)
    expected = sum(abs(sum(np.exp(1j * s * theta[:k + 1]))) for k in range(d // 2))
    assert extrapolation_sum(s, d) == pytest.approx(expected)
    rng = np.random.default_rng(2)
    h = rng.normal(size=d // 2)
    ss = np.linspace(0, 5000, 1001)
    assert np.all(np.abs(attention_score(ss, h)) <= 2 * np.abs(h).max() * extrapolation_sum(ss, d) + 1e-9)


def test_paper_claim_b_at_least_d_is_recorded():
    """The paper says B(s) >= d numerically. For d = 128, c = 1e4 it holds on [0, 4500] but FAILS at larger s:
    on a 0.1 grid the first violation is s = 4505.7 and the minimum over [0, 20000] is ~84.8 (< 128)."""
    d = 128
    s = np.arange(0, 20000, 0.1)
    b = extrapolation_sum(s, d)
    assert np.all(b[s <= 4500] >= d)
    bad = s[b < d]
    assert bad.size > 0
    assert bad[0] == pytest.approx(4505.7, abs=0.05)
    assert 80 < b.min() < 90
    assert extrapolation_sum(0.0, d) == pytest.approx((d // 2) * (d // 2 + 1) / 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="s must"):
        interpolation_bound(3.0, 128, s1=4.0, s2=5.0)
    with pytest.raises(ValueError, match="head_dim"):
        extrapolation_sum(1.0, 7)
