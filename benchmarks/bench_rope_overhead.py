"""Overhead of position-id RoPE: one training step of a small llama at Lc, PoSE-patched vs unpatched.

Both models have the same weights; the patched one runs inside `use_positions` with fresh PoSE position
ids each step (cos/sin path), the unpatched one uses mlx-lm's `nn.RoPE` (`mx.fast.rope`). Steps are
interleaved (A, B, A, B, ...) so machine noise hits both alike; the median of each is reported.
Writes benchmarks/results/rope_overhead.json.
"""

import argparse
import json
import platform
import statistics
import time

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from pose_mlx import extend, use_positions
from pose_mlx.backend import status as blas_status
from pose_mlx.training.positions import pose_position_ids
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config

from benchmarks.common import write_results


def build(args):
    """A random-weight llama (the same seed for both models, so they start from identical weights)."""
    config = model_config(2048, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads)
    return build_model(config, seed=0)


def loss_fn(model, x):
    return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()


def make_step(model):
    opt = optim.AdamW(learning_rate=1e-4)
    grad = nn.value_and_grad(model, loss_fn)

    def step(x, positions=None):
        start = time.perf_counter()
        if positions is None:
            loss, g = grad(model, x)
        else:
            with use_positions(model, positions):
                loss, g = grad(model, x)
        opt.update(model, g)
        mx.eval(loss, model.parameters(), opt.state)
        return time.perf_counter() - start

    return step


def rope_per_chunk(x, ids, dims, freqs):
    """Alternative (b): one `mx.fast.rope` call per contiguous chunk of each row, offset = the chunk's first id."""
    rows = []
    for b in range(ids.shape[0]):
        starts = [0] + [int(i) + 1 for i in np.flatnonzero(np.diff(ids[b]) != 1)] + [ids.shape[1]]
        parts = [mx.fast.rope(x[b : b + 1, :, s:e], dims, traditional=False, base=None, scale=1.0,
                              offset=int(ids[b, s]), freqs=freqs) for s, e in zip(starts, starts[1:])]
        rows.append(mx.concatenate(parts, axis=2))
    return mx.concatenate(rows, axis=0)


def time_rope_op(args, rng, repeats=30):
    """Forward + backward of the RoPE op alone on (B, H, Lc, head_dim): cos/sin path vs per-chunk fast.rope."""
    from pose_mlx.model.patch import PositionRoPE, _Holder

    head_dim = args.hidden // args.heads
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim) / (args.target / args.window)
    holder = _Holder()
    rope = PositionRoPE(head_dim, inv_freq, False, holder=holder)
    x = mx.random.normal((args.batch, args.heads, args.window, head_dim))
    ids = np.stack([pose_position_ids(args.window, args.target, rng=rng) for _ in range(args.batch)])
    holder.positions = mx.array(ids)
    variants = {
        "cos_sin": lambda t: rope(t).sum(),
        "fast_rope_per_chunk": lambda t: rope_per_chunk(t, ids, head_dim, rope._freqs).sum(),
    }
    out = {name: mx.grad(fn)(x) for name, fn in variants.items()}
    max_diff = float(mx.abs(out["cos_sin"] - out["fast_rope_per_chunk"]).max())
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            mx.eval(mx.grad(fn)(x))
            times[name].append(time.perf_counter() - start)
    holder.positions = None
    return {f"{k}_s": statistics.median(v) for k, v in times.items()} | {"max_abs_grad_diff": max_diff}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512, help="training window Lc (tokens)")
    parser.add_argument("--target", type=int, default=4096, help="target length Lt for the PoSE positions")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (after 3 warm-up steps)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rope_overhead.json)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    unpatched, patched = build(args), build(args)
    extend(patched, "linear", args.window, args.target)
    step_u, step_p = make_step(unpatched), make_step(patched)
    times = {"unpatched": [], "patched": []}
    for i in range(args.steps + 3):
        x = mx.array(rng.integers(0, 2048, size=(args.batch, args.window + 1)))
        ids = np.stack([pose_position_ids(args.window, args.target, rng=rng) for _ in range(args.batch)])
        tu = step_u(x)
        tp = step_p(x, ids)
        if i >= 3:
            times["unpatched"].append(tu)
            times["patched"].append(tp)
    result = {
        "patched_step_s": statistics.median(times["patched"]),
        "unpatched_step_s": statistics.median(times["unpatched"]),
        "implementation": "cos/sin from position_ids * inv_freq (PositionRoPE._rotate_at)",
        "device": str(mx.default_device()),
        "blas": blas_status.get("library"),
        "mlx": mx.__version__,
        "machine": platform.machine(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    result["overhead"] = result["patched_step_s"] / result["unpatched_step_s"] - 1
    result["rope_op_forward_backward"] = time_rope_op(args, rng)
    path = write_results("rope_overhead", result, args.out)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
