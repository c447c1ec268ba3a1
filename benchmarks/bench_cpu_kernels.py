"""The exp-heavy parts of a training step on MLX's CPU backend, each way of computing them side by side.

Why `pose_mlx.kernels` is what it is (docs/cpu-training.md): one process, the candidates timed interleaved
(A, B, C, A, B, C, ...; median of `--reps`), each on the same buffers.

  elementwise  M elements/s of exp over a 16M-element float32 buffer: MLX's `mx.exp` (scalar on x86-64), NumPy's
               `np.exp`, a polynomial exp written in MLX ops and fused by `mx.compile` (the same formula as the C++
               kernel), and the C++ kernel (`softmax_rows`, an exp and a sum per element); `mx.multiply` as the
               memory-bound yardstick; SiLU * up: `nn.silu(g) * u` against the C++ `swiglu`
  attention    forward + backward of one SmolLM2-135M attention layer (9 query heads, 3 KV heads, head dim 64),
               causal, at `--lengths` tokens: MLX's `scaled_dot_product_attention` (unfused on the CPU: L x L
               scores kept), `pose_mlx.eval.cpu_attention` (NumPy tiles behind `mx.custom_function`, evaluated
               inside the gradient trace), `pose_mlx.kernels.attention` (the fused C++ primitive on the CPU) and
               its blocks of MLX operations (`attention.blocks`, what Metal runs) with the C++ row kernels and
               with MLX ops; seconds and peak bytes (evaluated in order, as training does)
  heights      one attention layer at 8,192 tokens with blocks of several heights (`blocks`, C++ rows), and the
               fused primitive with tiles of several heights, at 1,024 and 8,192 tokens, with 3 and 1 query
               heads per KV head
  loss         forward + backward of the cross-entropy of `--lengths` rows over SmolLM2's 49,152-piece head:
               MLX's whole-logits loss against `pose_mlx.kernels.loss` (chunks; C++ and MLX ops)

Writes benchmarks/results/cpu_kernels.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pose_mlx  # noqa: F401  (the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from pose_mlx.backend import status as blas_status
from pose_mlx.eval import cpu_attention
from pose_mlx.kernels import attention as blocked
from pose_mlx.kernels import build, loss, route, rows, sizes

from benchmarks.common import ROOT, matmul_gflops, write_between, write_results

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 9, 3, 64, 576, 49152


def interleaved(cases: dict, reps: int) -> dict:
    """{name: median seconds} of each callable (which evaluates its own work), run A, B, C, A, B, C, ..."""
    for fn in cases.values():
        fn()
    times = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_bytes(fn) -> int:
    """Peak bytes beyond what was allocated before `fn()` runs, in MLX's order without running ahead."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    with route.in_order():
        fn()
    return int(mx.get_peak_memory() - base)


def fused_exp():
    """exp(x) in MLX ops, fused by mx.compile: the C++ kernel's polynomial and 2^n from the exponent bits."""
    def exp(x):
        xc = mx.clip(x, -87.33654, 88.72283)
        n = mx.floor(xc * 1.44269504088896341 + 0.5)
        r = xc - n * 0.693359375 + n * 2.12194440e-4
        p = 1.9875691500e-4
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = p * r + c
        p = p * r * r + r + 1.0
        scale = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
        return mx.where(x < -87.33654, 0.0, p * scale)

    return mx.compile(exp)


def elementwise(reps: int) -> dict:
    n = 1 << 24
    x = mx.random.normal((n // 4096, 4096)) * 4
    g, u = mx.random.normal((n // 4096, 4096)), mx.random.normal((n // 4096, 4096))
    mx.eval(x, g, u)
    xn = np.array(x)
    compiled = fused_exp()
    kernels = rows.native(x)
    cases = {
        "mx.exp": lambda: mx.eval(mx.exp(x)),
        "mx.multiply": lambda: mx.eval(x * x),
        "np.exp": lambda: np.exp(xn),
        "compiled polynomial exp": lambda: mx.eval(compiled(x)),
        "nn.silu(g) * u": lambda: mx.eval(nn.silu(g) * u),
    }
    if kernels is not None:
        cases["C++ softmax_rows (exp and sum)"] = lambda: mx.eval(kernels.softmax_rows(x, False, 0, 1))
        cases["C++ swiglu"] = lambda: mx.eval(kernels.swiglu(g, u))
    seconds = interleaved(cases, reps)
    exact = float(mx.max(mx.abs(compiled(x) - mx.exp(x)) / mx.maximum(mx.exp(x), 1e-30)).item())
    return {"elements": n, "seconds": seconds, "m_elements_per_s": {k: n / s / 1e6 for k, s in seconds.items()},
            "compiled_polynomial_max_relative_error": exact}


def _without_native(fn):
    """`fn` with the row kernels in MLX ops (what runs where the C++ kernels are not built)."""
    def run():
        saved = rows.native
        rows.native = lambda *arrays: None
        try:
            return fn()
        finally:
            rows.native = saved
    return run


def attention_cases(length: int, kv_heads: int = KV_HEADS) -> dict:
    keys = mx.random.split(mx.random.key(length), 4)
    q = mx.random.normal((1, HEADS, length, HEAD_DIM), key=keys[0])
    k, v = (mx.random.normal((1, kv_heads, length, HEAD_DIM), key=key) for key in keys[1:3])
    cot = mx.random.normal((1, HEADS, length, HEAD_DIM), key=keys[3])
    mx.eval(q, k, v, cot)
    scale = HEAD_DIM ** -0.5

    def step(attend):
        return lambda: mx.eval(mx.vjp(lambda a, b, c: attend(a, b, c), [q, k, v], [cot]))

    return {
        "mlx": step(lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=scale, mask="causal")),
        "numpy custom_function": step(lambda a, b, c: cpu_attention.attention(a, b, c, scale, "causal")),
        "fused C++": step(lambda a, b, c: blocked.attention(a, b, c, scale, "causal")),
        "blocked, C++ rows": step(lambda a, b, c: blocked.blocks(a, b, c, scale, "causal")),
        "blocked, MLX-op rows": _without_native(step(lambda a, b, c: blocked.blocks(a, b, c, scale, "causal"))),
    }


def loss_cases(length: int) -> dict:
    keys = mx.random.split(mx.random.key(length + 1), 3)
    h = mx.random.normal((length, HIDDEN), key=keys[0])
    w = mx.random.normal((VOCAB, HIDDEN), key=keys[1]) * 0.05
    t, weights = mx.random.randint(0, VOCAB, (length,), key=keys[2]), mx.ones((length,))
    mx.eval(h, w, t, weights)

    def whole(a):
        return (nn.losses.cross_entropy((a @ w.T).astype(mx.float32), t) * weights).sum()

    def chunked(a):
        return loss.chunked_cross_entropy(a, w, t, weights, gradient=True)

    return {"mlx whole logits": lambda: mx.eval(mx.grad(whole)(h)),
            "chunked, C++ rows": lambda: mx.eval(mx.grad(chunked)(h)),
            "chunked, MLX-op rows": _without_native(lambda: mx.eval(mx.grad(chunked)(h)))}


def block_heights(length: int, heights: list[int], reps: int) -> dict:
    """Seconds of one attention layer's forward + backward at `length` with blocks of each height (C++ rows)."""
    saved = sizes.MAX_BLOCK, sizes.MIN_BLOCK
    step = attention_cases(length)["blocked, C++ rows"]
    seconds = {}
    try:
        for height in heights:
            sizes.MAX_BLOCK = sizes.MIN_BLOCK = height
            seconds[str(height)] = interleaved({"step": step}, reps)["step"]
    finally:
        sizes.MAX_BLOCK, sizes.MIN_BLOCK = saved
    return {"length": length, "seconds": seconds}


def tile_heights(lengths: list[int], tiles: list[int], reps: int) -> dict:
    """Seconds of one layer's forward + backward through the fused primitive with tiles of each height, at each
    length, with 3 query heads per KV head (SmolLM2) and 1 (no grouping); {"3 per KV head, 1024": {tile: s}}."""
    out = {}
    for rep in (HEADS // KV_HEADS, 1):
        for length in lengths:
            step = attention_cases(length, HEADS // rep)["fused C++"]
            seconds = {}
            saved = sizes.TILE
            try:
                for tile in tiles:
                    sizes.TILE = tile
                    seconds[str(tile)] = interleaved({"step": step}, reps)["step"]
            finally:
                sizes.TILE = saved
            out[f"{rep} per KV head, {length}"] = seconds
    return out


def measured(make_cases, lengths: list[int], reps: int) -> dict:
    out = {}
    for length in lengths:
        cases = make_cases(length)
        seconds = interleaved(cases, reps)
        out[str(length)] = {name: {"seconds": seconds[name], "peak_bytes": peak_bytes(fn)} for name, fn in cases.items()}
    return out


ELEMENTWISE_ROWS = [  # (record key, what the table says)
    ("mx.exp", "MLX `mx.exp` (one scalar at a time)"),
    ("compiled polynomial exp", "a polynomial `exp` in MLX ops under `mx.compile`"),
    ("np.exp", "NumPy `np.exp`"),
    ("C++ softmax_rows (exp and sum)", "the C++ kernel (`exp` and a row sum)"),
    ("mx.multiply", "MLX `mx.multiply` (memory-bound yardstick)"),
    ("nn.silu(g) * u", "MLX `nn.silu(g) * u`"),
    ("C++ swiglu", "the C++ SwiGLU"),
]


def markdown(record: dict) -> str:
    """docs/cpu-training.md's tables: element rates, then attention and loss (forward + backward) per length."""
    rates = record["elementwise"]["m_elements_per_s"]
    lines = ["| exp over 16M float32 elements | M elements/s |", "|---|---|"]
    lines += [f"| {label} | {rates[key]:,.0f} |" for key, label in ELEMENTWISE_ROWS if key in rates]
    for part, title in (("attention", "one SmolLM2-135M attention layer, forward + backward"),
                        ("loss", "the loss over SmolLM2's 49,152 pieces, forward + backward")):
        cases = record[part]
        names = list(next(iter(cases.values())))
        lines += ["", f"| {title} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for length, row in cases.items():
            cells = [f"{row[n]['seconds']:.3f} s, {row[n]['peak_bytes'] / 2**20:,.0f} MiB" for n in names]
            lines.append(f"| {int(length):,} tokens | " + " | ".join(cells) + " |")
    heights = record["block_heights"]
    lines += ["", f"| queries per block (one layer at {heights['length']:,} tokens, forward + backward) | "
              + " | ".join(heights["seconds"]) + " |", "|---|" + "---|" * len(heights["seconds"]),
              "| seconds | " + " | ".join(f"{s:.2f}" for s in heights["seconds"].values()) + " |"]
    tiles = record["tile_heights"]
    names = list(next(iter(tiles.values())))
    lines += ["", "| queries per tile of the fused primitive (one layer, forward + backward, seconds) | "
              + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {case} tokens | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |" for case, row in tiles.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,4096", help="tokens of the attention and loss cases")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per case (median)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    build.load()
    results = {"kernels": dict(build.status), "blas": dict(blas_status), "matmul_gflops_before": matmul_gflops()}
    results["elementwise"] = elementwise(args.reps)
    results["attention"] = measured(attention_cases, lengths, args.reps)
    results["loss"] = measured(loss_cases, lengths, args.reps)
    results["block_heights"] = block_heights(8192, [64, 128, 256, 512], max(2, args.reps // 2))
    results["tile_heights"] = tile_heights([1024, 8192], [32, 64, 128, 256], max(2, args.reps // 2))
    results["matmul_gflops_after"] = matmul_gflops()
    print(write_results("cpu_kernels", results))
    write_between(ROOT / "docs" / "cpu-training.md", "cpu-kernels", markdown(results))


if __name__ == "__main__":
    main()
