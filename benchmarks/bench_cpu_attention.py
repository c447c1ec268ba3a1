"""Chunked prefill of a SmolLM2-135M-shaped llama on MLX's CPU backend: the fast evaluation path against MLX's.

A random-weight mlx-lm llama with SmolLM2-135M's shapes (30 layers, hidden 576, FFN 1536, 9 query / 3 KV
heads of dim 64, vocab 49152, tied embeddings; random weights cost the same FLOPs as trained ones) prefills
random tokens through a KV cache, `--chunk` tokens at a time. Variants, timed interleaved (mlx, fast,
fast_all, mlx, ...) at each length:
  mlx       the prefill before `pose_mlx.eval.cpu_attention`: model(chunk, cache) with mlx-lm's attention
            (`mx.fast.scaled_dot_product_attention`) and the logits of every position;
  fast      `pose_mlx.eval.longctx.prefill` as the passkey evaluator and generation call it: NumPy-softmax attention
            and the logits of the last position only;
  fast_all  the same attention with the logits of every position (the perplexity path, `chunked_nll`).
Each variant keeps every `--sample-every`-th row of logits (and the last); exactness is the largest
|fast - mlx| / max |mlx| over those rows. Lengths above `--once-above` run each variant once (the MLX path
takes many minutes there), shorter ones `--reps` times (the median is reported).

Effective FLOPs (the same count for every variant, so GFLOP/s compare like seconds):
    flops = 2 * P * T + 2 * 2 * layers * heads * head_dim * T (T + 1) / 2
P = parameters in matrix products (q, k, v, o, gate, up, down of every layer, and the vocab x hidden output
head; the embedding lookup is not a product), T = tokens; the second term is QK^T and PV over the keys each
query attends causally (query t sees t + 1 keys). The fast variant skips the head for all but one position,
which its effective GFLOP/s credits it with. A 2048^2 fp32 matmul is timed before and after as the peak.
Writes benchmarks/results/cpu_attention.json and cpu_attention.png.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from pose_mlx.eval import cpu_attention, longctx
from pose_mlx.backend import status as blas_status
from benchmarks.common import RESULTS_DIR, SMOLLM2_135M, matmul_gflops, random_model, write_results

FORMULA = ("flops = 2 * P * T + 2 * 2 * layers * heads * head_dim * T * (T + 1) / 2; P = parameters in matrix "
           "products (attention and MLP projections of every layer plus the vocab x hidden output head), "
           "T = prompt tokens; the same count for every variant")
VARIANTS = ("mlx", "fast", "fast_all")


def matmul_params(model, config: dict) -> int:
    """Weights that enter matrix products: every Linear of the layers, plus the output head."""
    layers = sum(p.size for name, p in tree_flatten(model.model.parameters())
                 if name.startswith("layers.") and name.endswith("proj.weight"))
    return layers + config["vocab_size"] * config["hidden_size"]


def effective_flops(params: int, config: dict, tokens: int) -> float:
    attention = 4 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"]
    return 2.0 * params * tokens + attention * tokens * (tokens + 1) / 2


def mlx_prefill(model, tokens: np.ndarray, chunk: int, on_chunk) -> mx.array:
    """The prefill loop as it was before the fast path: every position's logits, mlx-lm's attention."""
    ids, cache, last = mx.array(tokens), make_prompt_cache(model), None
    for start in range(0, ids.size, chunk):
        logits = model(ids[None, start : start + chunk], cache=cache)[0].astype(mx.float32)
        on_chunk(start, logits)
        last = logits[-1]
        mx.eval(last)
        mx.eval([c.state for c in cache])
    return last


def run_variant(variant: str, model, tokens: np.ndarray, chunk: int, sample_every: int) -> tuple[float, dict]:
    """Seconds of one prefill and the sampled logits rows {position: row}."""
    rows: dict[int, np.ndarray] = {}

    def keep(start: int, logits: mx.array) -> None:
        picks = [i for i in range(logits.shape[0]) if (start + i) % sample_every == 0]
        if picks:
            taken = np.array(logits[mx.array(picks)])
            rows.update({start + i: row for i, row in zip(picks, taken)})

    t0 = time.perf_counter()
    if variant == "mlx":
        last = mlx_prefill(model, tokens, chunk, keep)
    else:
        last = longctx.prefill(model, tokens, make_prompt_cache(model), chunk,
                               keep if variant == "fast_all" else None)
    seconds = time.perf_counter() - t0
    rows[tokens.size - 1] = np.array(last)
    return seconds, rows


def max_relative(rows: dict, reference: dict) -> float:
    common = sorted(set(rows) & set(reference))
    a = np.stack([rows[i] for i in common]).astype(np.float64)
    b = np.stack([reference[i] for i in common]).astype(np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def plot(path: Path, lengths: list[int], series: dict) -> Path:
    from pose_mlx.plots import line_vs_length

    return line_vs_length(path, lengths, series, "effective GFLOP/s",
                          "SmolLM2-135M-shaped prefill on MLX's CPU backend")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,8k,16k", help="prompt lengths (default 2k,8k,16k)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    parser.add_argument("--reps", type=int, default=2, help="runs per variant at the shorter lengths (default 2)")
    parser.add_argument("--once-above", type=int, default=8192,
                        help="lengths above this run each variant once (default 8192)")
    parser.add_argument("--sample-every", type=int, default=256, help="logits row sampling for exactness")
    parser.add_argument("--output", default=str(RESULTS_DIR / "cpu_attention.json"))
    args = parser.parse_args()

    lengths = longctx.parse_lengths(args.lengths)
    model = random_model(SMOLLM2_135M)
    params = matmul_params(model, SMOLLM2_135M)
    rng = np.random.default_rng(0)
    peak_before = matmul_gflops()
    results = []
    for length in lengths:
        tokens = rng.integers(0, SMOLLM2_135M["vocab_size"], size=length).astype(np.int32)
        reps = 1 if length > args.once_above else args.reps
        seconds = {v: [] for v in VARIANTS}
        rows = {}
        for rep in range(reps):
            for variant in VARIANTS:
                s, rows[variant] = run_variant(variant, model, tokens, args.chunk, args.sample_every)
                seconds[variant].append(s)
                print(f"{length:>6} {variant:>8} rep {rep}: {s:8.2f} s", file=sys.stderr, flush=True)
        flops = effective_flops(params, SMOLLM2_135M, length)
        record = {"length": length, "reps": reps, "effective_gflop": flops / 1e9}
        for variant in VARIANTS:
            median = statistics.median(seconds[variant])
            record[variant] = {"seconds": median, "all_seconds": seconds[variant],
                               "gflops": flops / median / 1e9}
        record["speedup_fast"] = record["mlx"]["seconds"] / record["fast"]["seconds"]
        record["speedup_fast_all"] = record["mlx"]["seconds"] / record["fast_all"]["seconds"]
        last = length - 1
        record["max_rel_diff_last_logits"] = {
            v: max_relative({last: rows[v][last]}, {last: rows["mlx"][last]}) for v in ("fast", "fast_all")}
        record["max_rel_diff_sampled_logits_fast_all"] = max_relative(rows["fast_all"], rows["mlx"])
        record["sampled_rows"] = len(rows["mlx"])
        results.append(record)
        print({k: v for k, v in record.items() if k not in VARIANTS}, file=sys.stderr, flush=True)
    peak_after = matmul_gflops()

    out = Path(args.output)
    series = {f"{v}": [r[v]["gflops"] for r in results] for v in VARIANTS}
    png = plot(out.with_suffix(".png"), lengths, series)
    path = write_results("cpu_attention", {
        "config": SMOLLM2_135M, "chunk": args.chunk, "matmul_params": params, "formula": FORMULA,
        "variants": {"mlx": "model(chunk, cache): mlx-lm attention (mx.fast.scaled_dot_product_attention), "
                            "logits of every position",
                     "fast": "pose_mlx.eval.longctx.prefill: pose_mlx.eval.cpu_attention, logits of the last position",
                     "fast_all": "pose_mlx.eval.cpu_attention, logits of every position (chunked_nll's path)"},
        "attention_workers": cpu_attention._WORKERS.count, "blas_library": blas_status.get("library"),
        "matmul_2048_gflops": {"before": peak_before, "after": peak_after},
        "results": results, "plot": png.name,
    }, out)
    print(f"wrote {path} and {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
