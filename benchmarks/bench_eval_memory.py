"""Peak memory and speed of long-context evaluation at 1x, 2x, 4x, 8x a small model's original window.

For each length L the NLL of every token of one L-token sequence is computed twice: by chunked prefill
through the KV cache (`pose_mlx.eval.longctx.chunked_nll`, what `pose_mlx.perplexity` and `pose_mlx.passkey` use)
and by one full forward (the L x L attention at once), side by side in one run. Peak memory is
`mx.get_peak_memory()` after `mx.reset_peak_memory()` (weights included); tokens/s is the best of `--repeats`.
Target: chunked peak at 8x <= 1.5 x chunked peak at 1x. Writes benchmarks/results/eval_memory.json.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx
from mlx_lm.models import llama

from benchmarks.common import write_results
from pose_mlx.eval import longctx
from pose_mlx.backend import status as blas_status
from pose_mlx.memory import eval_memory


def model_config(args) -> dict:
    return dict(model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                  intermediate_size=args.hidden * 8 // 3, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, rms_norm_eps=1e-5, vocab_size=args.vocab, rope_theta=10000.0,
                  tie_word_embeddings=True, max_position_embeddings=args.original, torch_dtype="float32")


def build(args) -> llama.Model:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(model_config(args)))
    mx.eval(model.parameters())
    return model


def full_nll(model, tokens: np.ndarray) -> np.ndarray:
    """Reference: one forward over the whole sequence (attention scores L x L)."""
    ids = mx.array(tokens)
    logits = model(ids[None, :-1])[0].astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, ids[1:, None], axis=-1)[:, 0]
    return np.array(nll, dtype=np.float64)


def measure(fn, repeats: int) -> tuple[float, float, np.ndarray]:
    """(peak bytes, best seconds, result) of `fn()`."""
    best, peak, out = float("inf"), 0, None
    for _ in range(repeats):
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
        peak = max(peak, mx.get_peak_memory())
    return peak, best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--original", type=int, default=512, help="the model's original window (1x)")
    parser.add_argument("--multiples", default="1,2,4,8")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention, as in Llama-3/Mistral")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    model = build(args)
    mib = 2**20
    weights = eval_memory(model_config(args), 1, 1).breakdown["weights"]
    rows = []
    rng = np.random.default_rng(0)
    for multiple in [int(m) for m in args.multiples.split(",")]:
        length = multiple * args.original
        tokens = rng.integers(0, args.vocab, size=length).astype(np.int32)
        c_peak, c_time, c_nll = measure(lambda: longctx.chunked_nll(model, tokens, args.chunk), args.repeats)
        f_peak, f_time, f_nll = measure(lambda: full_nll(model, tokens), args.repeats)
        est = eval_memory(model_config(args), length, args.chunk)
        row = {
            "multiple": multiple, "length": length,
            "chunked_peak_mib": round(c_peak / mib, 1), "chunked_tokens_per_s": round(length / c_time, 1),
            "full_peak_mib": round(f_peak / mib, 1), "full_tokens_per_s": round(length / f_time, 1),
            "estimate_mib": round(est.peak / mib, 1),
            "max_abs_nll_diff": float(np.abs(c_nll - f_nll).max()),
        }
        rows.append(row)
        print(row, flush=True)
    ratio = rows[-1]["chunked_peak_mib"] / rows[0]["chunked_peak_mib"]
    full_ratio = rows[-1]["full_peak_mib"] / rows[0]["full_peak_mib"]
    print(f"chunked peak {rows[-1]['multiple']}x / 1x = {ratio:.2f} (target <= 1.5); full forward {full_ratio:.2f}")
    path = write_results("eval_memory", {
        "description": __doc__.split("\n")[0],
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
                  "weights_mib": round(weights / mib, 1), "dtype": "float32"},
        "original_window": args.original, "chunk": args.chunk, "repeats": args.repeats,
        "blas": blas_status.get("library"),
        "rows": rows, "chunked_peak_ratio_max_vs_1x": round(ratio, 3), "full_peak_ratio_max_vs_1x": round(full_ratio, 3),
        "target_met": ratio <= 1.5,
    }, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
