"""MLX on CPU with its stock BLAS vs the fast BLAS that pose_mlx loads, side by side in one run.

The BLAS is fixed when `pose_mlx` is imported, before `mlx.core` (see pose_mlx/backend.py), so each
configuration runs in its own child process: ``POSE_MLX_BLAS=off`` (MLX's bundled reference BLAS) and
``POSE_MLX_BLAS=<--fast-blas>`` (default ``auto``: the faster of OpenBLAS and MKL on this machine, measured once
and cached), and once with each library present on its own (``openblas``, ``mkl``). Each child measures
  1. fp32 N x N matmul throughput, 2 N^3 / t  (median t over repeats, after one warm-up);
  2. one training step of a small mlx-lm llama: forward + backward + AdamW update on random tokens
     (median over steps, after warm-up steps).
Writes benchmarks/results/backend.json with stock_/fast_ medians, their ratios, under "best" the fastest
single repeat of each (less sensitive to other processes on a shared machine), under "libraries" each library's
fastest repeat, and the goals' ratios: the choice against the fastest library (>= 0.85) and against stock (>= 20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import child_env, write_results


def _times(fn, min_reps: int, min_seconds: float) -> list[float]:
    """Wall times of `fn()` over at least `min_reps` calls and `min_seconds` in total."""
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure(args) -> dict:
    """Run in a child process: import pose_mlx (loads the BLAS chosen by $POSE_MLX_BLAS), then measure."""
    import pose_mlx  # noqa: F401
    from pose_mlx.backend import status

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config

    mx.random.seed(0)
    n = args.size
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    matmul = lambda: mx.eval(a @ b)  # noqa: E731
    matmul()  # warm-up
    matmul_times = _times(matmul, args.matmul_reps, args.min_seconds)

    config = model_config(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          max_position_embeddings=args.seq)
    model = build_model(config, seed=0)
    optimizer = optim.AdamW(learning_rate=1e-4)
    tokens = mx.random.randint(0, args.vocab, (args.batch, args.seq + 1))

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y).mean()

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step():
        loss, grads = loss_and_grad(model, tokens[:, :-1], tokens[:, 1:])
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)

    for _ in range(args.warmup_steps):
        step()
    step_times = _times(step, args.steps, 0.0)
    flop = 2 * n**3
    return {"gflops": flop / statistics.median(matmul_times) / 1e9, "step_s": statistics.median(step_times),
            "best_gflops": flop / min(matmul_times) / 1e9, "best_step_s": min(step_times),
            "blas_library": status.get("library") and os.path.basename(status["library"]),
            "blas_reason": status.get("reason"),
            "device": str(mx.default_device()), "mlx_version": mx.__version__}


def run_child(blas: str, argv: list[str]) -> dict:
    """Run this benchmark with --child under POSE_MLX_BLAS=`blas`; return the JSON it prints last."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_backend", "--child", *argv],
                          env=child_env(POSE_MLX_BLAS=blas), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child with POSE_MLX_BLAS={blas} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="matmul size N (fp32 N x N @ N x N)")
    parser.add_argument("--matmul-reps", type=int, default=5, help="minimum timed matmuls")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="minimum total matmul timing per config")
    parser.add_argument("--hidden", type=int, default=256, help="llama width")
    parser.add_argument("--layers", type=int, default=4, help="llama layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed training steps first")
    parser.add_argument("--fast-blas", default="auto", help="POSE_MLX_BLAS value for the fast run (default auto)")
    parser.add_argument("--out", default=None, help="output JSON (default benchmarks/results/backend.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    if args.fast_blas.lower() in ("off", "none", "0", "false", "stock"):
        parser.error("--fast-blas must name a BLAS (auto, openblas, mkl or a path), not disable it")

    forwarded = [a for a in sys.argv[1:] if a != "--child"]
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    stock = run_child("off", forwarded)
    libraries = {}
    for name in ("openblas", "mkl"):
        run = run_child(name, forwarded)
        if run["blas_library"] is not None:
            libraries[name] = run
    fast = run_child(args.fast_blas, forwarded)
    if fast["blas_library"] is None:
        print(f"warning: the fast run loaded no BLAS ({fast['blas_reason']})", file=sys.stderr)
    fastest = max([run["best_gflops"] for run in libraries.values()], default=None)
    results = {
        "stock_gflops": stock["gflops"],
        "fast_gflops": fast["gflops"],
        "stock_step_s": stock["step_s"],
        "fast_step_s": fast["step_s"],
        "matmul_speedup": fast["gflops"] / stock["gflops"],
        "step_speedup": stock["step_s"] / fast["step_s"],
        "best": {f"{name}_{key}": run[f"best_{key}"] for name, run in (("stock", stock), ("fast", fast))
                 for key in ("gflops", "step_s")},
        # every library present, each in its own process: best-of-repeats GFLOP/s and training-step seconds
        "libraries": {name: {"library": run["blas_library"], "gflops": run["best_gflops"],
                             "step_s": run["best_step_s"]} for name, run in libraries.items()},
        # goals: the choice within 15% of the fastest library present, and >= 20x the stock wheel
        "fast_vs_fastest": fast["best_gflops"] / fastest if fastest else None,
        "fast_vs_stock": fast["best_gflops"] / stock["best_gflops"],
        "blas_library": fast["blas_library"],
        "stock_blas": stock["blas_reason"],
        "device": fast["device"],
        "load_average_1min_before": load_before,
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
    }
    path = write_results("backend", results, args.out)
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
