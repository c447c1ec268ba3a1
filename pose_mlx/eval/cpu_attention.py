"""Exact attention for MLX's CPU backend: BLAS matrix products and a NumPy softmax on zero-copy views.

On the CPU backend MLX's `exp` (and so `mx.fast.scaled_dot_product_attention`, which falls back to plain ops
there) runs an order of magnitude slower than NumPy's on the same buffer, and at long contexts the softmax
over the C x L attention scores dominates a chunked prefill. `attention` computes, for every KV head g and
every tile of queries (the `rep = H / Hkv` query heads of the group stacked as rows, so QK^T is one GEMM):

    S = (scale * Q_tile) K_g^T (+ mask)       scores, a NumPy GEMM into a reused scratch buffer
    P = exp(S - rowmax(S)), l = rowsum(P)      in place, float32
    O_tile = (P V_g) / l

Only the keys a tile can see are touched: with a causal mask, query i (absolute position Lk - Lq + i,
aligned bottom-right as in MLX) stops at key Lk - Lq + i, so the masked upper triangle is never computed.
Tiles are spread over worker threads (NumPy releases the GIL in BLAS calls and ufuncs), each running its
NumPy BLAS single-threaded (OpenBLAS's thread-local setting) so the two levels do not oversubscribe cores.

Contract, the same as `mx.fast.scaled_dot_product_attention`: queries (B, H, Lq, D), keys (B, Hkv, Lk, D),
values (B, Hkv, Lk, Dv), H a multiple of Hkv; mask None, "causal" (needs Lq <= Lk) or an array broadcastable
to (B, H, Lq, Lk), boolean (True = attend; a fully masked row averages the values, as MLX does) or
additive. Float32 results agree with MLX to float32 rounding; other dtypes are computed in float32 and cast
back. Differentiable: an `mx.custom_function` whose vector-Jacobian product is a NumPy backward too, exact
inside `nn.value_and_grad`; but evaluating inside a gradient trace keeps every intermediate array of the
traced step alive until its backward graph is built (about twice the memory of a LoRA update), so training
keeps MLX's attention. Inside `mx.compile`/`mx.vmap` (where nothing can be evaluated) and off the CPU it is
MLX's own `mx.fast.scaled_dot_product_attention`.

Routing a model through it: `fast_attention(model)` swaps the name `scaled_dot_product_attention` in the
mlx-lm modules that define the model's layers (e.g. `mlx_lm.models.llama`) for `scaled_dot_product_attention`
below, and restores it on exit. It covers every family whose attention calls that name imported from
`mlx_lm.models.base` (llama and mistral, qwen2, qwen3, phi3, gemma, starcoder2, gpt_neox, cohere, ...); a
family that computes attention itself (gemma2's soft-capping) is left on its own path. The swap is
process-wide for those modules while the block runs (another model of the same family evaluated meanwhile
also takes the fast path, which is exact), and it is a no-op unless MLX's default device is the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np


import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as _mlx_base

#: The name mlx-lm's model modules import from `mlx_lm.models.base` and call inside `Attention.__call__`.
ROUTED_NAME = "scaled_dot_product_attention"
#: Score-tile size: about this many rows (query heads x queries of one KV head), fewer at long contexts
#: so a tile (rows x keys x 4 bytes) stays near TILE_BYTES.
TILE_ROWS = 192
TILE_BYTES = 32 << 20
#: Below this many score elements a call runs on the calling thread (thread hand-off costs more).
INLINE_ELEMENTS = 1 << 20

_LOWEST = float(np.finfo(np.float32).min)


# --------------------------------------------------------------------------------------------- selection


def cpu_backend() -> bool:
    """True when MLX's default device is the CPU (where this module is faster than MLX's kernel)."""
    return mx.default_device().type == mx.DeviceType.cpu


def supported(queries, keys, values, mask=None) -> bool:
    """Whether `attention` handles these inputs (shapes and mask kind; see the module docstring)."""
    arrays = (queries, keys, values)
    if not all(isinstance(a, mx.array) and a.ndim == 4 and mx.issubdtype(a.dtype, mx.floating) for a in arrays):
        return False
    (b, h, lq, d), (bk, hkv, lk, dk) = queries.shape, keys.shape
    if bk != b or dk != d or hkv == 0 or h % hkv or values.shape[:3] != keys.shape[:3]:
        return False
    if mask is None:
        return True
    if isinstance(mask, str):
        return mask == "causal" and lq <= lk
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False
    try:
        np.broadcast_shapes(mask.shape, (b, h, lq, lk))
    except ValueError:
        return False
    return mask.dtype == mx.bool_ or mx.issubdtype(mask.dtype, mx.floating)


def _can_evaluate(*arrays) -> bool:
    """Evaluate `arrays`; False inside `mx.compile`/`mx.vmap`, which refuse evaluation."""
    try:
        mx.eval(*arrays)
    except ValueError as error:
        if "function transformations" in str(error):
            return False
        raise
    return True


# ------------------------------------------------------------------------------------------ thread pool


def _openblas_thread_setters() -> list:
    """`openblas_set_num_threads_local` of every OpenBLAS loaded in this process (Linux), [] if none."""
    setters, seen = [], set()
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]]
    except OSError:
        return []
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            setter = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setters.append(setter)
    return setters


class _Workers:
    """Worker threads whose NumPy BLAS runs single-threaded; one worker when that cannot be arranged."""

    def __init__(self):
        self._pool = None
        self._lock = threading.Lock()
        self.count = None

    def _start(self) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        setters = _openblas_thread_setters() if cores > 1 else []
        self.count = cores if setters else 1
        if self.count > 1:
            def single_threaded_blas():
                for setter in setters:
                    setter(1)

            self._pool = ThreadPoolExecutor(self.count, "pose_mlx-attention", initializer=single_threaded_blas)

    def run(self, jobs: list, work, elements: int) -> None:
        """Call work(job, scratch) for every job (largest first), spread over the workers."""
        with self._lock:
            if self.count is None:
                self._start()
        if self._pool is None or elements < INLINE_ELEMENTS or len(jobs) == 1:
            scratch = _Scratch.of_this_thread()
            for job in jobs:
                work(job, scratch)
            return
        queue, lock = iter(jobs), threading.Lock()

        def worker():
            scratch = _Scratch.of_this_thread()
            while True:
                with lock:
                    job = next(queue, None)
                if job is None:
                    return
                work(job, scratch)

        for future in [self._pool.submit(worker) for _ in range(self.count)]:
            future.result()


_WORKERS = _Workers()


class _Scratch:
    """Float32 scratch buffers of one thread, kept between calls and grown on demand: buffer(i, shape) is a
    C-contiguous view (no fresh pages to fault in for every layer)."""

    _local = threading.local()

    def __init__(self):
        self._buffers: dict[int, np.ndarray] = {}

    @classmethod
    def of_this_thread(cls) -> "_Scratch":
        if not hasattr(cls._local, "scratch"):
            cls._local.scratch = cls()
        return cls._local.scratch

    def buffer(self, index: int, shape: tuple) -> np.ndarray:
        size = int(np.prod(shape))
        buf = self._buffers.get(index)
        if buf is None or buf.size < size:
            buf = self._buffers[index] = np.empty(size, dtype=np.float32)
        return buf[:size].reshape(shape)


# --------------------------------------------------------------------------------------------- kernels


class _Problem:
    """NumPy views of one attention call and its tiling: jobs (b, g, i0, i1) and the keys each tile sees."""

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask):
        self.batch, self.heads, self.lq, self.dim = q.shape
        self.kv_heads, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.rep = self.heads // self.kv_heads
        self.offset = self.lk - self.lq
        self.k, self.v, self.scale = k, v, scale
        # scaled queries grouped per KV head, rows of a tile = (query, head of the group): (B, Hkv, Lq, rep, D)
        shape = (self.batch, self.kv_heads, self.lq, self.rep, self.dim)
        self.q = np.empty(shape, dtype=np.float32)
        grouped = q.reshape(self.batch, self.kv_heads, self.rep, self.lq, self.dim).transpose(0, 1, 3, 2, 4)
        np.multiply(grouped, np.float32(scale), out=self.q)
        self.causal = isinstance(mask, str)
        self.mask = None
        if isinstance(mask, np.ndarray):
            mask = np.broadcast_to(mask, (self.batch, self.heads, self.lq, self.lk))
            self.mask = mask.reshape(self.batch, self.kv_heads, self.rep, self.lq, self.lk)
        block = max(1, min(TILE_ROWS, TILE_BYTES // (4 * max(self.lk, 1))) // self.rep)
        self.jobs = [(b, g, i0, min(self.lq, i0 + block)) for b in range(self.batch)
                     for g in range(self.kv_heads) for i0 in range(0, self.lq, block)]
        self.jobs.sort(key=lambda job: -self.keys_seen(job[3]))
        self.elements = sum((i1 - i0) * self.rep * self.keys_seen(i1) for _, _, i0, i1 in self.jobs)
        self.triangle = (np.arange(block)[None, :] > np.arange(block)[:, None])[:, None, :]

    def keys_seen(self, i1: int) -> int:
        """Keys visible to the queries before i1: all of them, or up to the last query's position (causal)."""
        return self.offset + i1 if self.causal else self.lk

    def scores(self, job, out: np.ndarray) -> np.ndarray:
        """Masked scaled scores of a tile, written into `out` (rows, keys) and returned."""
        b, g, i0, i1 = job
        n, kend = i1 - i0, out.shape[1]
        np.matmul(self.q[b, g, i0:i1].reshape(n * self.rep, self.dim), self.k[b, g, :kend].T, out=out)
        tile = out.reshape(n, self.rep, kend)
        if self.causal:
            np.copyto(tile[:, :, self.offset + i0 :], -np.inf, where=self.triangle[:n, :, :n])
        elif self.mask is not None:
            mask = self.mask[b, g, :, i0:i1].transpose(1, 0, 2)
            if mask.dtype == np.bool_:
                np.copyto(tile, _LOWEST, where=~mask)
            else:
                tile += mask
        return out


def _forward(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Output (B, Lq, H, Dv) and the row log-sum-exp of the scores (B, Hkv, Lq, rep)."""
    out = np.empty((p.batch, p.lq, p.heads, p.dv), dtype=np.float32)
    lse = np.empty((p.batch, p.kv_heads, p.lq, p.rep), dtype=np.float32)

    def work(job, scratch: _Scratch) -> None:
        b, g, i0, i1 = job
        n, kend = i1 - i0, p.keys_seen(i1)
        s = p.scores(job, scratch.buffer(0, (n * p.rep, kend)))
        peak = s.max(axis=1, keepdims=True)
        np.subtract(s, peak, out=s)
        np.exp(s, out=s)
        total = s.sum(axis=1, keepdims=True)
        o = np.matmul(s, p.v[b, g, :kend])
        o /= total
        out[b, i0:i1, g * p.rep : (g + 1) * p.rep] = o.reshape(n, p.rep, p.dv)
        lse[b, g, i0:i1] = (peak + np.log(total)).reshape(n, p.rep)

    _WORKERS.run(p.jobs, work, p.elements)
    return out, lse


def _backward(p: _Problem, out: np.ndarray, lse: np.ndarray, cotangent: np.ndarray):
    """dQ, dK, dV of a None/causal attention (flash-attention's backward, per tile):

    P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K,
    dK = dS^T (scale Q). dK/dV are summed per worker, then over workers.
    """
    d_q = np.empty((p.batch, p.lq, p.heads, p.dim), dtype=np.float32)
    # delta[b, g, i, r] = dO . O for the row (query i, head g*rep + r)
    delta = np.einsum("bihd,bihd->bih", cotangent, out).reshape(p.batch, p.lq, p.kv_heads, p.rep)
    delta = np.ascontiguousarray(delta.transpose(0, 2, 1, 3))
    grad_out = np.ascontiguousarray(
        cotangent.reshape(p.batch, p.lq, p.kv_heads, p.rep, p.dv).transpose(0, 2, 1, 3, 4))
    partials, lock = [], threading.Lock()
    local = threading.local()

    def accumulators():
        if not hasattr(local, "acc"):
            local.acc = (np.zeros((p.batch, p.kv_heads, p.lk, p.dim), dtype=np.float32),
                         np.zeros((p.batch, p.kv_heads, p.lk, p.dv), dtype=np.float32))
            with lock:
                partials.append(local.acc)
        return local.acc

    def work(job, scratch: _Scratch) -> None:
        b, g, i0, i1 = job
        n, kend = i1 - i0, p.keys_seen(i1)
        rows = n * p.rep
        d_k, d_v = accumulators()
        prob = p.scores(job, scratch.buffer(0, (rows, kend)))
        np.subtract(prob, lse[b, g, i0:i1].reshape(rows, 1), out=prob)
        np.exp(prob, out=prob)
        g_out = grad_out[b, g, i0:i1].reshape(rows, p.dv)
        d_v[b, g, :kend] += prob.T @ g_out
        d_s = scratch.buffer(1, (rows, kend))
        np.matmul(g_out, p.v[b, g, :kend].T, out=d_s)
        np.subtract(d_s, delta[b, g, i0:i1].reshape(rows, 1), out=d_s)
        np.multiply(d_s, prob, out=d_s)
        d_k[b, g, :kend] += d_s.T @ p.q[b, g, i0:i1].reshape(rows, p.dim)
        d_q_tile = d_s @ p.k[b, g, :kend]
        d_q_tile *= np.float32(p.scale)
        d_q[b, i0:i1, g * p.rep : (g + 1) * p.rep] = d_q_tile.reshape(n, p.rep, p.dim)

    _WORKERS.run(p.jobs, work, 3 * p.elements)
    d_k, d_v = partials[0]
    for extra_k, extra_v in partials[1:]:
        d_k += extra_k
        d_v += extra_v
    return d_q, d_k, d_v


# ------------------------------------------------------------------------------------ MLX <-> NumPy glue


def _numpy(x: mx.array) -> np.ndarray:
    """A zero-copy float32 (or bool) NumPy view of an evaluated MLX array (cast in MLX first if needed)."""
    if x.dtype not in (mx.float32, mx.bool_):
        x = x.astype(mx.float32)
        mx.eval(x)
    return np.asarray(x)


def _problem(queries, keys, values, scale, mask) -> _Problem:
    np_mask = mask if mask is None or isinstance(mask, str) else _numpy(mask)
    return _Problem(_numpy(queries), _numpy(keys), _numpy(values), float(scale), np_mask)


def _heads_first(x: np.ndarray, dtype) -> mx.array:
    """(B, L, H, D) NumPy -> (B, H, L, D) MLX (a transposed view of one copy) in `dtype`."""
    y = mx.array(x).transpose(0, 2, 1, 3)
    return y if dtype == mx.float32 else y.astype(dtype)


def _reference(queries, keys, values, scale, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@mx.custom_function
def _attention(queries, keys, values, *mask_array, scale: float, mask_kind=None):
    """(output (B, H, Lq, Dv), row log-sum-exp of the scores (B, Hkv, Lq, rep), kept for the backward)."""
    mask = mask_array[0] if mask_array else mask_kind
    b, h, lq, _ = queries.shape
    if not _can_evaluate(queries, keys, values, *mask_array):
        lse = mx.zeros((b, keys.shape[1], lq, h // keys.shape[1]), dtype=mx.float32)
        return _reference(queries, keys, values, scale, mask), lse
    out, lse = _forward(_problem(queries, keys, values, scale, mask))
    return _heads_first(out, queries.dtype), mx.array(lse)


@_attention.vjp
def _attention_vjp(primals, cotangents, outputs, *, scale: float, mask_kind=None):
    """NumPy backward for mask None/"causal" and float32 inputs; otherwise the gradients of MLX's own
    attention (an additive mask gets its gradient, a boolean one zeros)."""
    queries, keys, values, *mask_array = primals
    cotangent, (out, lse) = cotangents[0], outputs
    arrays = (queries, keys, values)
    if mask_array or any(a.dtype != mx.float32 for a in arrays) or not _can_evaluate(*arrays, cotangent, out, lse):
        mask = mask_array[0] if mask_array else mask_kind
        differentiable = not mask_array or mask.dtype != mx.bool_

        def reference(q, k, v, *m):
            return _reference(q, k, v, scale, m[0] if m else mask)

        inputs = list(arrays) + ([mask] if mask_array and differentiable else [])
        grads = list(mx.vjp(reference, inputs, [cotangent])[1])
        if mask_array and not differentiable:
            grads.append(mx.zeros_like(mask))
        return tuple(grads)
    p = _problem(queries, keys, values, scale, mask_kind)
    d_q, d_k, d_v = _backward(p, _numpy(out).transpose(0, 2, 1, 3), _numpy(lse),
                              np.ascontiguousarray(_numpy(cotangent).transpose(0, 2, 1, 3)))
    return _heads_first(d_q, mx.float32), mx.array(d_k), mx.array(d_v)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """softmax(scale * Q K^T + mask) V per head, GQA-grouped; the contract of the module docstring.

    Falls back to `mx.fast.scaled_dot_product_attention` for inputs outside that contract and off the CPU.
    """
    if not (cpu_backend() and supported(queries, keys, values, mask)):
        return _reference(queries, keys, values, scale, mask)
    if isinstance(mask, mx.array):
        return _attention(queries, keys, values, mask, scale=float(scale))[0]
    return _attention(queries, keys, values, scale=float(scale), mask_kind=mask)[0]


# -------------------------------------------------------------------------------------------- routing


def scaled_dot_product_attention(queries, keys, values, cache=None, scale: float = 1.0, mask=None, sinks=None):
    """Drop-in for `mlx_lm.models.base.scaled_dot_product_attention`: `attention` where it applies
    (no attention sinks, no quantized KV cache), else mlx-lm's own function."""
    if sinks is None and not hasattr(cache, "bits"):
        return attention(queries, keys, values, scale, mask)
    return _mlx_base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                                  sinks=sinks)


def routed_modules(model: nn.Module) -> list:
    """The Python modules defining `model`'s layers that call mlx-lm's `scaled_dot_product_attention` by name
    ([] for a model that is not an `mlx.nn.Module`)."""
    found = {}
    layers = model.named_modules() if isinstance(model, nn.Module) else []
    for _, layer in layers:
        module = sys.modules.get(type(layer).__module__)
        if module is not None and getattr(module, ROUTED_NAME, None) is _mlx_base.scaled_dot_product_attention:
            found[module.__name__] = module
    return list(found.values())


@contextlib.contextmanager
def fast_attention(model: nn.Module, enabled: bool | None = None) -> Iterator[list]:
    """Route `model`'s attention through `scaled_dot_product_attention` above for the block.

    `enabled` None (default): only when MLX's default device is the CPU. Yields the names of the swapped
    modules ([] when inactive or when the family computes attention itself). Restores them on exit.
    """
    active = cpu_backend() if enabled is None else enabled
    modules = routed_modules(model) if active else []
    for module in modules:
        setattr(module, ROUTED_NAME, scaled_dot_product_attention)
    try:
        yield [module.__name__ for module in modules]
    finally:
        for module in modules:
            setattr(module, ROUTED_NAME, _mlx_base.scaled_dot_product_attention)


__all__ = ["attention", "cpu_backend", "fast_attention", "routed_modules",
           "scaled_dot_product_attention", "supported"]
