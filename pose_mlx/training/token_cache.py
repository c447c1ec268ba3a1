"""Tokenizing a corpus once into an on-disk cache (tokens.npy + offsets.npy + meta.json), written in chunks so that
a corpus larger than memory works, and the memory-mapped `TokenizedCorpus` read back from it (NumPy only; never
imports MLX). Documents shorter than ``min_length`` tokens are left out of the cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from .reading import DataError, ReadStats, chat_renderer, read_files, resolve_files
from ..words import counted

# Imported inside a function, on purpose: tqdm.auto (~0.1 s) is needed only to show tokenizing progress.

CACHE_VERSION = 1
_HEADER_BYTES = 128  # a 1-D '<i4' .npy v1.0 header is 128 bytes for any length < 10**19


# ---------------------------------------------------------------------------------------------- tokenizing


def _encode(tokenizer, text: str, bos: bool, eos: bool) -> list[int]:
    """Token ids of ``text``: the tokenizer's own ids without special tokens, then BOS/EOS added once (when the
    tokenizer has them) so that every tokenizer gets the same framing."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers whose encode takes only the text
        ids = list(tokenizer.encode(text))
    bos_id, eos_id = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if bos and bos_id is not None and (not ids or ids[0] != bos_id):
        ids.insert(0, bos_id)
    if eos and eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)
    return ids


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what determines the token ids: the tokenizer.json content (HF fast tokenizers, also inside
    mlx-lm's TokenizerWrapper), else the vocabulary, plus the BOS/EOS ids."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    elif hasattr(inner, "get_vocab"):
        content = json.dumps(sorted(inner.get_vocab().items()))
    else:
        raise ValueError(f"tokenizer: cannot fingerprint a {type(tokenizer).__name__} (it has neither a "
                         "backend_tokenizer nor get_vocab())")
    specials = [getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    return hashlib.sha256((content + json.dumps(specials)).encode()).hexdigest()


def _source_entries(files: list[Path]) -> list[list]:
    """(absolute path, size, mtime_ns) of each file: changes whenever a file is edited, added or removed."""
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return entries


def _fingerprint(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _npy_header(length: int) -> bytes:
    """The .npy v1.0 header of a 1-D little-endian int32 array of ``length`` items (always 128 bytes)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i4", "fortran_order": False, "shape": (length,)})
    header = buffer.getvalue()
    assert len(header) == _HEADER_BYTES, len(header)
    return header


class TokenWriter:
    """Append int32 token ids to a .npy file in chunks of about ``chunk_size`` tokens: at most
    chunk_size + (one document) tokens are held in memory; the header gets the final length on close."""

    def __init__(self, path: Path, chunk_size: int = 1 << 20):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.path, self.chunk_size = Path(path), chunk_size
        self.file = open(self.path, "wb")
        self.file.write(_npy_header(0))
        self.buffer: list[np.ndarray] = []
        self.buffered = self.length = 0

    def append(self, ids) -> None:
        array = np.asarray(ids, dtype="<i4")
        self.buffer.append(array)
        self.buffered += len(array)
        if self.buffered >= self.chunk_size:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.file.write(np.concatenate(self.buffer).tobytes())
            self.length += self.buffered
            self.buffer, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        self.file.seek(0)
        self.file.write(_npy_header(self.length))
        self.file.close()


def _progress(enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="tokenizing", unit=" docs", disable=not enabled, leave=False)


def _write_cache(documents: Iterable[str], tokenizer, folder: Path, min_length: int, bos: bool, eos: bool,
                 chunk_size: int, progress: bool) -> dict:
    """Tokenize ``documents`` into ``folder`` (tokens.npy, offsets.npy); returns counts for meta.json.
    Keeps documents with >= min_length tokens; DataError when none qualifies."""
    writer = TokenWriter(folder / "tokens.npy", chunk_size)
    offsets, read, longest = [0], 0, 0
    bar = _progress(progress)
    try:
        for text in documents:
            ids = _encode(tokenizer, text, bos, eos)
            read += 1
            longest = max(longest, len(ids))
            if len(ids) >= min_length:
                writer.append(ids)
                offsets.append(offsets[-1] + len(ids))
            bar.update(1)
    finally:
        writer.close()
        bar.close()
    if read and len(offsets) == 1:
        raise DataError(f"no document has >= {min_length} tokens (read {counted(read, 'document')}, longest has "
                        f"{longest} tokens)")
    np.save(folder / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    return {"documents_read": read, "longest": longest}


def tokenize_corpus(source, tokenizer, cache_dir, min_length: int, bos: bool = True, eos: bool = True,
                    progress: bool = True, chunk_size: int = 1 << 20, split: str = "train") -> "TokenizedCorpus":
    """Tokenize every document of ``source``'s ``split`` once and cache the ids under ``cache_dir/<fingerprint>/``.

    The fingerprint hashes the tokenizer (``tokenizer_fingerprint``) and its chat template, the files (paths,
    sizes, mtimes), ``min_length``, ``bos`` and ``eos``; a cache with that fingerprint is reused without encoding
    anything.
    A new cache is written in a temporary folder then renamed into place, so a crash never leaves a partial
    cache. Documents with fewer than ``min_length`` tokens (counting BOS/EOS) are dropped.
    """
    if isinstance(min_length, bool) or not isinstance(min_length, (int, np.integer)) or min_length < 1:
        raise ValueError(f"min_length must be an integer >= 1, got {min_length!r}")
    files = resolve_files(source, split)
    if not files:
        raise DataError(f"--data {source}: no {split}.jsonl")
    render = chat_renderer(tokenizer)
    payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer),
               "chat_template": str(getattr(tokenizer, "chat_template", None) or ""),
               "files": _source_entries(files), "min_length": int(min_length), "bos": bool(bos), "eos": bool(eos)}
    fingerprint = _fingerprint(payload)
    cache_dir = Path(cache_dir).expanduser()
    folder = cache_dir / fingerprint
    if (folder / "meta.json").is_file():
        return TokenizedCorpus.open(folder)

    created = not cache_dir.exists()
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp = cache_dir / f".{fingerprint}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        stats = ReadStats()
        counts = _write_cache(read_files(files, stats, render), tokenizer, temp, int(min_length), bos, eos,
                              chunk_size, progress)
        if stats.documents == 0:
            raise DataError(f"--data {source}: no readable document ({stats.describe()})")
        offsets = np.load(temp / "offsets.npy")
        meta = {"fingerprint": fingerprint, "source": str(source), "num_docs": len(offsets) - 1,
                "total_tokens": int(offsets[-1]), "min_length": int(min_length), "bos": bool(bos), "eos": bool(eos),
                "tokenizer": payload["tokenizer"], "files": len(files), "stats": stats.__dict__, **counts}
        (temp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.replace(temp, folder)
        except OSError:  # another process finished the same cache first
            if not (folder / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if created and not folder.exists() and not any(cache_dir.iterdir()):
            cache_dir.rmdir()  # a failed first use leaves no empty cache folder behind
    return TokenizedCorpus.open(folder)


# ---------------------------------------------------------------------------------------------- the corpus


@dataclass(eq=False)
class TokenizedCorpus:
    """Documents of token ids over a memory-mapped cache. ``doc_ids`` selects (and orders) the cached
    documents this corpus holds: all of them, or one side of ``split``."""

    tokens: np.ndarray  # int32 memmap, all documents back to back
    offsets: np.ndarray  # int64 (cached documents + 1,): document k is tokens[offsets[k]:offsets[k+1]]
    doc_ids: np.ndarray
    fingerprint: str
    meta: dict = field(default_factory=dict)

    @classmethod
    def open(cls, folder) -> "TokenizedCorpus":
        folder = Path(folder)
        meta = json.loads((folder / "meta.json").read_text())
        offsets = np.load(folder / "offsets.npy")
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        return cls(tokens, offsets, np.arange(len(offsets) - 1), meta["fingerprint"], meta)

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def lengths(self) -> np.ndarray:
        return self.offsets[self.doc_ids + 1] - self.offsets[self.doc_ids]

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (a read-only view into the memmap)."""
        k = self.doc_ids[i]
        return self.tokens[self.offsets[k]:self.offsets[k + 1]]

    def split(self, heldout_fraction: float, seed: int = 0) -> tuple["TokenizedCorpus", "TokenizedCorpus"]:
        """(train, heldout): a seeded random ``heldout_fraction`` of the documents (rounded, at least one and
        leaving at least one) is held out. Both keep the corpus fingerprint; ``meta['split']`` says which side."""
        if not 0 < heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        if self.num_docs < 2:
            raise DataError(f"cannot hold out documents for evaluation: the corpus has {self.num_docs} document "
                            "(need >= 2)")
        count = min(max(round(heldout_fraction * self.num_docs), 1), self.num_docs - 1)
        order = np.random.default_rng(seed).permutation(self.num_docs)
        held, kept = np.sort(order[:count]), np.sort(order[count:])
        info = {"heldout_fraction": heldout_fraction, "seed": seed}
        return tuple(TokenizedCorpus(self.tokens, self.offsets, self.doc_ids[ids], self.fingerprint,
                                     {**self.meta, "split": {**info, "side": side}})
                     for ids, side in ((kept, "train"), (held, "heldout")))

