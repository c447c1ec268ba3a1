"""The GGUF header: parse and validate everything but the tensor data (no MLX).

File layout (GGUF versions 2 and 3, little-endian):

- header: magic ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 metadata count;
- metadata: count x (key, uint32 value type, value). A string is a uint64 byte length and UTF-8 bytes; an
  array is a uint32 element type, a uint64 element count and the elements. Value types: 0 uint8, 1 int8,
  2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array, 10 uint64, 11 int64, 12 float64;
- tensor infos: count x (name, uint32 n_dims, n_dims x uint64 ne, uint32 ggml type, uint64 offset);
- tensor data: from the first multiple of ``general.alignment`` (default 32) after the infos; each tensor's
  offset is relative to that point and a multiple of the alignment.

``ne[0]`` is the contiguous dimension, so a (rows, columns) matrix has ``ne = [columns, rows]`` and its
NumPy/MLX shape is ``ne`` reversed.

`read_header(path) -> Header`: ``Header.tensors`` has each tensor's type, shape and bytes (what a memory planner
needs), ``Header.metadata`` the key/values. The header is checked against the file size before anything is
allocated, so a truncated or forged file fails with one `UserError` line naming the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import UserError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays nest at most this deep

# Metadata value types: id -> (name, struct format, bytes); 8 = string and 9 = array are variable-sized.
STRING, ARRAY = 8, 9
VALUE_TYPES = {
    0: ("uint8", "<B", 1), 1: ("int8", "<b", 1), 2: ("uint16", "<H", 2), 3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4), 5: ("int32", "<i", 4), 6: ("float32", "<f", 4), 7: ("bool", "<?", 1),
    10: ("uint64", "<Q", 8), 11: ("int64", "<q", 8), 12: ("float64", "<d", 8),
}
_MIN_VALUE_BYTES = {STRING: 8, ARRAY: 12, **{k: v[2] for k, v in VALUE_TYPES.items()}}

# ggml tensor types: id -> (name, values per block, bytes per block). Every type is listed so that the layout
# of any file can be validated (and its metadata read); `weights.LOADABLE` are those `load_gguf` turns into weights.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: `dims` in GGUF order (``ne[0]`` first), `offset` absolute in the file."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (NumPy/MLX) shape: `dims` reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class Header:
    """Everything in a GGUF file but the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    alignment: int
    data_offset: int
    file_size: int
    value_types: dict[str, int] = field(default_factory=dict, repr=False)  # key -> GGUF value type id

    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def fail(self, problem: str) -> UserError:
        return UserError(f"{self.path}: {problem}")

    def require(self, key: str, kind: type | tuple = int):
        """Metadata `key`, which must exist and be of `kind` (int excludes bool; float accepts int)."""
        if key not in self.metadata:
            raise self.fail(f"missing metadata key {key}")
        return self._checked(key, kind)

    def get(self, key: str, default=None, kind: type | tuple | None = None):
        if key not in self.metadata:
            return default
        return self._checked(key, kind) if kind is not None else self.metadata[key]

    def _checked(self, key: str, kind):
        value = self.metadata[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(
            (k is int and isinstance(value, int) and not isinstance(value, bool))
            or (k is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (k not in (int, float) and isinstance(value, k))
            for k in kinds
        )
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(f"metadata {key} must be {names}, got {type(value).__name__} {_short(value)}")
        return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _label(name: str, limit: int = 80) -> str:
    """A key or tensor name fit for a one-line message: control characters escaped, long names cut."""
    if name.isprintable() and len(name) <= limit:
        return name
    text = repr(name)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Cursor:
    """Bounds-checked little-endian reads from a memory-mapped file."""

    def __init__(self, buffer, path: Path):
        self.buf, self.path, self.pos, self.size = buffer, path, 0, len(buffer)

    def fail(self, problem: str) -> UserError:
        return UserError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated at byte {self.size}: {what} at byte {self.pos} needs {n} bytes")

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A uint64 count of items that each take at least `min_item_bytes`: bounded by the bytes left."""
        at = self.pos
        n = self.u64(f"the {what} count")
        left = self.size - self.pos
        if n * min_item_bytes > left:
            raise self.fail(f"{what} count {n} at byte {at} cannot fit in the {left} bytes left in the file "
                            "(truncated or corrupt)")
        return n

    def value(self, type_id: int, what: str, depth: int = 0):
        if type_id in VALUE_TYPES:
            _, fmt, size = VALUE_TYPES[type_id]
            return self.unpack(fmt, size, what)
        if type_id == STRING:
            return self.string(what)
        if type_id == ARRAY:
            at = self.pos
            item_type = self.u32(f"the element type of {what}")
            if item_type not in _MIN_VALUE_BYTES:
                raise self.fail(f"{what} at byte {at} has an unknown element type {item_type}")
            if item_type == ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} at byte {at} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            n = self.count(f"{what} element", _MIN_VALUE_BYTES[item_type])
            if item_type in VALUE_TYPES:  # numbers: one vectorised read
                dtype = np.dtype(VALUE_TYPES[item_type][1].replace("?", "u1"))
                items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return items.astype(bool).tolist() if item_type == 7 else items.tolist()
            return [self.value(item_type, f"{what}[{i}]", depth + 1) for i in range(n)]
        raise self.fail(f"{what} has an unknown value type {type_id}")


def _open_buffer(path: Path):
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    size = path.stat().st_size
    if size < len(MAGIC):
        raise UserError(f"{path}: truncated at byte {size}: too short for a GGUF header")
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_header(path: str | os.PathLike) -> Header:
    """Parse a GGUF file's header, metadata and tensor infos (no tensor data) and validate the layout.

    Checks, before anything proportional to a count is allocated: magic, version (2 or 3), counts and
    string/array lengths against the bytes left, known value and tensor types, 1..4 positive dims with
    ``ne[0]`` a whole number of blocks, alignment (a power of two) and every tensor inside the file, aligned,
    not overlapping another, with a unique name. Any violation raises `UserError` naming the file.
    """
    path = Path(path)
    buffer = _open_buffer(path)
    try:
        return _parse(buffer, path)
    finally:
        buffer.close()


def _parse(buffer, path: Path) -> Header:
    cur = _Cursor(buffer, path)
    magic = bytes(buffer[:4])
    if magic != MAGIC:
        raise cur.fail(f"not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16:
            raise cur.fail("big-endian GGUF files are not supported")
        raise cur.fail(f"GGUF version {version} is not supported (only versions 2 and 3)")
    n_tensors = cur.count("tensor", 32)  # name length 8 + n_dims 4 + one dim 8 + type 4 + offset 8
    n_kv = cur.count("metadata", 13)  # key length 8 + type 4 + one byte of value
    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"metadata key {_label(key)} appears twice")
        type_id = cur.u32(f"the value type of {_label(key)}")
        metadata[key] = cur.value(type_id, f"metadata {_label(key)}")
        value_types[key] = type_id

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a positive power of two, got {_short(alignment)}")

    raw = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        label = _label(name)
        n_dims = cur.u32(f"the dimension count of tensor {label}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {label} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cur.u64(f"dimension {j} of tensor {label}") for j in range(n_dims))
        type_id = cur.u32(f"the type of tensor {label}")
        offset = cur.u64(f"the data offset of tensor {label}")
        raw.append((name, dims, type_id, offset))

    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in raw:
        label = _label(name)
        if name in tensors:
            raise cur.fail(f"tensor {label} appears twice")
        if type_id not in GGML_TYPES:
            raise cur.fail(f"unknown tensor type {type_id} in tensor {label}")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        if any(d <= 0 for d in dims):
            raise cur.fail(f"tensor {label} has a non-positive dimension {list(dims)}")
        if dims[0] % block:
            raise cur.fail(f"tensor {label} ({type_name}) has {dims[0]} values per row, not a multiple of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        if offset % alignment:
            raise cur.fail(f"tensor {label} has offset {offset}, not a multiple of the alignment {alignment}")
        start = data_offset + offset
        if start + nbytes > cur.size:
            raise cur.fail(f"tensor {label} claims {nbytes} bytes at byte {start}, "
                           f"{start + nbytes - cur.size} bytes beyond the end of the file ({cur.size} bytes)")
        tensors[name] = TensorInfo(name, dims, type_id, start, nbytes)

    previous = None
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if previous is not None and info.offset < previous.offset + previous.nbytes:
            raise cur.fail(f"tensors {_label(previous.name)} and {_label(info.name)} overlap")
        previous = info
    return Header(path, version, metadata, tensors, alignment, data_offset, cur.size, value_types)


def _header(path_or_header) -> Header:
    return path_or_header if isinstance(path_or_header, Header) else read_header(path_or_header)


__all__ = ["GGML_TYPES", "Header", "TensorInfo", "read_header"]
