"""What a model folder's weight files hold, read from their safetensors headers alone (no weight is loaded).

A safetensors file starts with an unsigned 64-bit little-endian length N and N bytes of JSON: for every tensor its
`dtype` ("F32", "F16", "BF16", "U32" for mlx-lm's packed quantized weights, ...), `shape` and `data_offsets`, and an
optional `__metadata__` entry. mlx-lm loads the `model*.safetensors` files of a folder as stored, so their floating
tensors say the dtype the model computes in (`stored_dtype`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ..errors import UserError

#: safetensors' floating types -> the names config.json's torch_dtype uses.
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
#: A header longer than this is not a weight file's (mlx-lm's shards hold at most a few thousand tensors).
MAX_HEADER_BYTES = 100 << 20


def read_header(path: str | Path) -> dict:
    """The JSON header of the safetensors file `path`: {tensor name: {"dtype", "shape", "data_offsets"}, ...};
    UserError naming the file when it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 2 <= size <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
                raise UserError(f"{path}: not a safetensors file (its header length {size} does not fit the file)")
            header = json.loads(f.read(size).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a readable safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header


def stored_dtype(folder: str | Path) -> str | None:
    """The floating dtype that holds most of the values in `folder`'s model*.safetensors files (float32, float16,
    bfloat16; a quantized model's scales count, its packed integer weights do not), or None when the folder has no
    such file or no floating tensor."""
    counts: dict[str, int] = {}
    for path in sorted(Path(folder).glob("model*.safetensors")):
        for name, info in read_header(path).items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            dtype = FLOAT_DTYPES.get(info.get("dtype"))
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + math.prod(int(n) for n in info.get("shape", ()))
    return max(counts, key=counts.get) if counts else None


__all__ = ["FLOAT_DTYPES", "read_header", "stored_dtype"]
