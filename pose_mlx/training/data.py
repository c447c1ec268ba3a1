"""Training data: read a corpus, tokenize it once into an on-disk cache, and stream PoSE training batches.

Pipeline (NumPy only; never imports MLX):

    source ──read_documents──▶ str documents ──tokenize_corpus──▶ cache (tokens.npy + offsets.npy + meta.json)
           ──TokenizedCorpus (memory-mapped)──▶ ExampleStream ──▶ Batch(inputs, targets, positions, mask)

A source is a text file (the whole file is one document), a ``.jsonl`` file (one document per line in one of
mlx-lm's formats: ``{"text"}``, chat ``{"messages": [{"role", "content"}, ...]}`` or completions
``{"prompt", "completion"}``, the last two rendered with the tokenizer's chat template), a folder (its
.txt/.md/.py/.jsonl files, recursively, in sorted order; folders written by pose_mlx - holding pose_mlx.json or
run.json - are skipped), or a hub dataset repo id. A folder laid out as mlx-lm's data folders (train.jsonl,
valid.jsonl, test.jsonl) is read by split: training reads only train.jsonl, held-out evaluation valid.jsonl, and
test.jsonl is never read. The token cache is written in chunks, so a corpus larger than memory works; documents
shorter than ``min_length`` tokens are left out of it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..errors import UserError
from ..model.source import hub_reachable
from .positions import CONTENT, SAMPLERS, Example, sample_example

# Imported inside functions, on purpose: `plan` imports this module, and neither the hub client (only to fetch a hub
# data set) nor tqdm.auto (~0.1 s, only to show tokenizing progress) is needed there.

SUFFIXES = (".txt", ".md", ".py", ".jsonl")
#: mlx-lm's data folder layout: a folder with train.jsonl is read split by split.
SPLITS = ("train", "valid", "test")
#: Files that mark a folder written by pose_mlx (an exported model, an unfinished run): never read as data.
OWN_MARKS = ("pose_mlx.json", "run.json")
CACHE_VERSION = 1
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HEADER_BYTES = 128  # a 1-D '<i4' .npy v1.0 header is 128 bytes for any length < 10**19


class DataError(UserError, ValueError):
    """A problem with the user's data, reported as one line (no traceback)."""


@dataclass
class ReadStats:
    """What ``read_documents`` read and skipped. Skips count files (and, for .jsonl, lines)."""

    files_read: int = 0
    documents: int = 0
    skipped_empty: int = 0
    skipped_binary: int = 0
    skipped_encoding: int = 0

    def skipped(self) -> int:
        return self.skipped_empty + self.skipped_binary + self.skipped_encoding

    def describe(self) -> str:
        return (f"{self.files_read} files read, skipped {self.skipped_empty} empty, {self.skipped_binary} binary, "
                f"{self.skipped_encoding} not UTF-8")


# ---------------------------------------------------------------------------------------------------- reading


def _download(repo_id: str) -> Path:
    """Local folder of hub dataset ``repo_id`` (only its text files), or DataError when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download


        folder = snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=[f"*{s}" for s in SUFFIXES],
                                   local_files_only=not hub_reachable())  # offline: one line at once, no retries
    except Exception as error:  # offline, unknown repo, HTTP errors: all become one line for the user
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DataError(f"--data {repo_id}: not a local path and the Hugging Face hub cannot be reached or has no "
                        f"such dataset ({type(error).__name__}: {first})") from None
    return Path(folder)


def resolve_files(source, split: str = "train") -> list[Path]:
    """The files ``source`` stands for: [file], a folder's text files (sorted, hidden entries and pose_mlx's own
    output folders skipped), mlx-lm's ``<split>.jsonl`` of a folder laid out as its data folders (``[]`` when that
    split is absent), or the files of a hub dataset (downloaded). DataError when a training source has none."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(source).expanduser()
    if not path.exists():
        if isinstance(source, str) and _HUB_ID.match(source) and path.suffix.lower() not in SUFFIXES:
            path = _download(source)
        else:
            raise DataError(f"--data {source}: no such file or folder")
    if path.is_file():
        return [path] if split == "train" else []
    if (path / "train.jsonl").is_file():  # mlx-lm's layout
        chosen = path / f"{split}.jsonl"
        return [chosen] if chosen.is_file() else []
    if split != "train":
        return []
    own = {p.parent for mark in OWN_MARKS for p in path.rglob(mark)}
    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts)
                   and not any(folder == p.parent or folder in p.parents for folder in own))
    if not files:
        raise DataError(f"--data {source}: no {'/'.join(SUFFIXES)} files in this folder")
    return files


def chat_renderer(tokenizer):
    """record -> text for mlx-lm's chat (``messages``) and completions (``prompt``/``completion``) records, rendered
    with the tokenizer's chat template (completions without a template: prompt + completion); None for records of
    neither kind."""
    template = getattr(tokenizer, "chat_template", None)

    def render(record: dict) -> str | None:
        if "messages" in record:
            messages = record["messages"]
        elif "prompt" in record and "completion" in record:
            if not (isinstance(record["prompt"], str) and isinstance(record["completion"], str)):
                raise ValueError("'prompt' and 'completion' must be strings")
            if not template:
                return record["prompt"] + record["completion"]
            messages = [{"role": "user", "content": record["prompt"]},
                        {"role": "assistant", "content": record["completion"]}]
        else:
            return None
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ValueError("'messages' must be a non-empty list of {'role': str, 'content': str}")
        if not template:
            raise ValueError("chat records need a tokenizer with a chat template; this model's has none")
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return render


def decode_text(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) for usable text, else (None, 'empty' | 'binary' (NUL bytes) | 'encoding' (not UTF-8))."""
    if b"\x00" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "encoding"
    return (None, "empty") if not text.strip() else (text, None)


def _skip(stats: ReadStats, kind: str) -> None:
    setattr(stats, f"skipped_{kind}", getattr(stats, f"skipped_{kind}") + 1)


def _jsonl_documents(path: Path, stats: ReadStats, render=None) -> Iterator[str]:
    """The document of each line: its ``text`` field, or a chat / completions record rendered by ``render``
    (`chat_renderer`); blank lines ignored, lines that are not JSON or of no known format are a DataError naming
    the line; empty texts and non-UTF-8 lines are skipped and counted."""
    with open(path, "rb") as f:
        head = f.read(8192)
        if b"\x00" in head:
            _skip(stats, "binary")
            return
        f.seek(0)
        stats.files_read += 1
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                _skip(stats, "encoding")
                continue
            except json.JSONDecodeError:
                raise DataError(f"{path}:{number}: not valid JSON") from None
            text = _record_text(record, render, path, number)
            if not text.strip():
                _skip(stats, "empty")
                continue
            stats.documents += 1
            yield text


def _record_text(record, render, path: Path, number: int) -> str:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    try:
        text = render(record) if render is not None and isinstance(record, dict) else None
    except Exception as error:  # a malformed chat record, or a template that rejects it
        raise DataError(f"{path}:{number}: {error}") from None
    if text is None:
        kinds = "'text', 'messages' (chat) or 'prompt' + 'completion'" if render else "a string field 'text'"
        raise DataError(f"{path}:{number}: expected a JSON object with {kinds}")
    return text


def read_documents(source, stats: ReadStats | None = None, split: str = "train", render=None) -> Iterator[str]:
    """Yield the documents of ``source``'s ``split`` (see the module docstring) one at a time, in a deterministic
    order; ``render`` (`chat_renderer(tokenizer)`) turns chat / completions records into text.

    Empty, binary (NUL bytes) and non-UTF-8 files are skipped and counted in ``stats`` (pass a ReadStats to
    see the counts). DataError for a missing path, an unreachable hub, or malformed .jsonl lines.
    """
    yield from read_files(resolve_files(source, split), ReadStats() if stats is None else stats, render)


def read_files(files: Iterable[Path], stats: ReadStats, render=None) -> Iterator[str]:
    """``read_documents`` over already resolved files."""
    for path in files:
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, stats, render)
            continue
        text, problem = decode_text(path.read_bytes())
        if problem is not None:
            _skip(stats, problem)
            continue
        stats.files_read += 1
        stats.documents += 1
        yield text


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
        raise DataError(f"no document has >= {min_length} tokens (read {read} documents, longest has "
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


# ---------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """B examples of T = L - 1 next-token predictions (L = window, or target for sampler 'full').

    inputs[b, t] = x[t], targets[b, t] = x[t + 1], positions[b, t] = p[t] (position id of input t), where x, p
    are the example's tokens and position ids; mask[b, t] = 1.0 for a real target, 0.0 for padding.
    docs[b] = document index. short[b] (mixed-window training only, else None) = True when row b is a
    short-context row: positions 0 .. window - 1, read with the model's original RoPE."""

    inputs: np.ndarray  # int32 (B, T)
    targets: np.ndarray  # int32 (B, T)
    positions: np.ndarray  # int32 (B, T)
    mask: np.ndarray  # float32 (B, T)
    docs: np.ndarray  # int64 (B,)
    short: np.ndarray | None = None  # bool (B,)


#: Inputs per row that MLX's CUDA attention needs to differentiate through cuDNN's fused kernel (its backward
#: falls back to the unfused attention for other query lengths; see docs/memory.md).
FUSED_ATTENTION_ROWS = 128


def row_multiple(align_rows: str, backend: str) -> int:
    """What training rows are padded to a multiple of (finetune's --align-rows): `FUSED_ATTENTION_ROWS` for "on",
    and for "auto" on CUDA (the one backend whose training attention is fused); 1 (no padding) otherwise."""
    if align_rows not in ("auto", "on", "off"):
        raise ValueError(f"align_rows must be auto, on or off, got {align_rows!r}")
    aligned = align_rows == "on" or (align_rows == "auto" and backend == "cuda")
    return FUSED_ATTENTION_ROWS if aligned else 1


def collate(examples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], docs, pad_id: int = 0, short=None,
            multiple: int = 1) -> Batch:
    """Batch (tokens x, positions p, mask over targets) triples of possibly different lengths: shorter rows
    are padded at the end with ``pad_id`` (positions repeat the last real one) and mask 0, and every row to a
    width that is a multiple of ``multiple`` (masked padding changes neither the loss nor its gradient: the
    attention is causal, so no real token sees it). ``short``: the rows' short-context marks (see ``Batch``), or
    None."""
    width = max(len(x) for x, _, _ in examples) - 1
    width = -(-width // multiple) * multiple
    size = len(examples)
    inputs = np.full((size, width), pad_id, dtype=np.int32)
    targets = np.full((size, width), pad_id, dtype=np.int32)
    positions = np.zeros((size, width), dtype=np.int32)
    mask = np.zeros((size, width), dtype=np.float32)
    for b, (x, p, m) in enumerate(examples):
        n = len(x) - 1
        inputs[b, :n], targets[b, :n], mask[b, :n] = x[:-1], x[1:], m
        positions[b, :n], positions[b, n:] = p[:-1], p[n - 1] if n else 0
    return Batch(inputs, targets, positions, mask, np.asarray(docs, dtype=np.int64),
                 None if short is None else np.asarray(short, dtype=bool))


def required_length(window: int, target: int, sampler: str, content: str) -> int:
    """Fewest document tokens ``sample_example`` accepts: target for 'full' and for PoSE with 'aligned'
    content, else window."""
    if sampler == "full" or (content == "aligned" and sampler in ("pose", "pose-ref", "pose-middle")):
        return target
    return window


class ExampleStream:
    """An endless, seeded stream of ``Batch``es: each example draws a document uniformly at random among those
    long enough (``required_length``), then positions and content with ``pose_mlx.training.positions.sample_example``.

    All randomness comes from one ``np.random.Generator`` seeded with ``seed`` (and, with ``short_share``, a
    second one for the row marks, below); ``state_dict()`` / ``load_state_dict()`` save and restore them, so a
    resumed stream yields exactly the batches the original would have. Every target counts, including the first token of a later chunk, predicted across the position
    skip, as in the paper and the authors' code.

    Data-parallel shards: with ``world`` W > 1 each batch draws W * ``batch_size`` examples (the draws a
    single stream with batch W * ``batch_size`` makes) and keeps rows ``rank * batch_size`` to
    ``(rank + 1) * batch_size - 1``, so the W ranks together see exactly the single stream's batch.

    Mixed-window training (``short_share`` F > 0, after LongRoPE2's mixed context window training): example k
    of the stream is a short-context row when r_k < F, where r_0, r_1, ... are the uniform draws of a second
    generator ``np.random.default_rng([seed, 1])`` (one per example, in order), so the marks depend only on the
    seed and F. A short row takes positions 0 .. window - 1 over consecutive tokens (``sample_example``'s
    ``plain``) and is marked in ``Batch.short`` so that the model reads it with its original RoPE; the other
    rows come from ``sampler``. Every row has the same length, so memory does not change.
    """

    def __init__(self, corpus: TokenizedCorpus, window: int, target: int, sampler: str = "pose", chunks: int = 2,
                 content: str = "uniform", batch_size: int = 1, seed: int = 0, pad_id: int = 0,
                 rank: int = 0, world: int = 1, short_share: float = 0.0, row_multiple: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if content not in CONTENT:
            raise ValueError(f"content must be one of {CONTENT}, got {content!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not 0 <= short_share < 1:
            raise ValueError(f"short_share must be in [0, 1), got {short_share!r}")
        if short_share and sampler in ("full", "plain", "contiguous"):
            raise ValueError(f"short_share needs a sampler that skips positions, not {sampler!r}")
        self.corpus, self.window, self.target = corpus, window, target
        self.sampler, self.chunks, self.content = sampler, chunks, content
        self.batch_size, self.seed, self.pad_id = int(batch_size), seed, pad_id
        self.rank, self.world, self.row_multiple = rank, world, int(row_multiple)
        need = required_length(window, target, sampler, content)
        self.length = target if sampler == "full" else window  # tokens per example
        if self.length < 2:
            raise ValueError(f"an example needs >= 2 tokens (one input, one target), got {self.length}")
        sample_example(need, window, target, sampler, chunks, content, rng=0)  # validates the arguments
        self.doc_lengths = lengths = corpus.lengths
        self.eligible = np.flatnonzero(lengths >= need)
        if len(self.eligible) == 0:
            longest = int(lengths.max()) if len(lengths) else 0
            raise DataError(f"no document has >= {need} tokens, which sampler={sampler!r} content={content!r} "
                            f"needs (corpus has {corpus.num_docs} documents, longest has {longest} tokens)")
        self.rng = np.random.default_rng(seed)
        self.short_share = float(short_share)
        self.mix_rng = np.random.default_rng([seed, 1])
        self.batches = 0

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens per batch of this rank, batch_size * (L - 1) (before any boundary masking)."""
        return self.batch_size * (self.length - 1)

    def _draw(self) -> tuple[int, Example, bool]:
        """A document index, an example layout for it and whether it is a short-context row (consumes the
        generators; reads no tokens)."""
        short = bool(self.mix_rng.random() < self.short_share) if self.short_share else False
        doc = int(self.eligible[self.rng.integers(len(self.eligible))])
        sampler = "plain" if short else self.sampler
        return doc, sample_example(int(self.doc_lengths[doc]), self.window, self.target, sampler, self.chunks,
                                   self.content, rng=self.rng), short

    def _materialize(self, doc: int, example: Example) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, position ids, target mask) of one drawn example."""
        x = np.asarray(self.corpus.doc(doc)[example.token_index()], dtype=np.int32)
        return x, example.position_ids, np.ones(len(x) - 1, dtype=np.float32)

    def next_batch(self) -> Batch:
        drawn = [self._draw() for _ in range(self.batch_size * self.world)]
        mine = drawn[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.batches += 1
        return collate([self._materialize(d, e) for d, e, _ in mine], [d for d, _, _ in mine], self.pad_id,
                       [s for _, _, s in mine] if self.short_share else None, self.row_multiple)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable position of the stream: generator states and batches drawn so far."""
        return {"rng": self.rng.bit_generator.state, "mix_rng": self.mix_rng.bit_generator.state,
                "batches": self.batches, "seed": self.seed, "fingerprint": self.corpus.fingerprint,
                "num_docs": self.corpus.num_docs}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict``); DataError if it was saved on a different corpus."""
        if (state.get("fingerprint"), state.get("num_docs")) != (self.corpus.fingerprint, self.corpus.num_docs):
            raise DataError("cannot resume: the checkpoint's data stream was built on different data "
                            f"(fingerprint {state.get('fingerprint')}, this run {self.corpus.fingerprint})")
        self.rng.bit_generator.state = state["rng"]
        if "mix_rng" in state:  # absent from streams saved before mixed-window training, which never drew from it
            self.mix_rng.bit_generator.state = state["mix_rng"]
        self.batches = int(state["batches"])


# ---------------------------------------------------------------------------------------------- a run's data


@dataclass
class TrainingData:
    """The data of a fine-tuning run: the training stream (this rank's rows), the held-out batches (or None) and
    the corpus fingerprint recorded in the exported metadata."""

    stream: ExampleStream
    eval_batches: object  # () -> iterable of Batch, or None
    probe: Batch  # one batch of a separate stream (held-out data when there is some), for checks
    fingerprint: str
    skipped: ReadStats


def training_data(settings, tokenizer, window: int, target: int, world, row_multiple: int = 1) -> TrainingData:
    """Tokenize `settings.data` (rank 0 first; the other ranks then read its cache) and build the streams.

    `settings` is a `pose_mlx.settings.RunSettings`. Documents shorter than `settings.min_length` (default: the
    example length) are dropped. Held-out batches (for `eval_every`) come from mlx-lm's valid.jsonl when the data
    has one, else from a seeded `heldout` fraction of the documents. Rows are padded to a multiple of `row_multiple`
    (the run plan's `memory.TrainSettings.row_multiple`, so that the trainer pads exactly as the memory plan predicted)."""
    length = target if settings.sampler == "full" else window
    min_length = settings.min_length or length
    cache = Path(settings.cache_dir).expanduser()

    def tokenize(split: str) -> TokenizedCorpus:
        return tokenize_corpus(settings.data, tokenizer, cache, min_length, split=split,
                               progress=settings.progress and world.is_main)

    corpus = tokenize("train") if world.is_main else None
    world.barrier()  # the other ranks find rank 0's cache instead of tokenizing the corpus again
    corpus = corpus or tokenize("train")
    heldout = None
    if settings.eval_every:
        if resolve_files(settings.data, "valid"):
            heldout = tokenize("valid")
        else:
            corpus, heldout = corpus.split(settings.heldout, settings.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def stream(c: TokenizedCorpus, seed: int, sharded: bool) -> ExampleStream:
        """Global batches of batch_size * ranks rows; `sharded`: only this rank's batch_size rows of each."""
        rank, ranks = (world.rank, world.size) if sharded else (0, 1)
        return ExampleStream(c, window, target, sampler=settings.sampler, chunks=settings.chunks,
                             content=settings.content, batch_size=settings.batch_size * world.size // ranks,
                             seed=seed, pad_id=pad_id, rank=rank, world=ranks,
                             short_share=settings.short_share, row_multiple=row_multiple)

    eval_batches = None
    if heldout is not None:
        def eval_batches():  # rank 0 evaluates whole global batches
            return itertools.islice(iter(stream(heldout, settings.seed + 1, sharded=False)), settings.eval_batches)

    probe = stream(heldout or corpus, settings.seed + 2, sharded=False).next_batch()
    return TrainingData(stream(corpus, settings.seed, sharded=True), eval_batches, probe, corpus.fingerprint,
                        ReadStats(**corpus.meta.get("stats", {})))
