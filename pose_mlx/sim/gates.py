"""Gates of the simulator's base model: numbers that say whether it behaves like a small real LLM.

- `unigram_ppl`: perplexity of a context-free model of the training text, p(t) = (c_t + 1) / (N + V)
  (add-one smoothing over the vocabulary V): the level a model that ignores all context reaches. A real LLM
  beyond its window breaks *above* it (the PoSE paper's > 10^3 is above a 32k-vocabulary unigram model).
- `no_context_ppl`: the model's own perplexity when every token sees only BOS, exp(-mean log p(t | BOS)):
  how much of the model's quality comes from context at all.
- `sink_share`: the mean attention weight on the first token (over layers, heads and every query after the
  first). Real LLMs park attention there ("attention sinks"); a model without sinks spreads attention over far
  keys when its context grows (dilution) instead of breaking down.
- `far_attention`: where the last Lc / 2 queries of an 8 Lc window put their attention: the share on keys at
  distances >= Lc, which the base never saw (`uniform_share`: what uniform attention would put there), and the
  largest logit at those distances minus the largest at seen ones. Dilution: a share near uniform with modest
  logits; a breakdown: the largest logits at unseen distances capture the queries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import mlx.core as mx
from mlx_lm import load

from ..training.data import tokenize_corpus
from .grid import evaluate_passkey, passkey_template_tokens

#: Trials of the base model's passkey gate at Lc (the gate: accuracy >= 0.95 over 50 trials).
GATE_TRIALS, GATE_PASSKEY = 50, 0.95


def unigram_ppl(train: np.ndarray, test: np.ndarray, vocab: int) -> float:
    """exp(-mean over test tokens of log (c_t + 1) / (N + V)), c_t the count of t in `train`, N = len(train)."""
    train, test = np.asarray(train), np.asarray(test)
    if test.size == 0:
        raise ValueError("no test tokens")
    if train.size and (train.min() < 0 or train.max() >= vocab) or test.min() < 0 or test.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    counts = np.bincount(train, minlength=vocab).astype(np.float64)
    logp = np.log(counts + 1) - math.log(train.size + vocab)
    return float(np.exp(-logp[test].mean()))


def no_context_ppl(model, test: np.ndarray, bos: int) -> float:
    """exp(-mean over test tokens of log p(t | BOS)): one forward pass of [BOS] scores every token."""
    test = np.asarray(test)
    if test.size == 0:
        raise ValueError("no test tokens")
    logits = model(mx.array([[bos]]))[0, -1].astype(mx.float32)
    logp = np.array(logits - mx.logsumexp(logits))
    return float(np.exp(-logp[test].mean()))


def attention_logits(attn, x, mask):
    """q k^T * scale + mask of an mlx-lm llama-style attention module on its input `x` (B, L, D), RoPE at
    positions 0..L-1: (B, heads, L, L), keys repeated for grouped queries."""
    b, n, _ = x.shape
    q = attn.q_proj(x).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q), attn.rope(k)
    k = mx.repeat(k, attn.n_heads // attn.n_kv_heads, axis=1)
    return (q * attn.scale) @ k.transpose(0, 1, 3, 2) + mask


def causal_mask(n: int):
    return mx.triu(mx.full((n, n), -mx.inf, dtype=mx.float32), k=1)


def layer_logits(model, tokens: np.ndarray):
    """`attention_logits` of every layer of an mlx-lm llama-style model (`model.model.layers[i].self_attn` with
    q_proj, k_proj, rope, n_heads, n_kv_heads, scale) on one causal sequence, yielded layer by layer."""
    mask = causal_mask(tokens.size)
    h = model.model.embed_tokens(mx.array(tokens[None]))
    for layer in model.model.layers:
        yield attention_logits(layer.self_attn, layer.input_layernorm(h), mask)
        h = layer(h, mask.astype(h.dtype))


def sink_share(model, tokens: np.ndarray) -> float:
    """Mean attention weight on position 0 over layers, heads and queries 1..L-1 of one sequence."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError("sink_share needs one sequence of at least 2 tokens")
    shares = [mx.softmax(logits, axis=-1)[:, :, 1:, 0].mean() for logits in layer_logits(model, tokens)]
    return float(mx.stack(shares).mean())


def far_attention(model, tokens: np.ndarray, window: int) -> dict:
    """Over layers, heads and the last `window` // 2 queries of one sequence `tokens` (longer than `window`):
    `far_share`, the mean attention weight on keys at distances >= `window`; `uniform_share`, the same for
    uniform causal attention, mean of (q - window + 1) / (q + 1) over the queries q; `far_logit_excess`, the mean
    of (largest logit at distances >= window) - (largest logit at distances < window)."""
    tokens = np.asarray(tokens)
    n = tokens.size
    if tokens.ndim != 1 or n <= window:
        raise ValueError(f"far_attention needs one sequence longer than the window ({window}), got {tokens.shape}")
    queries = np.arange(n - window // 2, n)
    far = mx.array((queries[:, None] - np.arange(n)[None, :]) >= window)
    shares, excess = [], []
    for logits in layer_logits(model, tokens):
        logits = logits[:, :, queries[0]:]
        shares.append(mx.where(far, mx.softmax(logits, axis=-1), 0.0).sum(axis=-1).mean())
        excess.append((mx.where(far, logits, -mx.inf).max(axis=-1) - mx.where(far, -mx.inf, logits).max(axis=-1))
                      .mean())
    return {"far_share": float(mx.stack(shares).mean()),
            "uniform_share": float(np.mean((queries + 1 - window) / (queries + 1))),
            "far_logit_excess": float(mx.stack(excess).mean())}


def test_documents(test_dir: Path, tokenizer, cache: Path, window: int) -> list[np.ndarray]:
    """The test documents' token ids (the corpus stage's cut), BOS left out."""
    test = tokenize_corpus(test_dir, tokenizer, cache, window, progress=False)
    bos = tokenizer.bos_token_id
    return [d[d != bos] for d in (np.asarray(test.doc(i)) for i in range(test.num_docs))]


def far_attention_over(model, docs: list[np.ndarray], bos: int, window: int, target: int) -> dict:
    """`far_attention` of BOS + the first `target` - 1 tokens of each of `docs`, each number averaged over them."""
    rows = [far_attention(model, np.append(bos, d[: target - 1]), window) for d in docs]
    return {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}


def measure(model_dir: Path, train_dir: Path, test_dir: Path, cache: Path, window: int, target: int, seed: int,
            passkey_json: Path) -> dict:
    """The gates of the pre-trained model: unigram and no-context perplexity of the test documents' text (BOS
    left out), the sink share over each test document's first Lc tokens, `far_attention` over each one's first
    `target` tokens (means over the documents), and passkey accuracy at Lc over GATE_TRIALS trials (None when
    the prompt template does not fit Lc)."""
    model, tokenizer = load(str(model_dir))
    bos = tokenizer.bos_token_id
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    train = tokenize_corpus(train_dir, tokenizer, cache, window, progress=False)
    docs = test_documents(test_dir, tokenizer, cache, window)
    text = np.concatenate(docs)
    record = {"unigram_ppl": unigram_ppl(np.asarray(train.tokens), text, vocab),
              "no_context_ppl": no_context_ppl(model, text, bos),
              "sink_share": float(np.mean([sink_share(model, np.append(bos, d[: window - 1])) for d in docs])),
              "far_attention": far_attention_over(model, docs, bos, window, target),
              "passkey_at_lc": None, "passkey_trials": GATE_TRIALS, "passkey_threshold": GATE_PASSKEY}
    if passkey_template_tokens(tokenizer) <= window:
        evaluate_passkey(Path(model_dir), [window], GATE_TRIALS, seed, passkey_json)
        record["passkey_at_lc"] = json.loads(Path(passkey_json).read_text())["accuracy"][0]["accuracy"]
    return record


__all__ = ["measure", "test_documents", "attention_logits", "causal_mask", "far_attention",
           "far_attention_over", "layer_logits", "no_context_ppl", "sink_share", "unigram_ppl"]
