"""Granularity constants of PI vs ABF (Xiong et al., arXiv 2309.16039, Theorem 1). Runtime < 1 s."""

import numpy as np
import pytest

from pose_mlx.analysis import (granularity_constant, granularity_limit, helix, limit_bounds, sine_similarity,
                               theorem1_bounds)


def test_paper_numbers():
    assert granularity_limit(1e4, alpha=0.25) == pytest.approx(0.027, abs=5e-4)
    assert granularity_limit(1e4, beta=50) == pytest.approx(0.076, abs=5e-4)
    # the mean over d/2 pairs approaches these numbers (PI: alpha << 1 makes the approximation tight)
    assert granularity_constant(1 << 16, 1e4, alpha=0.25) == pytest.approx(0.25 / np.log(1e4), rel=0.01)


def test_mean_normalisation():
    d, b, a = 128, 1e4, 0.25
    raw = sum(np.sin(a * b ** (-2 * j / d)) for j in range(d // 2))
    assert granularity_constant(d, b, alpha=a) == pytest.approx(raw / (d // 2))


@pytest.mark.parametrize("kwargs", [{"alpha": 0.25}, {"alpha": 0.125}, {"beta": 50.0}])
def test_limit_approached_and_inside_bounds(kwargs):
    lo, hi = limit_bounds(1e4, **kwargs)
    errors = []
    for d in (64, 512, 4096, 1 << 16):
        c = granularity_constant(d, 1e4, **kwargs)
        errors.append(abs(c - 0.5 * (lo + hi)))
    big = granularity_constant(1 << 16, 1e4, **kwargs)
    assert lo <= big <= hi
    assert errors[-1] < errors[0]


def test_theorem1_bounds_random_x():
    rng = np.random.default_rng(0)
    for _ in range(200):
        d = int(rng.choice([8, 64, 128]))
        x = rng.normal(size=d) * rng.uniform(0.1, 3, size=d)
        for kw in ({"alpha": 0.25}, {"beta": 50.0}):
            s = sine_similarity(x, d, 1e4, **kw)
            lo, hi = theorem1_bounds(x, d, 1e4, **kw)
            assert lo - 1e-12 <= s <= hi + 1e-12


def test_paper_literal_upper_bound_fails_recorded():
    """The paper's Theorem 1 uses max_k x_k^2 * sum_j sin(omega_j) (no factor 2 for the pair x_2j^2 + x_2j+1^2).
    With all x_k equal the similarity is exactly twice that bound's upper value: the literal statement fails."""
    d, b = 128, 1e4
    x = np.ones(d)
    raw = sum(np.sin(0.25 * b ** (-2 * j / d)) for j in range(d // 2))
    paper_upper = 1.0 / d * raw
    s = sine_similarity(x, d, b, alpha=0.25)
    assert s == pytest.approx(2 * paper_upper)
    assert s > paper_upper
    assert theorem1_bounds(x, d, b, alpha=0.25) == pytest.approx((s, s))


def test_sine_similarity_is_angle_between_images():
    # direct computation from the complex embedding f(x, t)_j = (x_2j + i x_2j+1) e^{i omega_j t}
    rng = np.random.default_rng(1)
    d, b, a = 16, 1e4, 0.25
    x = rng.normal(size=d)
    omega = a * b ** (-2 * np.arange(d // 2) / d)
    z = x[0::2] + 1j * x[1::2]
    f0, f1 = z * np.exp(1j * omega * 3), z * np.exp(1j * omega * 4)
    expected = np.imag(np.vdot(f0, f1)) / (np.linalg.norm(f0) * np.linalg.norm(f1))
    assert sine_similarity(x, d, b, alpha=a) == pytest.approx(expected)


def test_helix_and_errors():
    h = helix([0.0, np.pi / 2], a=2.0)
    np.testing.assert_allclose(h, [[1, 0, 0], [0, 1, 0]], atol=1e-12)
    with pytest.raises(ValueError, match=r"^give exactly one of alpha \(PI\) or beta \(ABF\)$"):
        granularity_constant(128, 1e4)
    with pytest.raises(ValueError, match="head_dim"):
        granularity_constant(127, 1e4, alpha=0.5)
