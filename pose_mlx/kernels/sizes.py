"""The sizes of the kernels' blocks and chunks (no MLX here: the memory planner reads them too).

- attention: queries are taken `block_rows` at a time, at most MAX_BLOCK, fewer when one block's float32 scores
  (batch x heads x rows x keys x 4 bytes) would pass BLOCK_BYTES, never fewer than MIN_BLOCK (every block adds a
  pass over the keys' gradients, so that fewer rows cost more time than they save memory:
  benchmarks/bench_cpu_kernels.py times one layer at several block heights);
- fused CPU attention (`cpu_attention.cpp`): tiles of TILE queries (64: the fastest height at 1k tokens with
  SmolLM2's 3 query heads per KV head, near the fastest at 8k and with 1 query head per KV head: the tile heights
  of benchmarks/bench_cpu_kernels.py, in docs/cpu-training.md); `tile_scratch_bytes` is what its threads hold;
- loss: `chunk_rows` rows of float32 logits at a time, CHUNK_BYTES of them.
"""

import os

BLOCK_BYTES = 32 << 20
MAX_BLOCK = 256
MIN_BLOCK = 128
CHUNK_BYTES = 16 << 20
TILE = 64


def block_rows(batch: int, heads: int, queries: int, keys: int) -> int:
    """Queries per attention block."""
    fit = BLOCK_BYTES // max(4 * batch * heads * keys, 1)
    return int(min(queries, MAX_BLOCK, max(MIN_BLOCK, fit)))


def kernel_threads() -> int:
    """Threads the C++ kernels use: $POSE_MLX_KERNEL_THREADS, else the CPUs this process may run on."""
    named = os.environ.get("POSE_MLX_KERNEL_THREADS", "")
    if named.isdigit() and int(named) > 0:
        return int(named)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tile_scratch_bytes(heads: int, kv_heads: int, queries: int, keys: int, head_dim: int) -> int:
    """Bytes the fused attention's backward holds besides its inputs and outputs, on `kernel_threads()` threads
    (no more than its tiles): per thread one tile's scores and their gradient (rep * TILE x keys floats each) and
    its queries, output gradient and dQ rows; per thread but the first, its own dK and dV sums of one KV head."""
    threads = min(kernel_threads(), -(-queries // TILE))
    rows = heads // kv_heads * TILE
    return 4 * (threads * rows * (2 * keys + 3 * head_dim + 2) + (threads - 1) * 2 * keys * head_dim)


def chunk_rows(vocab: int) -> int:
    """Rows of logits per loss chunk."""
    return max(1, CHUNK_BYTES // (4 * vocab))


__all__ = ["BLOCK_BYTES", "CHUNK_BYTES", "MAX_BLOCK", "MIN_BLOCK", "TILE", "block_rows", "chunk_rows",
           "kernel_threads", "tile_scratch_bytes"]
