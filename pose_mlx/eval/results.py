"""Where an evaluation's results go, and the rule that one result never replaces another.

A result is its JSON; its plots lie beside it (`<stem>_accuracy.png`, ...). Without `--output`, `passkey`,
`perplexity` and `ruler` write into one folder per model (`results_folder`):

- `<model folder>/eval/` for a model folder named on the command line (the results stay with the model; a folder
  this process may not write into falls back to the next case);
- `out/eval/<name>/` in the current folder otherwise, `<name>` the GGUF file's stem or the hub id (`owner--name`;
  an alias's hub id), made safe for a file name;

under a name that says what was measured (`default_name`): the command, the schedule applied at load, the lengths
and the command's own counts, e.g. `passkey-16k-5trials.json`, `perplexity-2k_8k-email.json`,
`ruler-yarn-x4-4k_8k-10samples.json`. When that name is taken (its JSON exists), the next free one is used:
`-2`, `-3`, ... A name whose `.partial.jsonl` holds another run's records (`pose_mlx.resumable`) is taken too, so a
run never discards another's progress, while the same command after an interruption comes back to its own name and
takes its records up. `--overwrite` replaces the first name instead.

An explicit `--output` is used as given; when its JSON exists the command refuses before loading the model
(`check_free`), unless `--overwrite`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ..errors import UserError
from ..resumable import read_partial

#: Characters kept in a name made from a model reference or a data path; others become "_".
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
#: How many numbered names (-2, -3, ...) are tried before giving up.
MAX_TRIES = 10_000


def safe_name(text: str) -> str:
    """`text` usable as one file name: "/" as "--", other characters outside [A-Za-z0-9._+-] as "_"."""
    name = _UNSAFE.sub("_", str(text).replace("/", "--")).strip("._") or "model"
    return name[:100]


def short_length(n: int) -> str:
    """A length as written on the command line: 16384 -> "16k", 1536 -> "1.5k", 1000 -> "1000"."""
    return f"{n / 1024:g}k" if n >= 1024 and (n * 10) % 1024 == 0 else str(n)


def results_folder(reference: str, model_ref) -> Path:
    """The default folder of a model's results: `<folder>/eval` for the model folder `reference` (when it may be
    written into), else `out/eval/<name>` (`model_ref`: the `pose_mlx.model.source.ModelRef` it resolved to)."""
    folder = Path(reference).expanduser()
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return folder / "eval"
    if model_ref is not None and model_ref.is_gguf:
        name = Path(model_ref.path).stem
    else:
        name = model_ref.name if model_ref is not None and not folder.is_dir() else folder.resolve().name
    return Path("out") / "eval" / safe_name(name)


def default_name(kind: str, lengths: list[int], schedule: str | None = None, details: tuple = ()) -> str:
    """`<kind>[-<schedule>]-<lengths>[-<detail>...]`, e.g. "passkey-yarn-x4-4k_8k_16k-10trials"."""
    parts = [kind, *([schedule] if schedule else []), "_".join(short_length(n) for n in lengths), *details]
    return "-".join(safe_name(str(p)) for p in parts if str(p))


def _taken(path: Path, header: dict | None) -> bool:
    """Whether `path` holds a result, or its `.partial.jsonl` another run's records than `header`'s."""
    if path.exists():
        return True
    partial_header, _ = read_partial(path.with_name(path.name + ".partial.jsonl"))
    return header is not None and partial_header is not None and partial_header != json.loads(json.dumps(header))


def free_path(folder: Path, name: str, header: dict | None = None, overwrite: bool = False) -> Path:
    """`folder/name.json`, or with `-2`, `-3`, ... the first that is not taken (`_taken`); with `overwrite` the
    first, taken or not."""
    first = folder / f"{name}.json"
    if overwrite:
        return first
    for index in range(1, MAX_TRIES + 1):
        path = first if index == 1 else folder / f"{name}-{index}.json"
        if not _taken(path, header):
            return path
    raise UserError(f"{folder}: {MAX_TRIES} results named {name} already; pass --output")


def check_free(output: str | os.PathLike, overwrite: bool) -> None:
    """An explicit --output that holds a result is refused (UserError), unless `overwrite`."""
    if not overwrite and Path(output).expanduser().exists():
        raise UserError(f"--output {output} exists (an earlier result); pass --overwrite to replace it, or "
                        "another --output")


def output_path(kind: str, args, info, lengths: list[int], details: tuple = (), header: dict | None = None) -> Path:
    """Where this run writes its JSON: `args.output` as given, else the default (module docstring), said on
    stderr. `info`: the `longctx.EvalModel`; `details`: the command's parts of the name; `header`: the run's
    `.partial.jsonl` header (resumable commands)."""
    if args.output:
        return Path(args.output).expanduser()
    schedule = None
    if args.schedule or args.target:
        schedule = f"{args.schedule or 'linear'}-x{info.maximum / info.original:g}"
    folder = results_folder(args.model, info.ref)
    path = free_path(folder, default_name(kind, lengths, schedule, details), header, args.overwrite)
    print(f"no --output given: writing {path}", file=sys.stderr)
    return path


__all__ = ["check_free", "default_name", "free_path", "output_path", "results_folder", "safe_name",
           "short_length"]
