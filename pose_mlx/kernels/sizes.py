"""The sizes of the kernels' blocks and chunks (no MLX here: the memory planner reads them too).

- attention: queries are taken `block_rows` at a time, at most MAX_BLOCK, fewer when one block's float32 scores
  (batch x heads x rows x keys x 4 bytes) would pass BLOCK_BYTES, never fewer than MIN_BLOCK (every block adds a
  pass over the keys' gradients, so that fewer rows cost more time than they save memory:
  benchmarks/bench_cpu_kernels.py times one layer at several block heights);
- loss: `chunk_rows` rows of float32 logits at a time, CHUNK_BYTES of them.
"""

BLOCK_BYTES = 32 << 20
MAX_BLOCK = 256
MIN_BLOCK = 128
CHUNK_BYTES = 16 << 20


def block_rows(batch: int, heads: int, queries: int, keys: int) -> int:
    """Queries per attention block."""
    fit = BLOCK_BYTES // max(4 * batch * heads * keys, 1)
    return int(min(queries, MAX_BLOCK, max(MIN_BLOCK, fit)))


def chunk_rows(vocab: int) -> int:
    """Rows of logits per loss chunk."""
    return max(1, CHUNK_BYTES // (4 * vocab))


__all__ = ["BLOCK_BYTES", "CHUNK_BYTES", "MAX_BLOCK", "MIN_BLOCK", "block_rows", "chunk_rows"]
