"""Exact attention for training in blocks of queries: memory that grows with L, not L^2, forward and backward.

MLX's CPU backend has no fused attention and Metal trains unfused: `mx.fast.scaled_dot_product_attention`'s
gradient keeps the L x L score matrix of every layer. `attention` computes the same function one block of queries
at a time, each block against the keys it can see, and its vector-Jacobian product recomputes the block's scores
instead of keeping them (the flash-attention backward). Per KV head g, with the `rep = H / Hkv` query heads of the
group stacked as rows and Q pre-scaled (Q' = scale * Q):

    forward, block b:   S = Q'_b K^T (+ mask),  P = softmax_rows(S),  O_b = P V,  lse_b = log sum exp S
    backward, block b:  S again,  dP = dO_b V^T,  dS = P * (dP - D_b)  with D_b = rowsum(dO_b * O_b),
                        dQ_b = scale * dS K,  dK += dS^T Q'_b,  dV += P^T dO_b

Only (O, lse) are kept between the passes: O(L) memory per layer, plus one block's scores at a time
(`sizes.block_rows`). With a causal mask the block of queries [s, e) reads only the keys [0, e + Lk - Lq) (queries aligned
bottom-right, as in MLX), so about half of the square is never computed. The row kernels (`rows`) are the
vectorized C++ ones on the CPU and MLX ops elsewhere. Written in MLX ops only, it runs on every backend and under
`mx.compile`; results agree with `mx.fast.scaled_dot_product_attention` to float32 rounding (inputs of another
dtype are computed in float32 and the output cast back).

On the CPU, where the C++ kernels are built, a mask of None or "causal" takes the fused path instead: the same
formulas in one primitive for the forward and one for the backward (`cpu_attention.cpp`), in tiles of
`sizes.TILE` queries shared out over the CPU's threads, each tile's products single-threaded BLAS calls and its
softmax done while its scores are in cache. It keeps no more than the blocked path (each thread's scores and
their gradient for one tile, R x Lk floats each) and runs 3-4x faster (benchmarks/bench_cpu_kernels.py).

Contract, that of `mx.fast.scaled_dot_product_attention`: queries (B, H, Lq, D), keys (B, Hkv, Lk, D), values
(B, Hkv, Lk, Dv), H a multiple of Hkv; mask None, "causal" (Lq <= Lk) or an array broadcastable to
(B, H, Lq, Lk), boolean (True = attend; a fully masked row averages the values, as in MLX) or additive.
"""

from __future__ import annotations

import mlx.core as mx

from . import rows, sizes

_LOWEST = float(mx.finfo(mx.float32).min)


def _additive(mask: mx.array) -> mx.array:
    return mx.where(mask, 0.0, _LOWEST) if mask.dtype == mx.bool_ else mask.astype(mx.float32)


class _Blocks:
    """The blocked problem: float32 operands grouped by KV head, and each block's rows, keys and scores."""

    def __init__(self, q, k, v, masks, scale: float, causal: bool, block: int):
        self.b, self.heads, self.lq, self.d = q.shape
        self.kv_heads, self.lk, self.dv = k.shape[1], k.shape[2], v.shape[-1]
        self.rep = self.heads // self.kv_heads
        self.causal, self.block = causal, block
        self.q = (q.astype(mx.float32) * scale).reshape(self.b, self.kv_heads, self.rep, self.lq, self.d)
        self.k, self.v = k.astype(mx.float32), v.astype(mx.float32)
        self.mask = _additive(masks[0]) if masks else None

    def spans(self):
        """(start, end, keys seen) of each block of queries."""
        offset = self.lk - self.lq
        for start in range(0, self.lq, self.block):
            end = min(start + self.block, self.lq)
            yield start, end, (min(self.lk, end + offset) if self.causal else self.lk)

    def grouped(self, x: mx.array, start: int, end: int) -> mx.array:
        """Rows [start, end) of x (B, Hkv, rep, Lq, ...) as (B, Hkv, rep * n, ...)."""
        part = x[:, :, :, start:end]
        return part.reshape(self.b, self.kv_heads, self.rep * (end - start), *x.shape[4:])

    def scores(self, start: int, end: int, seen: int, after: list = ()) -> tuple[mx.array, mx.array]:
        """(Q'_b, S = Q'_b K^T + mask) of one block, computed only once the arrays `after` are."""
        q = self.grouped(self.q, start, end)
        if after:
            q = mx.depends(q, list(after))
        s = q @ self.k[:, :, :seen].swapaxes(-1, -2)
        if self.mask is not None:
            m = mx.broadcast_to(self.mask[..., start:end, :seen], (self.b, self.heads, end - start, seen))
            s = s + m.reshape(s.shape)
        return q, s

    def first(self, start: int) -> int:
        return start + self.lk - self.lq

    def heads_first(self, parts: list, *tail) -> mx.array:
        """Blocks (B, Hkv, rep * n, *tail) joined back into (B, H, Lq, *tail)."""
        shaped = [p.reshape(self.b, self.kv_heads, self.rep, -1, *tail) for p in parts]
        return mx.concatenate(shaped, axis=3).reshape(self.b, self.heads, self.lq, *tail)


@mx.custom_function
def _attention(q, k, v, *masks, scale: float, causal: bool, block: int):
    p = _Blocks(q, k, v, masks, scale, causal, block)
    outs, lses = [], []
    for start, end, seen in p.spans():
        _, s = p.scores(start, end, seen, after=outs[-1:] + lses[-1:])
        probs, lse = rows.softmax_rows(s, causal, p.first(start), end - start)
        outs.append(probs @ p.v[:, :, :seen])
        lses.append(lse)
    return p.heads_first(outs, p.dv).astype(q.dtype), p.heads_first(lses)


@_attention.vjp
def _attention_vjp(primals, cotangents, outputs, *, scale: float, causal: bool, block: int):
    q, k, v, *masks = primals
    p = _Blocks(q, k, v, masks, scale, causal, block)
    shape = (p.b, p.kv_heads, p.rep, p.lq)
    d_out = cotangents[0].astype(mx.float32).reshape(*shape, p.dv)
    out = outputs[0].astype(mx.float32).reshape(*shape, p.dv)
    delta, lse = mx.sum(d_out * out, axis=-1), outputs[1].reshape(shape)
    d_q, d_k, d_v = [], mx.zeros(p.k.shape, mx.float32), mx.zeros(p.v.shape, mx.float32)
    for start, end, seen in p.spans():
        # one block after the other (in the forward pass too): MLX orders a graph breadth-first, and left to itself
        # it would compute every block's scores before consuming any
        q_b, s = p.scores(start, end, seen, after=[d_k, d_v, *d_q[-1:]])
        d_o = p.grouped(d_out, start, end)
        d_p = d_o @ p.v[:, :, :seen].swapaxes(-1, -2)
        probs, d_s = rows.softmax_rows_grad(s, d_p, p.grouped(lse, start, end), p.grouped(delta, start, end),
                                            causal, p.first(start), end - start)
        d_v[:, :, :seen] += probs.swapaxes(-1, -2) @ d_o
        d_k[:, :, :seen] += d_s.swapaxes(-1, -2) @ q_b
        d_q.append(d_s @ p.k[:, :, :seen])
    d_q = p.heads_first(d_q, p.d) * scale
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), *[mx.zeros_like(m) for m in masks])


def _checked_mask(mask) -> bool:
    """Whether `mask` is "causal" (True), None or an array (False); another string is an error."""
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"attention: unknown mask {mask!r}")
    return isinstance(mask, str)


def blocks(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """The blocked attention in MLX operations (every backend, every mask; the module docstring's contract)."""
    b, heads, lq, _ = queries.shape
    causal = _checked_mask(mask)
    block = sizes.block_rows(b, heads, lq, keys.shape[2])
    masks = (mask,) if isinstance(mask, mx.array) else ()
    return _attention(queries, keys, values, *masks, scale=float(scale), causal=causal, block=block)[0]


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """softmax(scale * Q K^T + mask) V per head (the module docstring's contract): the fused C++ primitive on the
    CPU for a mask of None or "causal" where the kernels are built, else `blocks`."""
    causal = _checked_mask(mask)
    kernels = rows.native()
    if kernels is None or isinstance(mask, mx.array):
        return blocks(queries, keys, values, scale, mask)
    f32 = (a.astype(mx.float32) for a in (queries, keys, values))
    return kernels.attention(*f32, float(scale), causal, sizes.TILE)[0].astype(queries.dtype)


__all__ = ["attention", "blocks"]
