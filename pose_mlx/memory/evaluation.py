"""The peak memory of evaluating one long sequence by chunked prefill (`eval_memory`: what `pose_mlx.perplexity`,
`pose_mlx.passkey` and `pose_mlx.ruler` run)."""

from __future__ import annotations

from ..errors import UserError
from .architecture import Architecture, architecture
from .device import compute_backend, cudnn_capable
from .training import Estimate

KV_CACHE_STEP = 256  # mlx-lm's KVCache grows its buffers by this many positions
TILE_BYTES = 32 << 20  # pose_mlx.eval.cpu_attention's score tile per worker


#: On a GPU, MLX's unfused attention held about this many score-sized arrays at the peak of a chunk (one on the CPU):
#: measured once on an H200 (a 3-block float32 toy, 1024 tokens in chunks of 256: 23.1 MB for 11.6 predicted with
#: one): 3.75, rounded up.
GPU_EVAL_SCORES = 4


def eval_memory(config: dict | Architecture, length: int, chunk: int = 512, *, all_logits: bool = True,
                cpu_attention: bool | None = None, backend: str | None = None) -> Estimate:
    """Peak bytes of scoring one `length`-token sequence by chunked prefill (`pose_mlx.eval.longctx.prefill`, what
    `pose_mlx.perplexity`, `pose_mlx.passkey` and `pose_mlx.ruler` run), chunk C = min(chunk, length), hidden h,
    intermediate I, kv_dims = kv_heads x head_dim, c bytes per activation:

        weights + KV cache (2 x layers x kv_dims x L x c, L rounded up to mlx-lm's 256-position steps; the
        prefill allocates it once) + one chunk's logits in fp32 twice (the logits and the log-sum-exp's
        temporary; only the last position's when not `all_logits`: passkey, RULER) + one chunk's activations.

    Activations, what lives at the peak of a layer (measured with `mx.get_peak_memory()` on random small llamas, 2-4
    layers, hidden 32-512, GQA 1-8x, vocabulary 64-8192, chunk 128-512, float32 and bfloat16, each on both attention
    paths; `benchmarks/bench_eval_prediction.py`: every total within 10%): the MLP's gate and up projections (2 x C
    x I x c) and the residual stream with the attention's inputs and output. On the CPU backend's attention path
    (`pose_mlx.eval.cpu_attention`, the default when MLX's default device is the CPU) that is 9 C x h arrays in float32
    and the chunk's keys (C x kv_dims x c); a 16-bit model is attended in float32 there: its attention output is one
    more C x h float32 array, and one layer's keys and values (2 x kv_dims x L) and the chunk's queries are cast
    first, with 4 C x h float32 arrays alive, which is the peak when larger. On MLX's own attention it is 9 C x h
    arrays in float32, 3 in the model's dtype and 5 x C x kv_dims x c, plus the chunk's scores (heads x C x L x c;
    twice with soft-capping) and its boolean mask (C x L bytes). On a GPU (`backend`, default `compute_backend()`)
    the unfused attention holds `GPU_EVAL_SCORES` score matrices; CUDA's fused attention (a 16-bit model, head
    dims a multiple of 8 up to 128) none.

    On the CPU path the scores live in NumPy tiles (at most `TILE_BYTES` per worker) beside NumPy copies of the
    chunk's queries and output, outside MLX's allocator: `peak` (what `mx.get_peak_memory()` measures) leaves
    them out and `details["numpy_bytes"]` holds them; the memory a machine needs is the sum.
    """
    arch = config if isinstance(config, Architecture) else architecture(config)
    if length < 1 or chunk < 1:
        raise UserError(f"length {length} and chunk {chunk} must be positive")
    if cpu_attention is None:
        import mlx.core as mx

        cpu_attention = mx.default_device() == mx.cpu
    backend = backend or compute_backend()
    c = arch.dtype_bytes
    C = min(chunk, length)
    capacity = -(-length // KV_CACHE_STEP) * KV_CACHE_STEP
    scores = arch.heads * C * length * c * (2 if arch.spec.softcap else 1)
    rows = C if all_logits else 1
    logits = 2 * rows * arch.vocab * 4
    stream = arch.hidden * C  # one C x h array, counted in float32 and in the model's dtype below
    if cpu_attention:
        activations = 9 * stream * 4 + (2 * arch.intermediate + arch.kv_dims) * C * c
        if c < 4:  # the attention's float32 output before its cast; the other peak: float32 casts of one
            # layer's keys and values and of the chunk's queries
            activations += stream * 4
            casts = (2 * arch.kv_dims * capacity + arch.q_dims * C) * 4 + 4 * stream * 4
            activations = max(activations, casts - logits)
    else:
        activations = (9 * 4 + 3 * c) * stream + (2 * arch.intermediate + 5 * arch.kv_dims) * C * c
    fused = (backend == "cuda" and arch.dtype in ("float16", "bfloat16") and not arch.spec.softcap
             and arch.head_dim % 8 == 0 and arch.head_dim <= 128 and cudnn_capable())
    if backend != "cpu":
        scores = 0 if fused else int(GPU_EVAL_SCORES * scores)
    breakdown = {
        "weights": arch.weight_bytes(),
        "kv_cache": 2 * arch.layers * arch.kv_dims * capacity * c,
        "attention_scores": 0 if cpu_attention or (backend != "cpu" and fused) else scores + C * length,
        "logits": logits,
        "activations": activations,
    }
    # two workers' score tiles, the scaled queries and the output
    numpy_bytes = min(scores, 2 * TILE_BYTES) + 2 * arch.q_dims * C * 4 if cpu_attention else 0
    details = {"parameters": arch.parameter_counts()["total"], "length": length, "chunk": C,
               "kv_cache_per_token": 2 * arch.layers * arch.kv_dims * c, "family": arch.family,
               "known_family": arch.known, "warnings": list(arch.warnings), "numpy_bytes": numpy_bytes,
               "cpu_attention": cpu_attention, "backend": backend}
    return Estimate(sum(breakdown.values()), "eval", breakdown, details)
