"""Tiny model folders for the evaluator tests: a random llama + a byte-level BPE tokenizer, all offline."""

from __future__ import annotations

import json
from pathlib import Path


import mlx.core as mx
from mlx.utils import tree_flatten

from conftest import build_model

TEXTS = [
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.",
    "The pass key is 12345. Remember it. 12345 is the pass key. What is the pass key? The pass key is",
    "def main(argv=None):\n    return 0\n" * 3,
    "0123456789 " * 5,
]


def train_tokenizer(folder: Path, vocab_size: int = 600) -> int:
    """Byte-level BPE (single digits) with <s>/</s>; writes tokenizer.json + tokenizer_config.json; returns vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "add_bos_token": False}))
    return tok.get_vocab_size()


def make_eval_folder(folder: Path, max_position_embeddings: int = 64, seed: int = 0, tokenizer: bool = True,
                     **overrides) -> Path:
    """A loadable mlx-lm llama folder (config.json, model.safetensors, tokenizer files unless tokenizer=False)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder) if tokenizer else 200
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 48,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab,
              "rope_theta": 500.0, "max_position_embeddings": max_position_embeddings,
              "tie_word_embeddings": True, **overrides}
    model = build_model("llama", seed=seed, **{k: v for k, v in config.items() if k != "model_type"})
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class RetrievalOracle:
    """A stand-in "model" that solves the passkey task from what is in its KV cache, to test the evaluator.

    Its single KV cache stores the token ids it has seen. At each position it predicts digit t of the first
    5-digit run in the cached history, where t is the number of digits ending the history (so after
    "... The pass key is" it emits the key digit by digit, then EOS). A stale cache (a prefix not trimmed
    correctly) would make it answer an earlier trial's key.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.layers = [None]
        self.vocab_size, self.eos = vocab_size, tokenizer.eos_token_id
        self.digit = {}
        for d in range(10):
            [token] = tokenizer.encode(str(d), add_special_tokens=False)
            self.digit[token] = d
        self.digit_token = {d: t for t, d in self.digit.items()}

    def named_modules(self):  # no RoPE layers to look into
        return []

    def _next(self, history: list[int]) -> int:
        run, key = [], None
        for token in history:
            run = run + [token] if token in self.digit else []
            if len(run) == 5 and key is None:
                key = [self.digit[t] for t in run]
        trailing = 0
        while trailing < len(history) and history[-1 - trailing] in self.digit:
            trailing += 1
        if key is None or trailing >= 5:
            return self.eos
        return self.digit_token[key[trailing]]

    def __call__(self, inputs, cache):
        import numpy as np

        x = inputs.astype(mx.float32)[:, None, :, None]
        keys, _ = cache[0].update_and_fetch(x, x)
        history = np.array(keys[0, 0, :, 0]).astype(int).tolist()
        length = inputs.shape[1]
        start = len(history) - length
        logits = np.zeros((1, length, self.vocab_size), dtype=np.float32)
        for j in range(length):
            logits[0, j, self._next(history[: start + j + 1])] = 10.0
        return mx.array(logits)


def count_appends(monkeypatch, interrupt_after: int | None = None) -> list:
    """Records appended to any `pose_mlx.resumable.RecordLog` from now on (the list returned); with
    `interrupt_after`, a KeyboardInterrupt right after that many were written, as a Ctrl-C would land."""
    from pose_mlx.resumable import RecordLog

    appended, original = [], RecordLog.append

    def append(self, record):
        original(self, record)
        appended.append(record)
        if len(appended) == interrupt_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(RecordLog, "append", append)
    return appended


def assert_cost(record: dict, folder: Path, elapsed: float) -> None:
    """An evaluator JSON's `cost` against independent references: no more seconds than the caller measured around
    the command, and both memory peaks at least the model's weights (they live in MLX's memory and in the
    process's), read from the folder's safetensors."""
    weights = sum(v.nbytes for f in Path(folder).glob("*.safetensors") for v in mx.load(str(f)).values())
    cost = record["cost"]
    assert 0 < cost["seconds"] <= elapsed
    assert cost["peak_memory_gb"] * 2**30 >= weights and cost["max_rss_gb"] * 2**30 >= weights
