"""A LoRA training update of a SmolLM2-135M-shaped llama on MLX's CPU backend, with and without the NumPy attention.

The model (random weights, SmolLM2-135M's shapes, `--layers` of its 30 blocks; see bench_cpu_attention.py) is
PoSE-extended (`pose_mlx.extend`, linear, `--window` -> `--window` * `--factor`) and gets LoRA adapters on
every linear layer of every block (mlx-lm's `linear_to_lora_layers`, rank `--rank`), as `pose_mlx.finetune`
does. One update is `pose_mlx.training.loop.make_update`'s: forward, backward, clipping and AdamW over a PoSE batch of
`--batch` x `--window` tokens from `pose_mlx.training.data.ExampleStream`. Variants, each with its own model and
stream (same seeds, so the same batches), timed interleaved for `--steps` updates after `--warmup`:
  compiled_mlx  TrainConfig(compile=True) (the default): the gradients under mx.compile, mlx-lm's
                attention (`mx.fast.scaled_dot_product_attention`; on the CPU it materialises softmax(QK^T));
  eager_mlx     TrainConfig(compile=False);
  eager_fast    eager_mlx run inside `pose_mlx.eval.cpu_attention.fast_attention(model)`: the NumPy forward and
                backward of the attention (MLX cannot evaluate inside mx.compile, hence eager).
Losses and gradient norms of the variants must agree (they start from the same weights and see the same
batches). Peak memory is MLX's allocator peak during an update; the NumPy attention's scratch (a few MiB per
worker thread) is not in it. Evaluating inside the gradient trace keeps every intermediate array of the
update alive until the backward pass is built, so eager_fast needs far more memory: with all 30 blocks at a
2k window it does not fit in 24 GiB, hence `--layers`. Writes benchmarks/results/cpu_attention_train.json.
"""

import argparse
import dataclasses
import statistics
import sys
import time

import pose_mlx  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from pose_mlx import extend, use_positions
from pose_mlx.eval.cpu_attention import fast_attention
from pose_mlx.training.data import ExampleStream
from pose_mlx.training.loop import TrainConfig, make_optimizer, make_update

from benchmarks.common import RESULTS_DIR, SMOLLM2_135M, random_model, synthetic_corpus, write_results

VARIANTS = {"compiled_mlx": dict(compile=True), "eager_mlx": dict(compile=False), "eager_fast": dict(compile=False)}


def make_variant(args, corpus, config: TrainConfig, fast: bool):
    model = random_model({**SMOLLM2_135M, "num_hidden_layers": args.layers})
    extend(model, "linear", args.window, args.window * args.factor)
    model.freeze()
    mx.random.seed(1)
    linear_to_lora_layers(model, len(model.layers), {"rank": args.rank, "scale": 20.0, "dropout": 0.0})
    update = make_update(model, make_optimizer(config), config, use_positions)
    batches = iter(ExampleStream(corpus, args.window, args.window * args.factor, sampler="pose",
                                 batch_size=args.batch, seed=0))

    def step():
        mx.clear_cache()  # the variants take turns: buffers one freed are not kept for the next
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        with fast_attention(model, enabled=fast) as routed:
            assert bool(routed) == fast
            loss, norm, _tokens, _stop = update(batches)
        return time.perf_counter() - t0, loss, norm, mx.get_peak_memory() / 2**30

    trainable = sum(p.size for _, p in tree_flatten(model.trainable_parameters()))
    return step, trainable


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2048, help="training window Lc (default 2048)")
    parser.add_argument("--layers", type=int, default=8,
                        help="transformer blocks (default 8 of SmolLM2-135M's 30: with all 30 at a 2k window the "
                             "eager_fast variant needs more than 24 GiB)")
    parser.add_argument("--factor", type=int, default=4, help="extension ratio Lt / Lc (default 4)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per update (default 1)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per variant first (default 1)")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="largest allowed relative difference of losses and gradient norms (default 1e-4)")
    parser.add_argument("--output", default=str(RESULTS_DIR / "cpu_attention_train.json"))
    args = parser.parse_args()

    corpus = synthetic_corpus(SMOLLM2_135M["vocab_size"], docs=8, length=args.window * args.factor)
    total = args.warmup + args.steps
    base = TrainConfig(steps=total, lr=1e-4, warmup=1, progress=False)
    steps, trainable = {}, 0
    for name, flags in VARIANTS.items():
        steps[name], trainable = make_variant(args, corpus, dataclasses.replace(base, **flags), name == "eager_fast")
    times = {name: [] for name in VARIANTS}
    losses = {name: [] for name in VARIANTS}
    norms = {name: [] for name in VARIANTS}
    peaks = {name: 0.0 for name in VARIANTS}
    for i in range(total):
        for name, step in steps.items():
            seconds, loss, norm, peak = step()
            losses[name].append(loss)
            norms[name].append(norm)
            peaks[name] = max(peaks[name], peak)
            if i >= args.warmup:
                times[name].append(seconds)
            print(f"update {i + 1}/{total} {name:>12}: {seconds:7.2f} s, loss {loss:.6f}, grad norm {norm:.6f}, "
                  f"peak MLX memory {peak:.2f} GiB", file=sys.stderr, flush=True)

    def worst(values: dict) -> float:
        ref = values["compiled_mlx"]
        return max(abs(v - r) / abs(r) for name in values for v, r in zip(values[name], ref))

    agreement = {"loss": worst(losses), "grad_norm": worst(norms)}
    step_s = {name: statistics.median(t) for name, t in times.items()}
    results = {
        "config": {**{k: v for k, v in vars(args).items() if k != "output"},
                   "model": {**SMOLLM2_135M, "num_hidden_layers": args.layers}},
        "variants": {name: dataclasses.asdict(dataclasses.replace(base, **flags)) for name, flags in VARIANTS.items()},
        "trainable_parameters": trainable,
        "step_s": step_s,
        "all_step_s": times,
        "peak_mlx_memory_gib": peaks,
        "speedup_eager_fast_vs_compiled_mlx": step_s["compiled_mlx"] / step_s["eager_fast"],
        "speedup_eager_fast_vs_eager_mlx": step_s["eager_mlx"] / step_s["eager_fast"],
        "losses": losses,
        "grad_norms": norms,
        "max_rel_diff_vs_compiled_mlx": agreement,
        "agree": all(v <= args.tol for v in agreement.values()),
    }
    path = write_results("cpu_attention_train", results, args.output)
    print({k: results[k] for k in ("step_s", "speedup_eager_fast_vs_compiled_mlx", "max_rel_diff_vs_compiled_mlx")},
          file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
