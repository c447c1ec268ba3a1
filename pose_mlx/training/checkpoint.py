"""Crash-safe, verified training checkpoints: trainable weights, optimizer state, data position, step.

Layout of a checkpoint folder::

    weights-<step>.safetensors    trainable parameters (tree_flatten names)
    optimizer-<step>.safetensors  tree_flatten(optimizer.state) (Adam moments, step, learning rate)
    state.json                    {"step", "data", "metrics", "files", "sha256"} - written last
    previous.json                 the record of the checkpoint before it (its files are kept too)

Every file is written whole (`pose_mlx.files.write_atomic`: a temporary name renamed into place), and
`state.json`, which names the files of the step it describes and their SHA-256, is replaced last. A process
killed at any moment therefore leaves either the previous complete checkpoint or the new one, never a mixture.
On load every file's checksum is verified: a damaged file is a `UserError` that names it (and tells how to fall
back to the previous checkpoint, which is kept). Only finite weights are ever saved (`NonFiniteWeights`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..files import write_atomic

STATE_FILE = "state.json"
PREVIOUS_FILE = "previous.json"


class NonFiniteWeights(RuntimeError):
    """A trainable parameter holds NaN or inf: it must not be checkpointed or exported."""


def _atomic_save_safetensors(path: Path, arrays: dict) -> str:
    """Write `arrays` to `path` atomically; returns the file's SHA-256."""
    write_atomic(path, lambda tmp: mx.save_safetensors(str(tmp), arrays))
    return sha256(path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def all_finite(arrays: dict) -> bool:
    """True when every array of `arrays` holds only finite numbers (one reduction per array)."""
    checks = [mx.all(mx.isfinite(a)) for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)]
    mx.eval(checks)
    return all(bool(c.item()) for c in checks)


def save_checkpoint(folder, step: int, model, optimizer, data_state: dict, metrics: dict | None = None) -> Path:
    """Write the checkpoint of `step` into `folder` atomically, keep the one before it, delete older files.

    `data_state` must be JSON-serialisable (the data stream's `state_dict()`). NonFiniteWeights (nothing
    written) when a trainable parameter is not finite.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    if not all_finite(weights):
        raise NonFiniteWeights(f"a trainable parameter is not finite at step {step}")
    names = {"weights": f"weights-{step}.safetensors", "optimizer": f"optimizer-{step}.safetensors"}
    digests = {names["weights"]: _atomic_save_safetensors(folder / names["weights"], weights),
               names["optimizer"]: _atomic_save_safetensors(folder / names["optimizer"],
                                                            dict(tree_flatten(optimizer.state)))}
    previous = read_state(folder, verify=False)
    if previous is not None and previous["step"] != step:
        write_atomic(folder / PREVIOUS_FILE, json.dumps(previous, indent=1))
    record = {"step": int(step), "data": data_state, "metrics": metrics or {}, "files": names, "sha256": digests}
    write_atomic(folder / STATE_FILE, json.dumps(record, indent=1, default=_json_default))
    keep = set(names.values()) | set((previous or {}).get("files", {}).values())
    for old in folder.glob("*-*.safetensors"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return folder


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")


def read_state(folder, verify: bool = True) -> dict | None:
    """The `state.json` record of the checkpoint in `folder` (None when there is none); with `verify`, every
    file it names must exist and match its recorded SHA-256, else UserError naming the file."""
    folder = Path(folder)
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        step, files = int(record["step"]), record["files"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise UserError(f"--resume: {path} is damaged; start over with --overwrite") from None
    if verify:
        for name in files.values():
            expected = record.get("sha256", {}).get(name)
            file = folder / name
            problem = "is missing" if not file.is_file() else \
                "is damaged (its SHA-256 differs from the one recorded)" if expected and sha256(file) != expected \
                else None
            if problem:
                raise UserError(f"--resume: checkpoint file {file} (step {step}) {problem}{_fallback(folder)}")
    return record


def _fallback(folder: Path) -> str:
    """How to resume from the previous checkpoint, when one is kept and intact."""
    path = folder / PREVIOUS_FILE
    try:
        previous = json.loads(path.read_text())
        intact = all((folder / n).is_file() and sha256(folder / n) == previous["sha256"][n]
                     for n in previous["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return "; start over with --overwrite"
    if not intact:
        return "; start over with --overwrite"
    return (f"; the previous checkpoint (step {previous['step']}) is intact: `mv {path} {folder / STATE_FILE}` "
            "and --resume again to continue from it")


def last_files(folder) -> list[Path]:
    """The files of the last checkpoint in `folder`: its state.json and the two files it names (the previous
    checkpoint's left out); [] when there is none."""
    record = read_state(folder, verify=False)
    return [] if record is None else [Path(folder) / STATE_FILE] + [Path(folder) / n for n in record["files"].values()]


def load_checkpoint(folder, model, optimizer) -> dict:
    """Restore trainable weights and optimizer state; return the state record (step, data, metrics).

    UserError when `folder` holds no complete, intact checkpoint or the weights do not fit the model.
    """
    record = read_state(folder)
    if record is None:
        raise UserError(f"--resume: checkpoint folder {folder} has no {STATE_FILE}; nothing to resume")
    folder = Path(folder)
    weights = mx.load(str(folder / record["files"]["weights"]))
    expected = dict(tree_flatten(model.trainable_parameters()))
    if set(weights) != set(expected):
        missing = sorted(set(expected) ^ set(weights))[:3]
        raise UserError(f"--resume: checkpoint in {folder} does not match the model's trainable parameters "
                        f"(e.g. {missing}); resume with the same --model/--lora/--full settings")
    model.load_weights(list(weights.items()), strict=False)
    optimizer.state = tree_unflatten(list(mx.load(str(folder / record["files"]["optimizer"])).items()))
    mx.eval(model.parameters(), optimizer.state)
    return record


def trained_steps(run_folder) -> int:
    """The step of the last checkpoint in a run folder's `checkpoint/` (0 when it has none yet)."""
    state = read_state(Path(run_folder) / "checkpoint", verify=False)
    return int(state["step"]) if state else 0


__all__ = ["NonFiniteWeights", "PREVIOUS_FILE", "STATE_FILE", "all_finite", "last_files", "load_checkpoint",
           "read_state", "save_checkpoint", "sha256", "trained_steps"]
