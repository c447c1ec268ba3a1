"""Where a command will write, checked before anything is loaded or written: a path whose parent is a file can
never be created, and finding that out after an hour of evaluation (or after half a folder is written) is too late.
"""

from __future__ import annotations

from pathlib import Path

from .errors import UserError


def check_output(flag: str, path, folder: bool = False) -> Path:
    """`path` (with `~` expanded) when it can be created: the nearest part above it that exists is a folder,
    and with `folder`, `path` is not a file itself. UserError naming `flag` and the part that is a file otherwise."""
    path = Path(path).expanduser()
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; choose a folder name")
    for parent in path.parents:  # nearest first; a part below a file does not exist
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, not a folder")
            break
    return path


__all__ = ["check_output"]
