"""Reading a real GGUF file (SmolLM2-135M-Instruct Q4_1): load times, and why the CPU default dequantizes.

Measures, side by side in one run on the default device:
  1. `read_header` (metadata and tensor infos only, what a memory planner reads);
  2. `load_gguf` with the weights dequantized to float32 and with them kept quantized (MLX affine, group 32);
  3. one forward pass over `--tokens` tokens with each model (median of `--reps`, after a warm-up), and the
     ratio kept / dequantized: the reason `load_gguf` dequantizes when the default device is the CPU.
Writes benchmarks/results/gguf.json. The file comes from `python tools/fetch_smollm2.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import write_results

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_path() -> Path:
    return Path(os.environ.get("POSE_MLX_MODELS") or Path.home() / ".cache" / "pose_mlx" / "models") / NAME


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=default_path(), help=f"the GGUF file (default: {default_path()})")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per forward pass (default 512)")
    parser.add_argument("--reps", type=int, default=3, help="timed forward passes per model (default 3)")
    args = parser.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"bench_gguf: {args.gguf} not found; run `python tools/fetch_smollm2.py`")

    import pose_mlx  # noqa: F401

    import mlx.core as mx

    from pose_mlx.model.gguf import load_gguf, read_header

    load_gguf(args.gguf)  # warm-up: imports (transformers, mlx-lm model code) and the page cache
    header_s = min(timed(lambda: read_header(args.gguf))[1] for _ in range(3))
    (dense, tokenizer, _), dense_load_s = timed(lambda: load_gguf(args.gguf, keep_quantized=False))
    (kept, _, _), kept_load_s = timed(lambda: load_gguf(args.gguf, keep_quantized=True))

    ids = mx.array(tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * args.tokens))
                   [: args.tokens])[None]

    def forward_times(model) -> list[float]:
        mx.eval(model(ids))
        return [timed(lambda: mx.eval(model(ids)))[1] for _ in range(args.reps)]

    dense_fwd, kept_fwd = forward_times(dense), forward_times(kept)
    results = {
        "gguf": args.gguf.name,
        "device": str(mx.default_device()),
        "tokens": int(ids.shape[1]),
        "read_header_s": header_s,
        "load_dequantized_s": dense_load_s,
        "load_kept_quantized_s": kept_load_s,
        "forward_dequantized_s": statistics.median(dense_fwd),
        "forward_kept_quantized_s": statistics.median(kept_fwd),
        "forward_ratio_kept_over_dequantized": statistics.median(kept_fwd) / statistics.median(dense_fwd),
    }
    path = write_results("gguf", results)
    for key, value in results.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
