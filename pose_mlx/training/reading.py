"""Reading a corpus: the files a `--data` source stands for and the text documents in them (NumPy-free, no MLX).

A source is a text file (the whole file is one document), a ``.jsonl`` file (one document per line in one of
mlx-lm's formats: ``{"text"}``, chat ``{"messages": [{"role", "content"}, ...]}`` or completions
``{"prompt", "completion"}``, the last two rendered with the tokenizer's chat template), a folder (its
.txt/.md/.py/.jsonl files, recursively, in sorted order; folders written by pose_mlx - holding pose_mlx.json or
run.json - are skipped), or a hub dataset repo id. A folder laid out as mlx-lm's data folders (train.jsonl,
valid.jsonl, test.jsonl) is read by split: training reads only train.jsonl, held-out evaluation valid.jsonl, and
test.jsonl is never read. Empty files are skipped silently; binary and non-UTF-8 ones are skipped and counted as
unreadable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import UserError
from ..model.source import hub_reachable
from ..words import counted

# Imported inside functions, on purpose: `plan` imports this module, and the hub client is needed only to fetch a
# hub data set.

SUFFIXES = (".txt", ".md", ".py", ".jsonl")
#: mlx-lm's data folder layout: a folder with train.jsonl is read split by split.
SPLITS = ("train", "valid", "test")
#: Files that mark a folder written by pose_mlx (an exported model, an unfinished run): never read as data.
OWN_MARKS = ("pose_mlx.json", "run.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(UserError, ValueError):
    """A problem with the user's data, reported as one line (no traceback)."""



@dataclass
class ReadStats:
    """What ``read_documents`` read and skipped. Skips count files (and, for .jsonl, lines). Empty ones hold no
    text to read (a package's empty __init__.py); binary and non-UTF-8 ones are unreadable."""

    files_read: int = 0
    documents: int = 0
    skipped_empty: int = 0
    skipped_binary: int = 0
    skipped_encoding: int = 0

    def unreadable(self) -> int:
        return self.skipped_binary + self.skipped_encoding

    def describe(self) -> str:
        return (f"{counted(self.files_read, 'file')} read, skipped {self.skipped_empty} empty, "
                f"{self.skipped_binary} binary, {self.skipped_encoding} not UTF-8")



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


def check_readable(source) -> None:
    """DataError unless training `source` holds a readable document: it exists, has text files, and one of them
    (or a .jsonl line: text, chat or completions) has text. Reads up to the first such document and needs no
    tokenizer, so that a run checks its data before it downloads or loads a model."""
    stats = ReadStats()
    if next(read_files(resolve_files(source), stats, _unrendered), None) is None:
        raise DataError(f"--data {source}: no readable document ({stats.describe()})")


def _unrendered(record: dict) -> str | None:
    """A chat or completions record as the text it stands for before a chat template renders it (None for
    records of neither kind), for checks that have no tokenizer."""
    return json.dumps(record) if "messages" in record or ("prompt" in record and "completion" in record) else None


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

