"""The evaluation memory model (`pose_mlx.memory.eval_memory`) against measured peaks on random small llamas.

Each configuration draws a llama (2-4 layers, 2-8 heads of 16-64 dimensions, grouped-query attention 1-8x,
intermediate 1-6x hidden, vocabulary 64-8192), a chunk (128-512), a length (2-8 chunks), all-position or
last-position logits (perplexity vs passkey/RULER) and a dtype (float32, or bfloat16 with --bf16-share), and
runs one chunked prefill (`pose_mlx.eval.longctx.chunked_nll` or `prefill`) on both attention paths of the CPU
backend: `pose_mlx.eval.cpu_attention` (NumPy attention, the CPU default) and MLX's own attention (what Metal and
CUDA run). Measured = `mx.get_peak_memory()` after `mx.reset_peak_memory()`, weights included; predicted =
`eval_memory(config, length, chunk, ...)`. Target: every prediction within 10%.
Writes benchmarks/results/eval_prediction.json.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

import pose_mlx  # noqa: F401
import mlx.core as mx
from mlx_lm.models import llama

from benchmarks.common import write_results
from pose_mlx.eval import cpu_attention, longctx
from pose_mlx.memory import eval_memory


def draw(rng: random.Random, bf16_share: float) -> dict:
    """One random configuration: the llama's config.json fields plus length, chunk, logits and dtype."""
    heads, head_dim = rng.choice([2, 4, 8]), rng.choice([16, 32, 64])
    hidden = heads * head_dim
    chunk = rng.choice([128, 256, 512])
    return dict(
        config=dict(model_type="llama", hidden_size=hidden, num_attention_heads=heads,
                    num_key_value_heads=rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]),
                    intermediate_size=rng.choice([1, 2, 3, 4, 6]) * hidden + rng.choice([0, 32]),
                    vocab_size=rng.choice([64, 512, 2048, 8192]), num_hidden_layers=rng.choice([2, 3, 4]),
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                    torch_dtype="bfloat16" if rng.random() < bf16_share else "float32"),
        chunk=chunk, length=chunk * rng.choice([2, 4, 8]), all_logits=rng.random() < 0.7)


def measured_peak(model, case: dict, numpy_attention: bool) -> int:
    """mx.get_peak_memory() of one chunked prefill of `case['length']` random tokens."""
    tokens = np.random.default_rng(0).integers(3, case["config"]["vocab_size"], case["length"]).astype(np.int32)
    routed = cpu_attention.cpu_backend
    if not numpy_attention:
        cpu_attention.cpu_backend = lambda: False
    try:
        mx.clear_cache()
        mx.reset_peak_memory()
        with cpu_attention.fast_attention(model):
            if case["all_logits"]:
                longctx.chunked_nll(model, tokens, case["chunk"])
            else:
                longctx.prefill(model, tokens, longctx.make_prompt_cache(model), case["chunk"])
        return mx.get_peak_memory()
    finally:
        cpu_attention.cpu_backend = routed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", type=int, default=100, help="random configurations (default 100)")
    parser.add_argument("--bf16-share", type=float, default=0.3, help="share of bfloat16 models (default 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.configs):
        case = draw(rng, args.bf16_share)
        config = dict(case["config"], max_position_embeddings=case["length"])
        model = llama.Model(llama.ModelArgs.from_dict(config))
        if config["torch_dtype"] == "bfloat16":
            model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        for numpy_attention in (True, False):
            measured = measured_peak(model, case, numpy_attention)
            predicted = eval_memory(config, case["length"], case["chunk"], all_logits=case["all_logits"],
                                    cpu_attention=numpy_attention).peak
            rows.append(dict(case, path="numpy" if numpy_attention else "mlx", measured=measured,
                             predicted=predicted, error=predicted / measured - 1))
        print(f"{i + 1}/{args.configs}: errors {rows[-2]['error']:+.3f} (numpy) {rows[-1]['error']:+.3f} (mlx)",
              flush=True)
        del model
    errors = np.array([r["error"] for r in rows])
    summary = {}
    for path in ("numpy", "mlx"):
        for dtype in ("float32", "bfloat16"):
            e = np.array([r["error"] for r in rows if r["path"] == path and r["config"]["torch_dtype"] == dtype])
            if e.size:
                summary[f"{path}/{dtype}"] = dict(n=int(e.size), min_error=float(e.min()), max_error=float(e.max()))
    result = dict(rows=rows, summary=summary, max_abs_error=float(np.abs(errors).max()),
                  within_10_percent=int((np.abs(errors) <= 0.10).sum()), measurements=len(rows),
                  target="every prediction within 10%", met=bool(np.abs(errors).max() <= 0.10))
    path = write_results("eval_prediction", result, args.output)
    for key, s in summary.items():
        print(f"{key}: {s['n']} measurements, error {s['min_error']:+.1%} .. {s['max_error']:+.1%}")
    print(f"{result['within_10_percent']}/{len(rows)} within 10%; wrote {path}")


if __name__ == "__main__":
    main()
