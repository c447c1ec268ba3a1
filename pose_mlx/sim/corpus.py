"""The simulator's corpus: documents split by file into train / val / test, and a tokenizer.

- Test documents are the `test_docs` longest documents, each cut to its first `test_tokens` tokens; every one
  must reach `test_tokens` (>= the largest target), else ValueError. The rest is split at random (seeded) by
  document: a `val_fraction` share (at least one) is validation, the remainder training data.
- The tokenizer (`tokenizer` arguments: a `tokenizers.Tokenizer` or a transformers / mlx-lm tokenizer) is
  `pose_mlx.toy.train_tokenizer` on the training split.
- `write_jsonl`: documents as a .jsonl file, the format `pose_mlx.training.data` reads (the synthetic retrieval
  documents of `pose_mlx.sim.retrieval` join the pre-training data this way).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .. import toy
from ..training.data import decode_text


def split_documents(texts: list[str], test_docs: int, val_fraction: float, seed: int) -> dict[str, list[str]]:
    """{'train', 'val', 'test'}: the `test_docs` longest texts (longest first) are test; of the others, a seeded
    random round(val_fraction * n) (at least 1) are validation and the rest training."""
    if len(texts) < test_docs + 2:
        raise ValueError(f"corpus: need at least test_docs + 2 = {test_docs + 2} documents, got {len(texts)}")
    order = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), i))
    test, rest = order[:test_docs], sorted(order[test_docs:])
    perm = np.random.default_rng(seed).permutation(len(rest))
    n_val = max(1, round(val_fraction * len(rest)))
    val = sorted(rest[i] for i in perm[:n_val])
    train = sorted(rest[i] for i in perm[n_val:])
    return {"train": [texts[i] for i in train], "val": [texts[i] for i in val], "test": [texts[i] for i in test]}


def _write(folder: Path, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"{i:05d}.txt").write_text(text, encoding="utf-8")


def hf_tokenizer(folder: Path):
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def cut_to_tokens(tokenizer, text: str, n: int) -> str | None:
    """The prefix of `text` holding its first `n` tokens (None when it has fewer)."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    if len(encoding.ids) < n:
        return None
    return text[: encoding.offsets[n - 1][1]]


#: English prose mixed into the default corpus where it is installed: Debian's python3.11-doc reST sources.
DEFAULT_PROSE = Path("/usr/share/doc/python3.11/html/_sources")


def resolve_prose(prose: str, corpus: str | None) -> Path | None:
    """--prose: 'auto' (DEFAULT_PROSE when it exists and no --corpus is given), 'none', or a folder."""
    if prose == "none" or (prose == "auto" and (corpus is not None or not DEFAULT_PROSE.is_dir())):
        return None
    return DEFAULT_PROSE if prose == "auto" else Path(prose)


def corpus_files(source) -> list[Path]:
    """A file, or every file below a folder (sorted, hidden entries skipped) whatever its name: --corpus takes any
    folder of text, another language's library (.pm, .rb, .c, ...) or a book collection (.txt, no suffix, ...)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"corpus: {source}: no such file or folder")
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def _read(source, max_chars: int | None, skipped: dict[str, int]) -> list[str]:
    """The UTF-8 text files of `source` as documents, up to `max_chars` characters; binary (NUL bytes), non-UTF-8
    and empty files are counted in `skipped` by reason."""
    texts, total = [], 0
    for path in corpus_files(source):
        text, problem = decode_text(path.read_bytes())
        if problem is not None:
            skipped[problem] = skipped.get(problem, 0) + 1
            continue
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    if not texts:
        raise ValueError(f"corpus: {source} holds no UTF-8 text files")
    return texts


def build_corpus(folder: Path, source: str | None, max_chars: int | None, test_docs: int, test_tokens: int,
                 val_fraction: float, vocab: int, seed: int, prose: Path | None = None) -> dict:
    """Write folder/{train,val,test}/*.txt and folder/tokenizer/; returns (and writes) folder/corpus.json.
    `source` None: the standard library's sources; `prose`: a folder of text added to them (`max_chars` applies to
    each of the two)."""
    folder = Path(folder)
    skipped: dict[str, int] = {}
    texts = toy.stdlib_texts(max_chars=max_chars) if source is None else _read(source, max_chars, skipped)
    if prose is not None:
        texts += _read(prose, max_chars, skipped)
    splits = split_documents(texts, test_docs, val_fraction, seed)
    toy.train_tokenizer(splits["train"], folder / "tokenizer", vocab)
    tokenizer = hf_tokenizer(folder / "tokenizer")
    test = [cut_to_tokens(tokenizer, t, test_tokens) for t in splits["test"]]
    if any(t is None for t in test):
        short = min(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in splits["test"])
        raise ValueError(f"corpus: the shortest of the {test_docs} longest documents has {short} tokens, fewer "
                         f"than --test-tokens {test_tokens}; use fewer --test-docs or a shorter target")
    _write(folder / "train", splits["train"])
    _write(folder / "val", splits["val"])
    _write(folder / "test", test)
    info = {"source": source or "stdlib", "prose": None if prose is None else str(prose), "documents": {k: len(v) for k, v in splits.items()},
            "characters": {k: sum(map(len, v)) for k, v in splits.items()}, "skipped_files": skipped,
            "test_tokens": test_tokens,
            "vocab": vocab}
    (folder / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """One .jsonl document per line (field 'text'), the format `pose_mlx.training.data` reads. A file that
    already holds exactly these documents is left untouched: its mtime is part of the tokenized corpus's
    fingerprint, so rewriting it would stop an interrupted pre-training from resuming."""
    content = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.is_file() and path.stat().st_size == len(content.encode()) and path.read_text() == content):
        path.write_text(content)
    return path
