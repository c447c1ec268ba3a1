"""pose_mlx.model.stored: the dtype of a folder's weights from the safetensors headers, checked against files MLX
writes and against headers written byte by byte."""

import json
import struct

import mlx.core as mx
import pytest

from pose_mlx.errors import UserError
from pose_mlx.model.stored import read_header, stored_dtype


def test_the_dtype_holding_most_values_across_shards(tmp_path):
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"),
                        {"a": mx.zeros((64, 64), dtype=mx.bfloat16), "norm": mx.zeros((64,), dtype=mx.float32)})
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"),
                        {"b": mx.zeros((8, 64), dtype=mx.float32), "packed": mx.zeros((512, 512), dtype=mx.uint32)})
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), {"lora": mx.zeros((4096, 64), dtype=mx.float32)})
    assert stored_dtype(tmp_path) == "bfloat16"  # 4096 bf16 values > 576 f32; uint32 and adapters do not count
    header = read_header(tmp_path / "model-00001-of-00002.safetensors")
    assert header["a"]["dtype"] == "BF16" and header["a"]["shape"] == [64, 64]


def test_no_weights_or_no_floating_tensor_says_nothing(tmp_path):
    assert stored_dtype(tmp_path) is None
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"ids": mx.zeros((4,), dtype=mx.int32)})
    assert stored_dtype(tmp_path) is None


def _write(path, header: bytes, length: int | None = None, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def test_a_header_written_by_hand(tmp_path):
    header = {"__metadata__": {"format": "mlx"}, "w": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}}
    _write(tmp_path / "model.safetensors", json.dumps(header).encode(), data=bytes(12))
    assert stored_dtype(tmp_path) == "float16"


@pytest.mark.parametrize("header, length, fragment", [
    (b"{}", 1 << 40, "header length"),  # longer than the file
    (b"", None, "header length"),  # an 8-byte file: no header
    (b"[1, 2]", None, "not a JSON object"),
    (b"{not json", None, "not a readable safetensors file"),
])
def test_damaged_files_are_one_line_errors_naming_the_file(tmp_path, header, length, fragment):
    path = tmp_path / "model.safetensors"
    _write(path, header, length)
    with pytest.raises(UserError, match=fragment) as error:
        stored_dtype(tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
