"""Model-FLOP utilisation (MFU) of a PoSE fine-tuning update against this machine's fp32 matmul peak.

Peak and steps are measured side by side in one process:
  - peak FLOP/s = 2 N^3 / t, t the median time of an fp32 N x N matmul (N = `--matmul-size`) after warm-up;
    measured before and after the step timings (the machine is noisy) and their mean is used;
  - one full fine-tuning update (forward, backward, gradient clipping, AdamW) of a random-weight mlx-lm llama
    extended with `pose_mlx.extend(model, "linear", Lc, Lc * factor)`, on PoSE batches from the real data path
    (`pose_mlx.training.data.ExampleStream` over a synthetic corpus), in two variants timed interleaved (A, B, A, B, ...)
    for `--steps` updates after `--warmup` (median per variant; each update includes drawing its batch):
      eager     the product's step, `pose_mlx.training.loop.make_update` with `TrainConfig(compile=False)`;
      compiled  the same with `compile=True` (the default of `pose_mlx.training.loop.train`): gradients and the
                optimizer update under `mx.compile`, positions passed in as an array argument.
    Each variant has its own model (same seed) and its own stream (same seed), so both see the same batches;
    their losses must agree to `--loss-tol` (the first update starts from identical weights).

FLOPs per update (PaLM's convention, appendix B):
    flops = 6 * P * T + 12 * layers * hidden * S * T
with P the number of parameters (tied embeddings counted once), T = batch * (Lc - 1) target tokens per update
and S = Lc - 1 the sequence length; the second term is the attention scores and weighted sums over the full
S x S square (causal masking not discounted). MFU = flops / step seconds / peak FLOP/s.
Writes benchmarks/results/mfu.json.
"""

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

from pose_mlx import extend, use_positions
from pose_mlx.backend import status as blas_status
from pose_mlx.training.data import ExampleStream
from pose_mlx.model.source import build_model
from pose_mlx.toy import model_config
from pose_mlx.training.loop import TrainConfig, make_optimizer, make_update

from benchmarks.common import RESULTS_DIR, matmul_gflops, synthetic_corpus, write_results

FORMULA = ("flops_per_step = 6 * P * T + 12 * layers * hidden * S * T; P = parameters (tied embeddings once), "
           "T = batch * (window - 1) target tokens per update, S = window - 1 (attention over the full S x S "
           "square, PaLM's convention); MFU = flops_per_step / step_s / peak, peak = 2 N^3 / t_matmul "
           "(N = matmul_size, mean of the peaks measured before and after the steps)")


def build(args):
    """A random-weight llama (seed 0, so every call gives identical weights), PoSE-extended to Lc * factor."""
    config = model_config(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                          max_position_embeddings=args.window)
    model = build_model(config, seed=0)
    extend(model, "linear", args.window, args.window * args.factor)  # returns the Extension record, not the model
    return model


def make_variant(args, corpus, config: TrainConfig):
    """The product's update, `pose_mlx.training.loop.make_update` (what `pose_mlx.training.loop.train` runs), for `config`
    (its `compile` flag picks the variant), on its own model and PoSE batch stream."""
    model = build(args)
    update = make_update(model, make_optimizer(config), config, use_positions)
    batches = iter(ExampleStream(corpus, args.window, args.window * args.factor, sampler="pose",
                                 batch_size=args.batch, seed=0))

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = update(batches).loss
        return time.perf_counter() - t0, loss

    return model, step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    parser.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--window", type=int, default=512, help="training window Lc (tokens; default 512)")
    parser.add_argument("--factor", type=int, default=8, help="extension ratio Lt / Lc (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per update (default 4)")
    parser.add_argument("--steps", type=int, default=10, help="timed updates per variant (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed updates per variant before them; the first compiles (default 2)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="N of the N x N fp32 peak matmul (default 2048)")
    parser.add_argument("--matmul-reps", type=int, default=10,
                        help="timed matmuls per peak measurement, after 2 warm-up ones (default 10)")
    parser.add_argument("--loss-tol", type=float, default=1e-4,
                        help="largest allowed |loss_eager - loss_compiled| over the updates (default 1e-4)")
    parser.add_argument("--changes", action="append", default=[],
                        help="what was changed in the code for this run, recorded in the JSON (repeatable; "
                             "default none)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "mfu.json"),
                        help="JSON path (default benchmarks/results/mfu.json)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.window < 2 or args.factor < 1 or args.batch < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, --window >= 2, --factor >= 1, --batch >= 1")

    corpus = synthetic_corpus(args.vocab, docs=16, length=args.window * 4)
    total = args.warmup + args.steps
    config = TrainConfig(steps=total, lr=1e-5, warmup=1, progress=False)

    peak_before = matmul_gflops(args.matmul_size, args.matmul_reps)
    print(f"peak before: {peak_before:.1f} GFLOP/s ({args.matmul_size}^2 fp32 matmul)", flush=True)

    model, eager = make_variant(args, corpus, dataclasses.replace(config, compile=False))
    _, compiled = make_variant(args, corpus, config)
    variants = {"eager": eager, "compiled": compiled}
    times = {name: [] for name in variants}
    losses = {name: [] for name in variants}
    for i in range(total):
        seconds = {}
        for name, step in variants.items():
            seconds[name], loss = step()
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(seconds[name])
        print(f"update {i + 1}/{total}{' (warm-up)' if i < args.warmup else ''}: "
              + ", ".join(f"{n} {seconds[n]:.3f} s loss {losses[n][-1]:.5f}" for n in variants), flush=True)

    peak_after = matmul_gflops(args.matmul_size, args.matmul_reps)
    print(f"peak after: {peak_after:.1f} GFLOP/s", flush=True)

    diffs = [abs(a - b) for a, b in zip(losses["eager"], losses["compiled"])]
    if not all(np.isfinite(losses["eager"] + losses["compiled"])) or max(diffs) > args.loss_tol:
        sys.exit(f"eager and compiled updates disagree: |loss difference| per update {diffs} "
                 f"(tolerance {args.loss_tol}); nothing written")

    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    seq = args.window - 1
    tokens = args.batch * seq
    flops = 6 * parameters * tokens + 12 * args.layers * args.hidden * seq * tokens
    peak = (peak_before + peak_after) / 2 * 1e9
    step_s = {name: statistics.median(t) for name, t in times.items()}
    mfu = {name: flops / s / peak for name, s in step_s.items()}
    best = max(mfu, key=mfu.get)
    results = {
        "mfu": mfu[best],
        "mfu_by_variant": mfu,
        "step_s_by_variant": step_s,
        "best_step_s_by_variant": {name: min(t) for name, t in times.items()},
        "tokens_per_s_by_variant": {name: tokens / s for name, s in step_s.items()},
        "best_variant": best,
        "compiled_speedup": step_s["eager"] / step_s["compiled"],
        "peak_gflops": peak / 1e9,
        "peak_gflops_before": peak_before,
        "peak_gflops_after": peak_after,
        "flops_per_step": flops,
        "attention_flops_share": 12 * args.layers * args.hidden * seq * tokens / flops,
        "parameters": parameters,
        "tokens_per_step": tokens,
        "max_abs_loss_diff": max(diffs),
        "loss_diff_first_update": diffs[0],
        "formula": FORMULA,
        "changes": args.changes,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "changes")},
        "device": str(mx.default_device()),
        "blas": blas_status.get("library"),
    }
    path = write_results("mfu", results, args.out)
    print(f"\n{parameters / 1e6:.2f}M parameters, {tokens} tokens/update, {flops / 1e9:.2f} GFLOP/update "
          f"({results['attention_flops_share']:.1%} attention)")
    print(f"peak {peak / 1e9:.1f} GFLOP/s (before {peak_before:.1f}, after {peak_after:.1f})")
    for name in variants:
        print(f"{name:>8}: {step_s[name]:.4f} s/update, {flops / step_s[name] / 1e9:.1f} GFLOP/s, "
              f"MFU {mfu[name]:.1%}")
    print(f"best: {best} (MFU {mfu[best]:.1%}); compiled / eager speed-up {results['compiled_speedup']:.2f}x; "
          f"max |loss diff| {max(diffs):.2e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
