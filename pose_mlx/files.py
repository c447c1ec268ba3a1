"""Files and folders that appear whole or not at all.

Each is made under a fresh hidden name beside its place (same folder, so same file system) and renamed into
place; a rename within one file system is atomic on POSIX, so a reader, or a run taken up after a kill, finds the
old version or the new one, never a mixture. The hidden names are ``.<stem>.tmp-<pid>-<8 hex><suffix>`` for a
file and ``.<name>.<kind>-<pid>-<8 hex>`` for a folder; `pose_mlx.plan` removes those a killed run left behind.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Union

Content = Union[str, bytes, Callable[[Path], object]]


def sibling(path: str | os.PathLike, kind: str) -> Path:
    """A fresh hidden name beside the folder `path`: ``.<name>.<kind>-<pid>-<8 hex>``."""
    path = Path(path)
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomic(path: str | os.PathLike, content: Content) -> Path:
    """Put `content` at `path` whole: written to a temporary file beside it, flushed to disk (fsync) and renamed
    over `path`. Returns `path`.

    `content` is text (written as UTF-8), bytes, or a function that writes the file at the path it is given
    (``lambda p: mx.save_safetensors(str(p), arrays)``); the temporary name keeps `path`'s suffix for writers
    that go by it. On any error, in the writer or the rename, the temporary file is removed and `path` is left as
    it was (absent, or its previous content).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def replace_dir(new: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Put the finished folder `new` at `dest` (beside it, e.g. a `sibling` of it). Returns `dest`.

    An existing `dest` is first renamed aside (``sibling(dest, "old")``) and removed only once `new` is in its
    place; if that last rename fails, the old folder is renamed back, so `dest` keeps its old content. On failure
    `new` is left where it is, for the caller to remove. (A process killed between the two renames leaves both
    folders under their hidden names.)
    """
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.replace(new, dest)
        return dest
    old = sibling(dest, "old")
    os.replace(dest, old)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return dest


__all__ = ["replace_dir", "sibling", "write_atomic"]
