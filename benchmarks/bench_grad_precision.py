"""Does training in float16 lose the LoRA gradients? The evidence's PoSE + YaRN step computed in several precisions.

    python -m benchmarks.bench_grad_precision [--work DIR] [--windows N]

The same recipe fine-tuned on a GPU (GGUF kept quantized, activations and their gradients in float16, no loss
scaling) ends worse than fine-tuned on the CPU (everything float32); see docs/evidence.md. This benchmark asks
whether one update's gradients already differ. It loads the CPU-trained run as bench_evidence builds it
(`<work>/runs/pose-yarn-lr3e-5`: base weights plus its trained LoRA adapters, B != 0, so A and B both get
gradients), takes `--windows` 1024-token
windows of the training corpus (`<work>/corpus/train`) with PoSE position ids (window 1024, target 32768, seeded), and computes the
gradient of the training loss L = sum_t CE_t / T with respect to every LoRA matrix:

- `float32`: the reference (the CPU's training);
- `float16`: base weights and activations in float16, the LoRA matrices float32 as mlx-lm creates them (the
  GPU's training, minus the quantized matmul: the Q4_1 weights are dequantized exactly and then rounded to float16);
- `float16-scaled`: the same with the loss multiplied by 2^S before the backward pass and the gradients divided
  by it after (static loss scaling);
- `bfloat16`: base weights and activations in bfloat16 (float32's exponent range, 8 bits of mantissa).

For each variant and LoRA matrix g against the float32 g*: the relative error ||g - g*|| / ||g*||, the cosine,
the share of entries that are exactly 0 where g* is not (a LoRA gradient itself underflowing), and the share of
entries whose sign differs from g*'s among those with |g*| above the matrix's median (what Adam, which normalises
each entry, acts on); the six matrices with the lowest cosine. Writes
benchmarks/results/grad_precision/grad_precision.json after each variant. On a 2-core CPU the float32 gradient
of one window takes about a minute and each half-precision one 5-8 minutes.

Measured 2026-11-27 (CPU, 1 window): float16 cosine 0.969 on average and 0.103 at worst (the value projections of
blocks 28 and 29 among the six worst), no LoRA entry exactly 0 (the digits are lost inside the backward pass, not
in the LoRA gradients); loss x 4096 restores them (0.99997, worst 0.9998); bfloat16 0.998, worst 0.972.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import pose_mlx  # noqa: F401  (before mlx: it loads the fast BLAS)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from benchmarks.common import RESULTS_DIR, write_results
from pose_mlx.model.patch import use_positions
from pose_mlx.model.source import load
from pose_mlx.training.loop import masked_loss, scaled_value_and_grad
from pose_mlx.training.positions import pose_position_ids

OUT = RESULTS_DIR / "grad_precision" / "grad_precision.json"
RUN = "pose-yarn-lr3e-5"
WINDOW, TARGET = 1024, 32768
LOSS_SCALE_BITS = 12


def windows(tokenizer, corpus: Path, count: int, seed: int) -> list[np.ndarray]:
    """`count` windows of WINDOW + 1 tokens, each from the start of a different seeded-random document."""
    rng = np.random.default_rng(seed)
    files = sorted(corpus.iterdir())
    out = []
    for i in rng.permutation(len(files)):
        ids = tokenizer.encode(files[i].read_text(errors="replace"))
        if len(ids) > WINDOW:
            out.append(np.array(ids[:WINDOW + 1]))
        if len(out) == count:
            return out
    raise SystemExit(f"{corpus}: fewer than {count} documents longer than {WINDOW} tokens")


def cast_base(model: nn.Module, dtype) -> None:
    """Base weights (every parameter but the LoRA matrices) to `dtype`; LoRA stays float32."""
    def cast(path, x):
        keep = path.endswith(("lora_a", "lora_b")) or not mx.issubdtype(x.dtype, mx.floating)
        return x if keep else x.astype(dtype)
    model.update(tree_map_with_path(cast, model.parameters()))


def load_trainable(run: Path):
    """The run's model with only its LoRA matrices trainable, as in training (mlx-lm's `load_adapters` leaves
    the base weights trainable too)."""
    model, tokenizer = load(run)
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    return model, tokenizer


def lora_grads(model: nn.Module, batch: list[np.ndarray], positions: list[np.ndarray], scale: float) -> dict:
    """Sum over the windows of d(scale * L)/d(LoRA) / scale (the training loop's `scaled_value_and_grad`), as
    float32 NumPy arrays keyed by parameter path."""
    grad_fn = scaled_value_and_grad(model, masked_loss, scale)
    total = {}
    for ids, pos in zip(batch, positions):
        x, y = mx.array(ids[None, :-1]), mx.array(ids[None, 1:])
        mask = mx.ones(y.shape, dtype=mx.float32)
        with use_positions(model, mx.array(pos[None, :])):
            _, grads = grad_fn(model, x, y, mask)
        flat = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(grads) if v.size}
        total = {k: total.get(k, 0) + v for k, v in flat.items()}
    return total


def compare(g: dict, ref: dict) -> dict:
    rel, cos, under, flips = [], [], [], []
    per_matrix = {}
    for k, r in ref.items():
        a = g[k]
        nr = np.linalg.norm(r)
        rel.append(np.linalg.norm(a - r) / nr)
        cos.append(float(a.ravel() @ r.ravel() / (np.linalg.norm(a) * nr + 1e-30)))
        nz = r != 0
        under.append(float(np.mean((a == 0) & nz) / max(np.mean(nz), 1e-30)))
        big = np.abs(r) > np.median(np.abs(r))
        flips.append(float(np.mean(np.sign(a[big]) != np.sign(r[big]))))
        per_matrix[k] = {"rel_error": round(float(rel[-1]), 5), "cosine": round(cos[-1], 5),
                         "underflow": round(under[-1], 5), "sign_flips_top_half": round(flips[-1], 5)}
    summary = {"rel_error_mean": float(np.mean(rel)), "rel_error_max": float(np.max(rel)),
               "cosine_mean": float(np.mean(cos)), "cosine_min": float(np.min(cos)),
               "underflow_mean": float(np.mean(under)), "sign_flips_top_half_mean": float(np.mean(flips))}
    worst = sorted(per_matrix, key=lambda k: per_matrix[k]["cosine"])[:6]
    return {"summary": {k: round(v, 6) for k, v in summary.items()}, "worst_by_cosine": {k: per_matrix[k] for k in worst}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("out/real_model"),
                   help="bench_evidence's work folder (default out/real_model)")
    p.add_argument("--windows", type=int, default=2, help="1024-token windows per gradient")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=["float16", "float16-scaled", "bfloat16"])
    args = p.parse_args(argv)
    args.run, args.corpus = args.work / "runs" / RUN, args.work / "corpus" / "train"

    model, tokenizer = load_trainable(args.run)
    batch = windows(tokenizer, args.corpus, args.windows, args.seed)
    rng = np.random.default_rng(args.seed)
    positions = [pose_position_ids(WINDOW, TARGET, rng=rng) for _ in batch]
    device = f"{mx.default_device()} {mx.device_info().get('device_name', '?')}"
    results = {"device": device, "run": str(args.run), "windows": args.windows, "window": WINDOW, "target": TARGET,
               "loss_scale": 2 ** LOSS_SCALE_BITS, "variants": {}}

    t = time.perf_counter()
    ref = lora_grads(model, batch, positions, 1.0)
    results["float32_seconds"] = round(time.perf_counter() - t, 1)
    results["float32_grad_norm"] = float(np.sqrt(sum(float((v ** 2).sum()) for v in ref.values())))
    print(f"float32: {results['float32_seconds']} s", file=sys.stderr)
    for name in args.variants:
        model, _ = load_trainable(args.run)
        cast_base(model, mx.bfloat16 if name == "bfloat16" else mx.float16)
        t = time.perf_counter()
        g = lora_grads(model, batch, positions, 2.0 ** LOSS_SCALE_BITS if name.endswith("scaled") else 1.0)
        entry = compare(g, ref)
        entry["seconds"] = round(time.perf_counter() - t, 1)
        results["variants"][name] = entry
        print(f"{name}: {entry['seconds']} s {entry['summary']}", file=sys.stderr)
        write_results("grad_precision", results, OUT)  # after each variant: a slow run keeps what it finished
    print(OUT)


if __name__ == "__main__":
    main()
