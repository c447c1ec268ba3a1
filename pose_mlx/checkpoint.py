"""Crash-safe training checkpoints: trainable weights, optimizer state, RNG and data position, step.

Layout of a checkpoint folder::

    weights-<step>.safetensors    trainable parameters (tree_flatten names)
    optimizer-<step>.safetensors  tree_flatten(optimizer.state) (Adam moments, step, learning rate)
    state.json                    {"step", "data", "rng", "metrics", "files"} - written last

Every file is written to a temporary name and moved into place with `os.replace` (atomic on POSIX), and
`state.json`, which names the files of the step it describes, is replaced last. A process killed at any
moment therefore leaves either the previous complete checkpoint or the new one, never a mixture.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

STATE_FILE = "state.json"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_save_safetensors(path: Path, arrays: dict) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.safetensors")
    mx.save_safetensors(str(tmp), arrays)
    os.replace(tmp, path)


def save_checkpoint(folder, step: int, model, optimizer, data_state: dict, rng_state: dict | None = None,
                    metrics: dict | None = None) -> Path:
    """Write the checkpoint of `step` into `folder` atomically and delete older step files.

    `data_state` and `rng_state` must be JSON-serialisable (the data stream's `state_dict()` and any
    NumPy generator states).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    opt_state = dict(tree_flatten(optimizer.state))
    names = {"weights": f"weights-{step}.safetensors", "optimizer": f"optimizer-{step}.safetensors"}
    _atomic_save_safetensors(folder / names["weights"], weights)
    _atomic_save_safetensors(folder / names["optimizer"], opt_state)
    record = {"step": int(step), "data": data_state, "rng": rng_state or {}, "metrics": metrics or {},
              "files": names}
    _atomic_write_text(folder / STATE_FILE, json.dumps(record, indent=1, default=_json_default))
    keep = set(names.values())
    for old in folder.glob("*-*.safetensors"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return folder


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")


def read_state(folder) -> dict | None:
    """The `state.json` record of the checkpoint in `folder`, or None when there is none."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def load_checkpoint(folder, model, optimizer) -> dict:
    """Restore trainable weights and optimizer state; return the state record (step, data, rng, metrics).

    Raises ValueError when `folder` holds no complete checkpoint or the weights do not fit the model.
    """
    record = read_state(folder)
    if record is None:
        raise ValueError(f"checkpoint folder {folder} has no {STATE_FILE}; nothing to resume")
    folder = Path(folder)
    weights = mx.load(str(folder / record["files"]["weights"]))
    expected = dict(tree_flatten(model.trainable_parameters()))
    if set(weights) != set(expected):
        missing = sorted(set(expected) ^ set(weights))[:3]
        raise ValueError(f"checkpoint in {folder} does not match the model's trainable parameters (e.g. {missing}); "
                         "resume with the same --model/--lora/--full settings")
    model.load_weights(list(weights.items()), strict=False)
    opt_state = mx.load(str(folder / record["files"]["optimizer"]))
    optimizer.state = tree_unflatten(list(opt_state.items()))
    mx.eval(model.parameters(), optimizer.state)
    return record


__all__ = ["STATE_FILE", "load_checkpoint", "read_state", "save_checkpoint"]
