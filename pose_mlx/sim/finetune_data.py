"""Fine-tuning data of the simulator's grid: the training split plus the same share of synthetic retrieval
documents (`pose_mlx.sim.retrieval`) for every method, each sized to the method's examples, so that fine-tuning
keeps the base's retrieval skill and favours no method.

A method whose examples need E document tokens (`required_length`: Lc for PoSE and RandPos, Lt for full-length
and for PoSE with aligned content) draws each example from a document chosen uniformly among those with >= E
tokens (`ExampleStream`). So K = f / (1 - f) x (training documents with >= E tokens) retrieval documents of
E tokens make a share f of its examples retrieval tasks. A document of exactly E tokens leaves PoSE no slack:
its content offsets v_i are all 0, so needle, question and answer stay in the example, at positions that the
skip moves apart.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..training.data import tokenize_corpus
from .corpus import write_jsonl
from .retrieval import retrieval_documents

RETRIEVAL_FILE = "retrieval.jsonl"


def framed_length(tokenizer, text: str) -> int:
    """Tokens of `text` as the training data reads it: the ids plus BOS and EOS (when the tokenizer has them)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) + (tokenizer.bos_token_id is not None) + (tokenizer.eos_token_id is not None)


def cut_to_length(tokenizer, text: str, length: int) -> str:
    """The prefix of `text` whose `framed_length` is `length` (the closest above it when no prefix decodes to
    exactly that many tokens). `text` must be longer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    special = framed_length(tokenizer, "")
    best = None
    for n in range(length - special, min(len(ids), length - special + 4) + 1):
        piece = tokenizer.decode(ids[:n])
        got = framed_length(tokenizer, piece)
        if got == length:
            return piece
        if got > length and (best is None or got < best[0]):
            best = (got, piece)
    if best is None:
        raise ValueError(f"no prefix of the text has >= {length} tokens")
    return best[1]


def build(folder: Path, train_dir: Path, tokenizer, cache: Path, length: int, fraction: float, seed: int) -> Path:
    """`folder`: links to the training files and `retrieval.jsonl` with K retrieval documents of exactly `length`
    framed tokens (see the module docstring); returns `folder`. With fraction 0, the links only."""
    folder, train_dir = Path(folder), Path(train_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(train_dir.iterdir()):
        link = folder / path.name
        if path.is_file() and not link.exists():
            os.symlink(path, link)
    if fraction <= 0:
        return folder
    text = tokenize_corpus(train_dir, tokenizer, cache, length, progress=False)
    count = round(fraction / (1 - fraction) * text.num_docs)
    docs = [cut_to_length(tokenizer, doc, length) for doc in retrieval_documents(tokenizer, count, length, seed)]
    write_jsonl(folder / RETRIEVAL_FILE, docs)
    return folder


__all__ = ["RETRIEVAL_FILE", "build", "cut_to_length", "framed_length"]
