"""Evaluation: the long-context evaluators and what they share.

- `passkey`, `perplexity`, `ruler` (+ `ruler_tasks`, `haystack`): the commands `python -m pose_mlx.passkey`,
  `python -m pose_mlx.perplexity`, `python -m pose_mlx.ruler` (entry modules at the top of the package run
  these modules' `main`); `opening`: the start they share (flags, model, lengths, memory check, output path).
- `longctx`: model loading, chunked prefill through the KV cache, the memory check and the shared flags;
  `forward` (the evaluation forward pass, logits of the last position only where that is all that is needed)
  and `cpu_attention` (exact NumPy attention on MLX's CPU backend) under it.

Importing this package imports nothing (no MLX), like `import pose_mlx`.
"""
