"""An evaluation forward pass: fast CPU attention, and the output head only where logits are needed.

`eval_logits(model, inputs, cache, last_only)` runs `model` under `pose_mlx.eval.cpu_attention.fast_attention`
(a no-op off the CPU). With `last_only` it returns the logits of the last position only, (B, 1, vocab):
generation and passkey prompts need nothing else, and at SmolLM2-135M's size the head (hidden x vocab) costs
as much as 8 transformer layers per token. That needs the model's hidden states before the head, which
mlx-lm's llama-like families expose as `model.model(inputs, cache)`, followed by `lm_head` or, with tied
embeddings, `model.model.embed_tokens.as_linear` (`output_head`); for any other family the full forward
runs and its last row is returned.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..model.head import PLAIN_HEAD_MODULES, output_head
from .cpu_attention import fast_attention


def eval_logits(model: nn.Module, inputs: mx.array, cache=None, last_only: bool = False) -> mx.array:
    """`model(inputs, cache=cache)` (B, L, vocab) with fast CPU attention; (B, 1, vocab) with `last_only`."""
    with fast_attention(model):
        head = output_head(model) if last_only else None
        if head is None:
            logits = model(inputs, cache=cache)
            return logits[:, -1:] if last_only else logits
        return head(model.model(inputs, cache)[:, -1:])


__all__ = ["PLAIN_HEAD_MODULES", "eval_logits", "output_head"]
