"""Coverage probability: exact vs Monte Carlo vs brute force; closed-form limits. Runtime ~3 s."""

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pose_mlx.analysis import coverage_monte_carlo, coverage_probability, examples_to_cover
from pose_mlx.analysis.coverage import sample_pose_batch


def _brute_force(window, target, chunks, first_max=None):
    """Exact coverage by walking every layout with explicit position sets (independent of the module)."""
    room = target - window
    out = np.zeros(target)

    def lengths_iter(rest, left, prob, acc):
        if left == 1:
            yield acc + [rest], prob
            return
        high = (first_max if first_max is not None and not acc else rest - (left - 1))
        for l in range(1, high + 1):
            yield from lengths_iter(rest - l, left - 1, prob / high, acc + [l])

    def biases_iter(left, prob, acc):
        if left == 0:
            yield acc, prob
            return
        lo = acc[-1] if first_max is None else 0
        for u in range(lo, room + 1):
            yield from biases_iter(left - 1, prob / (room - lo + 1), acc + [u])

    for lengths, pl in lengths_iter(window, chunks, 1.0, []):
        for biases, pb in biases_iter(chunks - 1, 1.0, [0]):
            starts = np.cumsum([0] + lengths[:-1])
            pos = np.concatenate([np.arange(l) + s + u for l, s, u in zip(lengths, starts, biases)])
            diffs = np.unique(np.abs(pos[:, None] - pos[None, :]))
            out[diffs] += pl * pb
    return out


@pytest.mark.parametrize("window,target,chunks", [(6, 15, 2), (7, 13, 3), (5, 9, 4), (8, 8, 2)])
def test_exact_matches_brute_force(window, target, chunks):
    np.testing.assert_allclose(coverage_probability(window, target, "pose", chunks),
                               _brute_force(window, target, chunks), atol=1e-12)


def test_pose_ref_matches_brute_force():
    np.testing.assert_allclose(coverage_probability(9, 20, "pose-ref"), _brute_force(9, 20, 2, first_max=5),
                               atol=1e-12)


@pytest.mark.parametrize("window,target,chunks,method", [(8, 20, 2, "pose"), (10, 30, 3, "pose"),
                                                         (6, 25, 4, "pose"), (12, 40, 2, "pose-ref")])
def test_monte_carlo_agrees_with_exact(window, target, chunks, method):
    exact = coverage_probability(window, target, method, chunks)
    mean, se = coverage_monte_carlo(window, target, method, chunks, samples=20_000, rng=1)
    inside = se > 0
    assert np.all(np.abs(mean - exact)[inside] <= 4 * se[inside] + 1e-12)
    np.testing.assert_allclose(mean[~inside], exact[~inside], atol=1e-9)


def test_randpos_monte_carlo_against_formula_and_brute_force():
    # distance target-1 needs positions 0 and target-1: P = C(Lt-2, Lc-2) / C(Lt, Lc) = Lc(Lc-1) / (Lt(Lt-1))
    window, target = 4, 12
    mean, se = coverage_monte_carlo(window, target, "randpos", samples=40_000, rng=3)
    p_last = window * (window - 1) / (target * (target - 1))
    assert abs(mean[-1] - p_last) <= 4 * se[-1]
    exact = np.zeros(target)
    subsets = list(itertools.combinations(range(target), window))
    for sub in subsets:
        a = np.array(sub)
        exact[np.unique(np.abs(a[:, None] - a[None, :]))] += 1 / len(subsets)
    assert np.all(np.abs(mean - exact)[se > 0] <= 4 * se[se > 0])


def test_one_chunk_and_baselines():
    q = coverage_probability(64, 300, "pose", chunks=1)
    assert np.all(q[:64] == 1) and np.all(q[64:] == 0)
    np.testing.assert_array_equal(coverage_probability(64, 300, "contiguous"), q)
    assert np.all(coverage_probability(64, 300, "full") == 1)


def test_paper_size_two_chunks_fast_and_sane():
    q = coverage_probability(2048, 16384, "pose", 2)
    assert q.shape == (16384,) and q[0] == 1 and np.all((q >= 0) & (q <= 1))
    # distance Lt-1 needs l_0 and u_1 at their extremes: u_1 = Lt-Lc, and r <= u_1 + Lc - 1 always holds
    room = 16384 - 2048
    assert q[-1] == pytest.approx(1 / (room + 1))


def test_examples_to_cover():
    n = examples_to_cover(np.array([1.0, 0.5, 0.1, 0.0]), p=0.9)
    assert n[0] == 1 and n[1] == 4 and n[2] == 22 and np.isinf(n[3])  # 0.5^4 < 0.1 <= 0.5^3; 0.9^22 < 0.1
    for p in (1.0, 0.0):
        with pytest.raises(ValueError, match=rf"^p must be in \(0, 1\), got {p}$"):
            examples_to_cover(np.ones(3), p=p)


def test_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        coverage_probability(10, 5)
    with pytest.raises(ValueError, match="chunks"):
        coverage_probability(10, 20, chunks=0)
    with pytest.raises(ValueError, match="sampler"):
        coverage_probability(10, 20, sampler="randpos")
    with pytest.raises(ValueError, match="coverage_monte_carlo"):
        coverage_probability(2048, 16384, chunks=3)


def test_batched_sampler_matches_layout_law():
    rng = np.random.default_rng(0)
    lengths, biases = sample_pose_batch(50_000, 10, 30, 3, rng)
    assert np.all(lengths.sum(axis=1) == 10) and np.all(lengths >= 1)
    assert np.all(np.diff(biases, axis=1) >= 0) and np.all(biases[:, -1] <= 20) and np.all(biases[:, 0] == 0)
    counts = np.bincount(lengths[:, 0], minlength=9)[1:]  # l_0 ~ U{1..8}
    assert np.all(np.abs(counts / 50_000 - 1 / 8) < 4 * np.sqrt(1 / 8 * 7 / 8 / 50_000))


def test_does_not_import_mlx():
    code = "import sys, pose_mlx.analysis; assert 'mlx' not in sys.modules and 'mlx.core' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)


def test_batched_sampler_marginals_match_positions_module():
    """Chunk-2 start position and the final position of the batched sampler vs pose_mlx.training.positions (same law)."""
    from pose_mlx.training.positions import pose_position_ids

    window, target, chunks, n = 6, 14, 3, 6000
    rng = np.random.default_rng(5)
    ref = np.stack([pose_position_ids(window, target, chunks, rng=rng) for _ in range(n)])
    lengths, biases = sample_pose_batch(n, window, target, chunks, np.random.default_rng(6))
    starts = np.cumsum(lengths, axis=1) - lengths
    ours = np.stack([np.arange(window) + np.repeat(b, l) for l, b in zip(lengths, biases)])
    assert np.array_equal(starts[:, 0], np.zeros(n))
    for col in (1, window // 2, window - 1):  # per-token position marginals
        a = np.bincount(ref[:, col], minlength=target) / n
        b = np.bincount(ours[:, col], minlength=target) / n
        se = np.sqrt((a * (1 - a) + b * (1 - b)) / n) + 1e-12
        assert np.all(np.abs(a - b) <= 4.5 * se + 1e-9), col
