"""The output head of the plain-head families: logits = head(model.model(inputs)).

mlx-lm's llama-like families compute `Model.__call__(inputs, cache)` as `head(self.model(inputs, cache))`, with
`head` the `lm_head` Linear or, with tied embeddings, `model.model.embed_tokens.as_linear`. Evaluation uses it to
compute the logits of the last position only, training to compute the loss over the vocabulary in chunks.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

#: mlx-lm modules whose `Model.__call__` is exactly `head(self.model(inputs, cache))` with `head` chosen by
#: `args.tie_word_embeddings` (mistral is built by the llama module).
PLAIN_HEAD_MODULES = frozenset({
    "mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3", "mlx_lm.models.phi3",
    "mlx_lm.models.starcoder2",
})


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The map from final hidden states to logits of a plain-head family, or None for other families."""
    inner, args = getattr(model, "model", None), getattr(model, "args", None)
    if type(model).__module__ not in PLAIN_HEAD_MODULES or inner is None or args is None:
        return None
    if getattr(args, "tie_word_embeddings", False):
        return inner.embed_tokens.as_linear
    return getattr(model, "lm_head", None)


def head_layer(model: nn.Module) -> nn.Module | None:
    """The layer whose `weight` W gives logits = model.model(x) @ W^T exactly (the lm_head Linear or the tied
    Embedding: unquantized and without bias), or None."""
    head = output_head(model)
    owner = getattr(head, "__self__", head)  # the tied embedding of a bound `as_linear`, or the lm_head Linear
    if type(owner) not in (nn.Linear, nn.Embedding) or "bias" in owner:
        return None
    return owner


__all__ = ["PLAIN_HEAD_MODULES", "head_layer", "output_head"]
