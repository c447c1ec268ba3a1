"""pose_mlx.kernels: blocked attention, the chunked loss and the row kernels, against MLX's own functions and NumPy.

Every function is checked on both of its implementations: the vectorized C++ kernels (built on first use on a
Linux CPU) and the MLX-op fallback (what Metal, CUDA and machines without a compiler run), the latter selected by
making `rows.native` answer None.
"""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from pose_mlx.kernels import attention as blocked
from pose_mlx.kernels import build, loss, route, rows, sizes

from conftest import cpu_only, on_cpu

NATIVE = ["native", "mlx-ops"]


@pytest.fixture(params=NATIVE)
def path(request, monkeypatch):
    """Run the test on the C++ kernels, or on the MLX-op fallback."""
    if request.param == "mlx-ops":
        monkeypatch.setattr(rows, "native", lambda *arrays: None)
    elif rows.native(mx.zeros(1)) is None:
        pytest.skip(f"the C++ kernels are not in use here: {build.status.get('reason', 'not on the CPU')}")
    return request.param


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ------------------------------------------------------------------------------------------ row kernels


def _softmax_reference(s: np.ndarray, visible: np.ndarray):
    """float64 softmax over each row's first visible[r] columns (0 elsewhere) and its log-sum-exp."""
    s = s.astype(np.float64)
    keep = np.arange(s.shape[-1]) < visible[:, None]
    top = np.where(keep, s, -np.inf).max(-1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(-1, keepdims=True)
    lse = np.where(total > 0, np.log(np.maximum(total, 1e-300)) + top, -np.inf)[..., 0]
    return np.where(total > 0, e / np.maximum(total, 1e-300), 0), lse


@pytest.mark.parametrize("causal, first, block", [(False, 0, 1), (True, 0, 4), (True, 5, 4), (True, -2, 3)])
def test_softmax_rows_and_gradient_against_float64(path, causal, first, block):
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 12, 9)).astype(np.float32) * 4
    visible = np.clip(first + np.arange(12) % block + 1, 0, 9) if causal else np.full(12, 9)
    p, lse = rows.softmax_rows(mx.array(s), causal, first, block)
    want_p, want_lse = _softmax_reference(s, visible)
    assert np.allclose(np.array(p), want_p, rtol=2e-6, atol=1e-7)
    finite = np.isfinite(want_lse)
    assert np.allclose(np.array(lse)[finite], want_lse[finite], rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(np.array(lse)[~finite]))  # a row that sees nothing (first < 0)
    dp = rng.normal(size=s.shape).astype(np.float32)
    delta = rng.normal(size=s.shape[:-1]).astype(np.float32)
    p2, ds = rows.softmax_rows_grad(mx.array(s), mx.array(dp), lse, mx.array(delta), causal, first, block)
    assert np.allclose(np.array(p2), want_p, rtol=2e-6, atol=1e-7)
    assert np.allclose(np.array(ds), want_p * (dp - delta[..., None]), rtol=2e-6, atol=1e-6)


def test_cross_entropy_rows_against_float64(path):
    rng = np.random.default_rng(1)
    z = rng.normal(size=(6, 50)).astype(np.float32) * 5
    t = rng.integers(0, 50, size=6)
    w = np.array([1.0, 0.0, 0.5, 2.0, 1.0, 0.0], np.float32)
    z64 = z.astype(np.float64)
    want_lse = np.log(np.exp(z64 - z64.max(-1, keepdims=True)).sum(-1)) + z64.max(-1)
    lse, picked = rows.cross_entropy_rows(mx.array(z), mx.array(t))
    assert np.allclose(np.array(lse), want_lse, rtol=1e-6) and np.array_equal(np.array(picked), z[np.arange(6), t])
    lse, picked, dz = rows.cross_entropy_with_grad(mx.array(z), mx.array(t), mx.array(w))
    used = w != 0
    assert np.allclose(np.array(lse)[used], want_lse[used], rtol=1e-6) and not np.array(lse)[~used].any()
    assert not np.array(picked)[~used].any()
    want_dz = (np.exp(z64 - want_lse[:, None]) - np.eye(50)[t]) * w[:, None]
    assert np.allclose(np.array(dz), want_dz, rtol=1e-5, atol=1e-7)


def test_swiglu_and_its_gradient_against_mlx(path):
    g = mx.random.normal((7, 33), key=mx.random.key(2)) * 6
    u = mx.random.normal((7, 33), key=mx.random.key(3))
    assert _rel(rows.swiglu(g, u), nn.silu(g) * u) < 1e-6
    cot = mx.random.normal((7, 33), key=mx.random.key(4))
    ours = mx.vjp(lambda a, b: rows.swiglu(a, b), [g, u], [cot])[1]
    theirs = mx.vjp(lambda a, b: nn.silu(a) * b, [g, u], [cot])[1]
    assert all(_rel(a, b) < 1e-6 for a, b in zip(ours, theirs))


@cpu_only("the C++ kernels run on the CPU only")
def test_native_kernels_are_built_where_a_compiler_exists():
    """On Linux with a C++ compiler (as in CI) the kernels must build and pass their check: a silent fallback would
    leave CPU training at MLX's scalar exp without any test noticing."""
    import sys

    if not sys.platform.startswith("linux") or build.compiler() is None:
        pytest.skip("the C++ kernels are built on Linux with a C++ compiler only")
    assert build.load() is not None, build.status
    assert build.status["available"] and build.status["threads"] >= 1


# -------------------------------------------------------------------------------------------- attention

# (B, H, Hkv, Lq, Lk, D, Dv): GQA, Lq < Lk (queries aligned bottom-right), Dv != D, one KV head, several blocks
SHAPES = [(1, 4, 2, 37, 37, 8, 8), (2, 6, 2, 20, 29, 8, 4), (1, 4, 1, 50, 50, 16, 16), (1, 3, 3, 1, 9, 4, 4)]
MASKS = ["causal", "none", "bool", "additive"]


def _problem(shape, mask_kind, seed=0):
    b, h, hkv, lq, lk, d, dv = shape
    keys = mx.random.split(mx.random.key(seed), 5)
    q, k, v = (mx.random.normal(s, key=key) for s, key in
               zip([(b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv)], keys))
    mask = {"causal": "causal", "none": None,
            "bool": mx.random.uniform(shape=(b, 1, lq, lk), key=keys[3]) > 0.3,
            "additive": mx.random.normal((lq, lk), key=keys[4])}[mask_kind]
    return q, k, v, mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_blocked_attention_and_gradients_equal_mlx(path, monkeypatch, shape, mask_kind):
    monkeypatch.setattr(sizes, "MAX_BLOCK", 8)  # several blocks of queries even at these sizes
    monkeypatch.setattr(sizes, "MIN_BLOCK", 1)
    monkeypatch.setattr(sizes, "TILE", 6)  # the fused path's tiles: several, the last one shorter
    q, k, v, mask = _problem(shape, mask_kind)
    scale = q.shape[-1] ** -0.5
    cot = mx.random.normal((*q.shape[:3], v.shape[-1]), key=mx.random.key(9))

    def grads(attend):
        return mx.vjp(lambda a, b, c: attend(a, b, c, scale, mask), [q, k, v], [cot])

    (ours,), d_ours = grads(blocked.attention)
    (theirs,), d_theirs = grads(lambda a, b, c, s, m: mx.fast.scaled_dot_product_attention(a, b, c, scale=s, mask=m))
    assert _rel(ours, theirs) < 1e-5
    for name, a, b in zip("qkv", d_ours, d_theirs):
        assert _rel(a, b) < 1e-5, name


def test_blocked_attention_of_16_bit_inputs_is_the_float32_result_rounded(path):
    q, k, v, _ = _problem((1, 4, 2, 24, 24, 8, 8), "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    for dtype in (mx.bfloat16, mx.float16):
        low = [x.astype(dtype) for x in (q, k, v)]
        got = blocked.attention(*low, 0.3, "causal")
        reference = mx.fast.scaled_dot_product_attention(*[x.astype(mx.float32) for x in low], scale=0.3, mask="causal")
        assert got.dtype == dtype and _rel(got.astype(mx.float32), reference) <= 2 ** -7
    assert _rel(blocked.attention(q, k, v, 0.3, "causal"), want) < 1e-6


def test_on_the_cpu_attention_without_a_mask_array_is_the_fused_primitive(path, monkeypatch):
    """The native path computes a causal or unmasked attention with one fused primitive (an array mask, or the
    MLX-op fallback, keeps the blocks of MLX operations): a spy on the kernels module counts its calls."""
    calls = []
    kernels = rows.native(mx.zeros(1))
    if kernels is not None:
        fused = kernels.attention
        monkeypatch.setattr(kernels, "attention", lambda *args: calls.append(args[-1]) or fused(*args))
    for mask_kind in ("causal", "none", "additive"):
        q, k, v, mask = _problem((1, 4, 2, 20, 20, 8, 8), mask_kind)
        mx.eval(blocked.attention(q, k, v, 0.3, mask))
    assert calls == ([sizes.TILE] * 2 if path == "native" else [])


@cpu_only("the fused attention runs on the CPU")
@pytest.mark.parametrize("threads", ["1", "3"])
def test_fused_attention_is_the_same_on_any_number_of_threads(threads):
    """Tiles shared out over threads, each adding its dK, dV into its own sums: the same result as MLX's on one
    thread or on more threads than cores (a child process: the thread count is read once per process)."""
    import subprocess
    import sys

    if rows.native(mx.zeros(1)) is None:
        pytest.skip(f"the C++ kernels are not in use here: {build.status.get('reason')}")
    script = """
import numpy as np, pose_mlx, mlx.core as mx
from pose_mlx.kernels import build
kernels = build.load()
keys = mx.random.split(mx.random.key(3), 4)
q, c = (mx.random.normal((2, 6, 150, 16), key=key) for key in keys[:2])
k, v = (mx.random.normal((2, 2, 150, 16), key=key) for key in keys[2:])
def grads(f):
    return mx.vjp(f, [q, k, v], [c])
ours = grads(lambda a, b, d: kernels.attention(a, b, d, 0.25, True, 16)[0])
theirs = grads(lambda a, b, d: mx.fast.scaled_dot_product_attention(a, b, d, scale=0.25, mask="causal"))
for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
print(kernels.threads())
"""
    env = {**__import__("os").environ, "POSE_MLX_KERNEL_THREADS": threads}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == threads


def test_attention_gives_the_same_bits_every_time(path):
    """Threads sum their tiles' dK and dV in their own buffers: each thread takes the same tiles on every run, so a
    resumed or repeated run reproduces its losses exactly (the BLAS's threads made busy in between, as in a step)."""
    q, k, v, _ = _problem((1, 6, 2, 300, 300, 16, 16), "causal", seed=4)
    cot = mx.random.normal(q.shape, key=mx.random.key(5))

    def grads():
        return mx.vjp(lambda a, b, c: blocked.attention(a, b, c, 0.25, "causal"), [q, k, v], [cot])[1]

    first = [np.array(g) for g in grads()]
    for _ in range(4):
        mx.eval(mx.ones((384, 384)) @ mx.ones((384, 384)))
        assert all(np.array_equal(a, np.array(b)) for a, b in zip(first, grads()))


def test_blocks_never_exceed_their_byte_budget():
    for b, h, lq, lk in [(1, 9, 1024, 1024), (1, 9, 32768, 32768), (4, 32, 4096, 4096), (1, 1, 10, 10)]:
        rows_ = sizes.block_rows(b, h, lq, lk)
        assert 1 <= rows_ <= min(lq, sizes.MAX_BLOCK)
        assert rows_ == lq or rows_ == sizes.MIN_BLOCK or 4 * b * h * rows_ * lk <= sizes.BLOCK_BYTES


def _peak(evaluate) -> int:
    """Peak bytes allocated while `evaluate()` runs, in MLX's order without running ahead (as training runs)."""
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    with route.in_order():
        evaluate()
    return mx.get_peak_memory() - base


@cpu_only("peak memory is measured on the CPU's allocator")
def test_blocked_attention_memory_grows_with_length_not_its_square(path):
    """Forward and backward at L and 4L: MLX's own attention keeps the L x L scores (its peak grows about 16x);
    the blocked one keeps O(L) plus a few blocks of scores (the fused one: its threads' tiles, from MLX's
    allocator, so counted here)."""
    def peak(attend, length):
        q, k, v, _ = _problem((1, 4, 4, length, length, 16, 16), "none", seed=1)
        mx.eval(q, k, v)
        grad = mx.grad(lambda a, b, c: attend(a, b, c).sum(), argnums=(0, 1, 2))
        return _peak(lambda: mx.eval(grad(q, k, v)))

    mlx_attention = lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.25, mask="causal")
    ours = lambda a, b, c: blocked.attention(a, b, c, 0.25, "causal")
    short, long = 512, 2048
    assert peak(mlx_attention, long) > 10 * peak(mlx_attention, short)  # the reference is quadratic
    block_scores = 4 * 4 * sizes.block_rows(1, 4, long, long) * long
    assert peak(ours, long) < 4 * peak(ours, short) + 4 * block_scores
    assert peak(ours, long) < peak(mlx_attention, long) / 4


# ------------------------------------------------------------------------------------------------ loss


def _reference_loss(h, w, t, weights):
    return (nn.losses.cross_entropy((h @ w.T).astype(mx.float32), t) * weights).sum()


@pytest.mark.parametrize("weight_grad", [False, True])
def test_chunked_loss_and_gradients_equal_the_whole_logits(path, monkeypatch, weight_grad):
    monkeypatch.setattr(sizes, "CHUNK_BYTES", 4 * 61 * 7)  # chunks of 7 rows: the last one shorter
    keys = mx.random.split(mx.random.key(5), 3)
    h = mx.random.normal((2, 15, 12), key=keys[0])
    w = mx.random.normal((61, 12), key=keys[1]) * 0.5
    t = mx.random.randint(0, 61, (2, 15), key=keys[2])
    weights = mx.array(np.random.default_rng(0).integers(0, 2, size=(2, 15)).astype(np.float32))
    want, (dh_want, dw_want) = mx.value_and_grad(_reference_loss, argnums=(0, 1))(h, w, t, weights)
    assert _rel(loss.chunked_cross_entropy(h, w, t, weights, gradient=False), want) < 1e-6  # the value only
    got, (dh, dw) = mx.value_and_grad(
        lambda a, b: loss.chunked_cross_entropy(a, b, t, weights, gradient=True, weight_grad=weight_grad),
        argnums=(0, 1))(h, w)
    assert _rel(got, want) < 1e-6 and _rel(dh, dh_want) < 1e-5
    if weight_grad:
        assert _rel(dw, dw_want) < 1e-5
    else:  # the head is frozen (LoRA): its gradient is not formed
        assert not np.array(dw).any()


# ------------------------------------------------------------------------------------------------ build


def _child(code: str, env: dict):
    """Run `code` in a fresh interpreter with `env` added; (exit code, stdout, stderr)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import pose_mlx\n" + code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    return done.returncode, done.stdout, done.stderr


LOAD = "from pose_mlx.kernels import build\nbuild.load()\nprint(build.status['available'], build.status['reason'])"


@cpu_only("the C++ kernels run on the CPU only")
def test_a_build_is_cached_and_a_failed_one_is_remembered(tmp_path):
    import sys

    if not sys.platform.startswith("linux") or build.compiler() is None:
        pytest.skip("the C++ kernels are built on Linux with a C++ compiler only")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    code, out, err = _child(LOAD, env)
    assert code == 0 and out.startswith("True built") and "building" in err
    code, out, err = _child(LOAD, env)  # the second process loads the cached build
    assert code == 0 and out.startswith("True built") and "building" not in err
    broken = {"XDG_CACHE_HOME": str(tmp_path / "broken"), "CXX": "false"}  # a compiler that always fails
    code, out, err = _child(LOAD, broken)
    assert code == 0 and out.startswith("False the compiler failed") and "unavailable" in err
    code, out, err = _child(LOAD, broken)  # remembered: no second attempt
    assert code == 0 and out.startswith("False the compiler failed") and "building" not in err
    code, out, err = _child(LOAD, {**broken, build.ENV_VAR: "require"})
    assert code != 0 and "the CPU kernels are unavailable" in err
    code, out, err = _child(LOAD, {**env, build.ENV_VAR: "off"})
    assert code == 0 and out.startswith("False turned off") and not err.strip()
