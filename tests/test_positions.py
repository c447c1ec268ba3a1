"""Position samplers: properties (hypothesis) and distributions against the PoSE paper.

References written here, independent of the implementation: eqs. (3)-(5) of the PoSE paper (chunk positions
u_i + st_i .., content x[v_i + st_i : ..]), the sequential draws of its Figure 6 code, the authors' released
code (l_0 ~ U{1..ceil(Lc/2)}, u_1 ~ U{0..Lt-Lc}, v_1 ~ U{0..Lx-Lc}) and RandPos (uniform Lc-subsets of [0, Lt)).
"""

import itertools
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pose_mlx.training.positions import (
    CONTENT,
    MIDDLE_SIGMA,
    SAMPLERS,
    pose_position_ids,
    randpos_position_ids,
    sample_example,
    truncated_normal,
)

PROPERTY = settings(max_examples=150, deadline=None)


@st.composite
def layouts(draw):
    window = draw(st.integers(1, 40))
    target = window + draw(st.integers(0, 150))
    chunks = draw(st.integers(1, min(window, 6)))
    seed = draw(st.integers(0, 2**32 - 1))
    return window, target, chunks, seed


def decompose(example):
    """(l, st, u, v) of a PoSE example: lengths, chunk starts in the window, skip biases, content offsets."""
    lengths = np.array([n for _, n in example.spans])
    starts = np.array([s for s, _ in example.spans])
    st_ = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return lengths, st_, example.position_ids[st_] - st_, starts - st_


# ---------------------------------------------------------------- properties


@PROPERTY
@given(layouts())
def test_pose_position_ids_properties(layout):
    window, target, chunks, seed = layout
    ids = pose_position_ids(window, target, chunks, rng=seed)
    assert ids.dtype == np.int64 and ids.shape == (window,)
    assert ids[0] == 0
    assert np.all(np.diff(ids) >= 1), "strictly increasing"
    assert ids[-1] < target
    assert np.count_nonzero(np.diff(ids) > 1) <= chunks - 1, "at most N-1 skips"
    np.testing.assert_array_equal(ids, pose_position_ids(window, target, chunks, rng=seed))
    np.testing.assert_array_equal(ids, pose_position_ids(window, target, chunks, rng=np.random.default_rng(seed)))


@PROPERTY
@given(layouts(), st.sampled_from(["pose", "pose-ref"]), st.sampled_from(CONTENT), st.integers(0, 60))
def test_pose_examples_follow_eqs_3_to_5(layout, sampler, content, extra):
    window, target, chunks, seed = layout
    if sampler == "pose-ref":
        assume(window >= 2)
        chunks = 2
    doc_length = (target if content == "aligned" else window) + extra
    ex = sample_example(doc_length, window, target, sampler, chunks, content, rng=seed)
    ids = ex.position_ids
    assert ids.dtype == np.int64 and ids.shape == (window,)
    assert ids[0] == 0 and np.all(np.diff(ids) >= 1) and ids[-1] < target

    lengths, st_, u, v = decompose(ex)
    assert len(ex.spans) == chunks and np.all(lengths >= 1) and lengths.sum() == window
    for i in range(chunks):  # eq. (4): chunk i holds u_i + st_i .. u_i + st_i + l_i - 1
        np.testing.assert_array_equal(ids[st_[i]:st_[i] + lengths[i]], u[i] + st_[i] + np.arange(lengths[i]))
    assert u[0] == 0 and np.all(np.diff(u) >= 0) and u[-1] <= target - window
    if sampler == "pose-ref":
        assert lengths[0] <= math.ceil(window / 2)

    assert v[0] == 0, "the paper sets v_0 = 0"
    if content == "uniform":
        assert np.all(np.diff(v) >= 0) and v[-1] <= doc_length - window
    elif content == "zero":
        assert np.all(v == 0)
    else:
        np.testing.assert_array_equal(v, u)
        np.testing.assert_array_equal(ex.gather(np.arange(doc_length)), ids)  # token index == position

    starts = np.array([s for s, _ in ex.spans])
    assert np.all(starts >= 0) and np.all(starts + lengths <= doc_length)
    assert np.all(starts[1:] >= starts[:-1] + lengths[:-1]), "spans in document order, no overlap"
    tokens = 3 * np.arange(doc_length)[::-1] + 1
    expected = np.concatenate([tokens[s:s + n] for s, n in ex.spans])
    np.testing.assert_array_equal(ex.gather(tokens), expected)
    np.testing.assert_array_equal(ex.gather(list(tokens)), expected)

    again = sample_example(doc_length, window, target, sampler, chunks, content, rng=seed)
    np.testing.assert_array_equal(again.position_ids, ids)
    assert again.spans == ex.spans
    if sampler == "pose":  # positions are drawn before content: same stream as pose_position_ids
        np.testing.assert_array_equal(ids, pose_position_ids(window, target, chunks, rng=seed))


@PROPERTY
@given(layouts(), st.integers(0, 30))
def test_randpos_properties(layout, extra):
    window, target, _, seed = layout
    ids = randpos_position_ids(window, target, rng=seed)
    assert ids.dtype == np.int64 and ids.shape == (window,)
    assert ids[0] >= 0 and ids[-1] < target and np.all(np.diff(ids) >= 1)
    ex = sample_example(window + extra, window, target, "randpos", rng=seed)
    np.testing.assert_array_equal(ex.position_ids, ids)
    assert ex.spans == [(0, window)]
    tokens = np.arange(window + extra) * 5
    np.testing.assert_array_equal(ex.gather(tokens), tokens[:window])


@PROPERTY
@given(layouts(), st.sampled_from(["uniform", "zero", "aligned"]), st.integers(0, 30))
def test_full_and_contiguous(layout, content, extra):
    window, target, _, seed = layout
    ex = sample_example(target + extra, window, target, "full", content=content, rng=seed)
    np.testing.assert_array_equal(ex.position_ids, np.arange(target))
    assert ex.position_ids.dtype == np.int64 and ex.spans == [(0, target)]
    ex = sample_example(window + extra, window, target, "contiguous", content=content, rng=seed)
    np.testing.assert_array_equal(ex.position_ids, np.arange(window))
    assert ex.spans == [(0, window)]


def test_no_room_or_one_chunk_gives_contiguous_positions():
    for chunks in (1, 2, 5):
        np.testing.assert_array_equal(pose_position_ids(9, 9, chunks, rng=chunks), np.arange(9))
    np.testing.assert_array_equal(pose_position_ids(9, 500, 1, rng=0), np.arange(9))


def test_rng_forms():
    g = np.random.default_rng(11)
    first, second = pose_position_ids(64, 100_000, 4, rng=g), pose_position_ids(64, 100_000, 4, rng=g)
    assert not np.array_equal(first, second), "a Generator is advanced, not re-seeded"
    np.testing.assert_array_equal(first, pose_position_ids(64, 100_000, 4, rng=11))
    ids = pose_position_ids(64, 100_000, 4)  # rng=None: fresh entropy, still valid
    assert ids[0] == 0 and np.all(np.diff(ids) >= 1) and ids[-1] < 100_000


def test_module_does_not_import_mlx():
    code = "import sys, pose_mlx.training.positions; sys.exit(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_gives_increasing_positions_below_the_target(sampler):
    """Whatever the sampler: strictly increasing position ids in [0, target) over document tokens in order."""
    window, target, doc_length = 12, 48, 60
    for seed in range(20):
        ex = sample_example(doc_length, window, target, sampler, 3 if sampler == "pose" else 2, "uniform", rng=seed)
        ids = ex.position_ids
        assert len(ids) == (target if sampler == "full" else window)
        assert np.all(np.diff(ids) > 0) and ids[0] >= 0 and ids[-1] < target
        index = ex.token_index()
        assert np.all(np.diff(index) > 0) and index[-1] < doc_length


# ---------------------------------------------------------------- distributions


def wilson_hilferty(df, z=3.719):
    """Chi-square quantile (Wilson-Hilferty); z = 3.719 is the standard normal 0.9999 quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(samples, pmf):
    """Observed outcomes = the support of ``pmf`` (a dict outcome -> probability) and chi-square passes."""
    assert math.isclose(sum(pmf.values()), 1.0)
    counts = Counter(samples)
    assert set(counts) == set(pmf), f"support differs: extra {set(counts) - set(pmf)}, missing {set(pmf) - set(counts)}"
    n = len(samples)
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in pmf.items())
    assert chi2 < wilson_hilferty(len(pmf) - 1), f"chi2={chi2:.1f} over {len(pmf) - 1} dof"


def figure6_lengths(window, chunks):
    """pmf of (l_0, ..., l_{N-2}) from the Figure 6 draws: l_i ~ U{1 .. rest - (N-1-i)}."""
    pmf = {(): 1.0}
    for i in range(chunks - 1):
        nxt = {}
        for prefix, p in pmf.items():
            top = window - sum(prefix) - (chunks - 1 - i)
            for length in range(1, top + 1):
                nxt[prefix + (length,)] = p / top
        pmf = nxt
    return pmf


def nondecreasing_uniform(count, top):
    """pmf of (b_1, ..., b_count) with b_0 = 0 and b_i ~ U{b_{i-1} .. top} (eq. 4's u_i, eq. 5's v_i)."""
    pmf = {(): 1.0}
    for _ in range(count):
        pmf = {prefix + (b,): p / (top - low + 1)
               for prefix, p in pmf.items()
               for low in [prefix[-1] if prefix else 0]
               for b in range(low, top + 1)}
    return pmf


def product(*pmfs):
    return {sum(keys, ()): math.prod(p for p in ps)
            for combo in itertools.product(*(pmf.items() for pmf in pmfs))
            for keys, ps in [zip(*combo)]}


def draw(n, seed, **kwargs):
    g = np.random.default_rng(seed)
    return [decompose(sample_example(rng=g, **kwargs)) for _ in range(n)]


def test_figure6_reference_enumerates_correctly():
    assert figure6_lengths(6, 2) == {(k,): 1 / 5 for k in range(1, 6)}  # Figure 6, N=2: l0 = randint(1, Lc-1)
    assert math.isclose(figure6_lengths(6, 3)[(1, 1)], 1 / 4 * 1 / 4)  # l0 = randint(1, Lc-2), l1 = randint(1, Lc-l0-1)
    assert nondecreasing_uniform(2, 2) == {(0, 0): 1 / 9, (0, 1): 1 / 9, (0, 2): 1 / 9, (1, 1): 1 / 6, (1, 2): 1 / 6,
                                           (2, 2): 1 / 3}


def test_pose_two_chunks_distribution():
    """N = 2, Lc = 6, Lt = 10: l_0 ~ U{1..5} and u_1 ~ U{0..4}, independent (25 cells)."""
    samples = draw(20_000, 1, doc_length=6, window=6, target=10)
    assert_matches([(int(l[0]), int(u[1])) for l, _, u, _ in samples],
                   product(figure6_lengths(6, 2), nondecreasing_uniform(1, 4)))


@pytest.mark.parametrize("chunks", [3, 4])
def test_pose_many_chunks_distribution(chunks):
    """Lc = 6, Lt = 9, Lx = 8: joint law of the lengths and skip biases, and of the content offsets."""
    samples = draw(30_000, chunks, doc_length=8, window=6, target=9, chunks=chunks)
    assert_matches([tuple(map(int, l[:-1])) + tuple(map(int, u[1:])) for l, _, u, _ in samples],
                   product(figure6_lengths(6, chunks), nondecreasing_uniform(chunks - 1, 3)))
    assert all(v[0] == 0 for *_, v in samples)
    assert_matches([tuple(map(int, v[1:])) for *_, v in samples], nondecreasing_uniform(chunks - 1, 2))


@pytest.mark.parametrize("window", [7, 6])
def test_pose_ref_distribution(window):
    """Authors' code: l_0 ~ U{1..ceil(Lc/2)}, u_1 ~ U{0..Lt-Lc}, v_1 ~ U{0..Lx-Lc}, independent."""
    samples = draw(20_000, window, doc_length=window + 2, window=window, target=window + 3, sampler="pose-ref")
    half = math.ceil(window / 2)
    pmf = product({(k,): 1 / half for k in range(1, half + 1)}, nondecreasing_uniform(1, 3),
                  nondecreasing_uniform(1, 2))
    assert_matches([(int(l[0]), int(u[1]), int(v[1])) for l, _, u, v in samples], pmf)


def test_distribution_check_tells_pose_from_pose_ref():
    samples = draw(2_000, 0, doc_length=6, window=6, target=10, sampler="pose-ref")
    with pytest.raises(AssertionError, match="support differs"):
        assert_matches([(int(l[0]), int(u[1])) for l, _, u, _ in samples],
                       product(figure6_lengths(6, 2), nondecreasing_uniform(1, 4)))


def test_randpos_distribution():
    """Every 3-subset of {0..5} equally likely (C(6,3) = 20 cells)."""
    g = np.random.default_rng(3)
    samples = [tuple(map(int, randpos_position_ids(3, 6, rng=g))) for _ in range(20_000)]
    assert_matches(samples, {subset: 1 / 20 for subset in itertools.combinations(range(6), 3)})


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("call, name", [
    (lambda: pose_position_ids(5, 4), "target"),
    (lambda: pose_position_ids(0, 4), "window"),
    (lambda: pose_position_ids(4.5, 8), "window"),
    (lambda: pose_position_ids(5, 8, chunks=0), "chunks"),
    (lambda: pose_position_ids(5, 8, chunks=6), "chunks"),
    (lambda: randpos_position_ids(5, 4), "target"),
    (lambda: sample_example(4, 5, 8), "doc_length"),
    (lambda: sample_example(7, 5, 8, sampler="full"), "doc_length"),
    (lambda: sample_example(7, 5, 8, content="aligned"), "doc_length"),
    (lambda: sample_example(7, 5, 8, sampler="pose-ref", content="aligned"), "doc_length"),
    (lambda: sample_example(9, 5, 8, sampler="nope"), "sampler"),
    (lambda: sample_example(9, 5, 8, content="nope"), "content"),
    (lambda: sample_example(9, 5, 8, sampler="pose-ref", chunks=3), "chunks"),
    (lambda: sample_example(9, 1, 8, sampler="pose-ref"), "window"),
    (lambda: sample_example(9, 5, 8, sampler="randpos", content="aligned"), "content"),
    (lambda: sample_example(9, 5, 4, sampler="contiguous"), "target"),
    (lambda: sample_example(9, 5, 8).gather(np.arange(8)), "tokens"),
    (lambda: sample_example(9, 2, 8, sampler="pose-middle"), "window"),
    (lambda: sample_example(7, 5, 8, sampler="pose-middle", content="aligned"), "doc_length"),
])
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ---------------------------------------------------------------- pose-middle (after CREAM, arXiv 2406.07138)


def _phi(x: float) -> float:
    """Standard normal CDF, written from erf."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _middle_bias_cdf(j: int, window: int, target: int) -> float:
    """P(u <= j) for u = round((alpha - 1) * Lc), alpha ~ N(mu, sigma^2) truncated to [1, s], s = Lt / Lc,
    mu = (1 + s) / 2: the truncated normal's CDF at alpha = 1 + (j + 1/2) / Lc."""
    s = target / window
    mu, sigma = (1 + s) / 2, MIDDLE_SIGMA
    a, b = _phi((1 - mu) / sigma), _phi((s - mu) / sigma)
    x = min(1 + (j + 0.5) / window, s)
    return (_phi((x - mu) / sigma) - a) / (b - a)


@PROPERTY
@given(st.integers(3, 40), st.integers(0, 300), st.integers(0, 2**32 - 1), st.sampled_from(CONTENT),
       st.integers(0, 50))
def test_pose_middle_layout(window, room, seed, content, extra):
    """Head k = floor(Lc / 3) at 0 .. k - 1, tail at Lt - k .. Lt - 1, a contiguous middle of Lc - 2k tokens at
    bias u in [0, Lt - Lc]; the document spans follow eq. (5) as for PoSE; one seed, one layout."""
    target = window + room
    doc_length = target + extra
    ex = sample_example(doc_length, window, target, "pose-middle", content=content, rng=seed)
    k = window // 3
    ids = ex.position_ids
    np.testing.assert_array_equal(ids[:k], np.arange(k))
    np.testing.assert_array_equal(ids[window - k:], np.arange(target - k, target))
    middle = ids[k:window - k]
    u = middle[0] - k
    assert 0 <= u <= target - window
    np.testing.assert_array_equal(middle, np.arange(k + u, window - k + u))
    lengths, _, biases, offsets = decompose(ex)
    assert lengths.tolist() == [k, window - 2 * k, k] and biases.tolist() == [0, u, target - window]
    if content == "aligned":
        np.testing.assert_array_equal(offsets, biases)
    assert (offsets >= 0).all() and (offsets <= doc_length - window).all() and (np.diff(offsets) >= 0).all()
    again = sample_example(doc_length, window, target, "pose-middle", content=content, rng=seed)
    np.testing.assert_array_equal(again.position_ids, ids)
    assert again.spans == ex.spans


@pytest.mark.parametrize("window,target", [(32, 256), (16, 1024)])
def test_pose_middle_bias_follows_the_truncated_gaussian(window, target):
    """20,000 middle biases u: support in [0, Lt - Lc], the mean (Lt - Lc) / 2 of the symmetric truncated law
    (within 4 standard errors), and the empirical CDF of u within 0.015 of the formula everywhere (the
    Kolmogorov-Smirnov 99.9% band for n = 20,000 is 0.0138)."""
    rng = np.random.default_rng(0)
    n = 20_000
    k = window // 3
    u = np.array([sample_example(target, window, target, "pose-middle", rng=rng).position_ids[k] - k
                  for _ in range(n)])
    room = target - window
    assert u.min() >= 0 and u.max() <= room
    assert abs(u.mean() - room / 2) < 4 * u.std() / math.sqrt(n)
    values = np.arange(room + 1)
    empirical = np.searchsorted(np.sort(u), values, side="right") / n
    formula = np.array([_middle_bias_cdf(j, window, target) for j in values])
    assert np.abs(empirical - formula).max() < 0.015


def test_pose_middle_trains_the_middle_more_than_pose():
    """At s = 64 (sigma = 3 against a range of 63) the middle chunk's start falls in the middle third of
    [0, Lt - Lc] far more often than PoSE's uniform u_1 does (formula: 0.9995 against 1/3)."""
    window, target = 30, 64 * 30
    room = target - window
    rng = np.random.default_rng(1)
    u = np.array([sample_example(target, window, target, "pose-middle", rng=rng).position_ids[10] - 10
                  for _ in range(2000)])
    inside = ((u >= room / 3) & (u <= 2 * room / 3)).mean()
    s = target / window
    mu = (1 + s) / 2
    z = (s - 1) / 6 / MIDDLE_SIGMA  # the middle third is mu -+ (s - 1) / 6 in alpha
    want = (2 * _phi(z) - 1) / (2 * _phi((s - 1) / 2 / MIDDLE_SIGMA) - 1)
    assert abs(inside - want) < 0.01 and want > 0.99 and mu == 32.5


def test_pose_middle_without_room_is_contiguous_and_truncated_normal_respects_its_bounds():
    np.testing.assert_array_equal(sample_example(20, 12, 12, "pose-middle", rng=3).position_ids, np.arange(12))
    rng = np.random.default_rng(2)
    draws = [truncated_normal(0.0, 1.0, 2.0, 2.5, rng) for _ in range(500)]  # deep in the tail
    assert min(draws) >= 2.0 and max(draws) <= 2.5
    # the tail's density decreases: more mass in [2, 2.25] than in [2.25, 2.5] (ratio ~ 1.75)
    low = sum(d <= 2.25 for d in draws)
    assert low > 500 - low
    assert truncated_normal(5.0, 1.0, 3.0, 3.0, rng) == 3.0
    with pytest.raises(ValueError, match="^need sigma > 0 and low <= high, got sigma=0.0"):
        truncated_normal(0.0, 0.0, 0.0, 1.0, rng)
