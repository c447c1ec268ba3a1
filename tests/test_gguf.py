"""GGUF files: header parsing, llama/qwen2 weights and tokenizers against independent references, bad files,
the convert command, and the real SmolLM2-135M-Instruct Q4_1 file.

References: files are written by the `gguf` PyPI package (llama.cpp's own Python writer and NumPy
(de)quantizers); tokenizers are compared with the `tokenizers` / `sentencepiece` tokenizers they were built
from; the Q/K un-permutation is also checked against the interleaved RoPE llama.cpp runs on the raw rows.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest


import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

gguf = pytest.importorskip("gguf")  # the `test` extra
from gguf import GGMLQuantizationType as Q  # noqa: E402

import _gguf_helpers as H  # noqa: E402
from pose_mlx.model import gguf as pg  # noqa: E402
from pose_mlx.convert import main as convert_main  # noqa: E402
from pose_mlx.errors import UserError  # noqa: E402

QUANT_TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4}
TOL = 1e-4


@pytest.fixture(scope="module")
def bpe():
    """(trained byte-level BPE, its GGUF metadata with the plain GPT-2 pre-tokenizer)."""
    tok = H.train_bpe()
    return tok, H.bpe_metadata(tok, "gpt-2", template="{% for m in messages %}<|im_start|>{{ m['content'] }}"
                                                      "<|im_end|>{% endfor %}")


@pytest.fixture(autouse=True)
def float32_weights(monkeypatch):
    """The weight and tokenizer tests check what load_gguf reads against float32 references at float32 precision
    (TOL), so they load as on the CPU backend: float32, quantized weights dequantized by default. On a GPU
    load_gguf computes in the file's 16-bit precision and keeps quantized weights (see `_compute_dtype`); that
    choice is tested on its own (`test_gpu_loads_in_the_files_precision_within_its_rounding`), and the real
    SmolLM2 file (loaded once per session, outside this fixture) runs on it."""
    monkeypatch.setattr("pose_mlx.model.gguf.load._default_device_is_cpu", lambda: True)


def ids_for(config, seed=1, length=24):
    return mx.array(np.random.default_rng(seed).integers(0, config["vocab_size"], (1, length)))


def logits(model, ids) -> np.ndarray:
    return np.array(model(ids).astype(mx.float32))


# ------------------------------------------------------------------------------------------- header


def test_header_reads_every_value_type_as_written(tmp_path):
    V = gguf.GGUFValueType
    values = {
        "t.u8": (200, V.UINT8), "t.i8": (-100, V.INT8), "t.u16": (60000, V.UINT16), "t.i16": (-30000, V.INT16),
        "t.u32": (4_000_000_000, V.UINT32), "t.i32": (-2_000_000_000, V.INT32), "t.f32": (0.1, V.FLOAT32),
        "t.bool": (True, V.BOOL), "t.str": ("héllo, 東京", V.STRING), "t.u64": (2**63 + 5, V.UINT64),
        "t.i64": (-(2**62), V.INT64), "t.f64": (0.1, V.FLOAT64),
    }
    arrays = {"t.ints": [1, -2, 3], "t.floats": [0.5, -1.25], "t.strs": ["a", "", "ü c"],
              "t.bools": [True, False, True], "t.nested": [[1, 2], [3]]}
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_custom_alignment(64)
    for key, (value, vtype) in values.items():
        writer.add_key_value(key, value, vtype)
    for key, value in arrays.items():
        writer.add_array(key, value)
    writer.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b", np.ones((4, 32), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    h = pg.read_header(tmp_path / "v.gguf")
    for key, (value, vtype) in values.items():
        expected = float(np.float32(value)) if vtype == V.FLOAT32 else value
        assert h.metadata[key] == expected and type(h.metadata[key]) is type(expected), key
        assert h.value_types[key] == int(vtype)
    assert h.metadata["t.ints"] == [1, -2, 3] and h.metadata["t.floats"] == [0.5, -1.25]
    assert h.metadata["t.strs"] == ["a", "", "ü c"] and h.metadata["t.bools"] == [True, False, True]
    assert h.metadata["t.nested"] == [[1, 2], [3]]
    assert h.metadata["general.architecture"] == "llama" and h.alignment == 64 and h.version == 3
    reader = gguf.GGUFReader(str(tmp_path / "v.gguf"))  # gguf-py's own reader locates the same bytes
    for t in reader.tensors:
        info = h.tensors[t.name]
        assert (info.offset, info.nbytes, info.dims, info.type_name) == (
            int(t.data_offset), int(t.n_bytes), tuple(int(d) for d in t.shape), t.tensor_type.name)
    assert h.tensors["a"].shape == (2, 3) and h.data_offset % 64 == 0

    data = bytearray((tmp_path / "v.gguf").read_bytes())
    data[4:8] = struct.pack("<I", 2)  # version 2 has the same layout
    (tmp_path / "v2.gguf").write_bytes(data)
    assert pg.read_header(tmp_path / "v2.gguf").metadata == h.metadata


# ------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_round_trip_equals_the_source_model(tmp_path, bpe, tied):
    """Also with float64 and nested-array metadata (valid GGUF on which mx.load's own parser crashes)."""
    V = gguf.GGUFValueType
    config = H.model_config(bpe[0].get_vocab_size(), tied)
    weights = H.random_weights(config)
    H.write_gguf(tmp_path / "m.gguf", config, weights, bpe[1],
                 metadata={"general.score": (0.5, V.FLOAT64), "general.nested": ([[1, 2], [3]], V.ARRAY)})
    model, tokenizer, cfg = pg.load_gguf(tmp_path / "m.gguf")
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert cfg[key] == config[key], key
    assert cfg["rope_theta"] == config["rope_theta"] and cfg["head_dim"] == 16
    assert cfg["rms_norm_eps"] == 1e-5  # written as float32, read back as the decimal it stands for
    assert ("lm_head" in dict(model.children())) == (not tied)
    ids = ids_for(config)
    expected = logits(H.model_with(config, weights), ids)
    assert np.abs(logits(model, ids) - expected).max() <= TOL
    assert np.abs(expected).max() > 1.0  # logits of a size that makes the tolerance meaningful


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "kept"])
def test_quantized_round_trip_equals_gguf_py_dequantization(tmp_path, bpe, qtype, keep):
    """Weights dequantized by gguf-py's NumPy code (an independent reference) give the same logits as
    load_gguf, whether it dequantizes them or keeps them as MLX quantized layers."""
    config = H.model_config(bpe[0].get_vocab_size(), tied=qtype in (Q.Q4_0, Q.BF16))
    weights = H.random_weights(config, seed=3)
    reference = H.write_gguf(tmp_path / "m.gguf", config, weights, bpe[1], types=lambda name: qtype)
    model, _, _ = pg.load_gguf(tmp_path / "m.gguf", keep_quantized=keep)
    ids = ids_for(config)
    expected = logits(H.model_with(config, reference), ids)
    got = logits(model, ids)
    assert np.abs(got - expected).max() <= TOL
    assert np.abs(got - logits(H.model_with(config, weights), ids)).max() > TOL * 10  # the types are lossy
    q_proj, embed = model.model.layers[0].self_attn.q_proj, model.model.embed_tokens
    if keep and qtype in BITS:
        assert (q_proj.bits, q_proj.group_size, embed.bits) == (BITS[qtype], 32, BITS[qtype])
    else:
        assert not isinstance(q_proj, nn.QuantizedLinear) and q_proj.weight.dtype == mx.float32


def test_mixed_types_like_a_real_file(tmp_path, bpe):
    """Q8_0 embedding and output, Q4_0/Q4_1/Q8_0/F16/BF16 matrices, F32 norms, 64-byte alignment."""
    kinds = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
             "attn_output": Q.F16, "ffn_gate": Q.Q4_1, "ffn_up": Q.BF16, "ffn_down": Q.Q4_0}
    config = H.model_config(bpe[0].get_vocab_size(), tied=False)
    reference = H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config, seed=5), bpe[1],
                             types=lambda name: kinds[name.split(".")[-2]], alignment=64)
    ids = ids_for(config)
    expected = logits(H.model_with(config, reference), ids)
    for keep in (False, True):
        model, _, _ = pg.load_gguf(tmp_path / "m.gguf", keep_quantized=keep)
        assert np.abs(logits(model, ids) - expected).max() <= TOL
    layer = model.model.layers[1]
    assert (layer.self_attn.q_proj.bits, layer.self_attn.v_proj.bits, model.lm_head.bits) == (4, 8, 8)
    assert not isinstance(layer.self_attn.o_proj, nn.QuantizedLinear)  # F16: a float32 Linear (CPU choice)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_gpu_loads_in_the_files_precision_within_its_rounding(tmp_path, bpe, qtype, monkeypatch):
    """Off the CPU load_gguf computes in float16 (bfloat16 for a file with BF16 tensors) and keeps Q8_0/Q4_0/Q4_1
    weights quantized; here that choice is made as on a GPU (on whatever device runs the suite): the logits agree
    with gguf-py's float32 dequantization to the 16-bit dtype's rounding (`_precision.logit_tolerance`), which the
    float32 bound does not cover."""
    from _precision import logit_tolerance

    monkeypatch.setattr("pose_mlx.model.gguf.load._default_device_is_cpu", lambda: False)
    config = H.model_config(bpe[0].get_vocab_size(), tied=qtype in (Q.Q4_0, Q.BF16))
    reference = H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config, seed=3), bpe[1],
                             types=lambda name: qtype)
    model, _, _ = pg.load_gguf(tmp_path / "m.gguf")
    dtype = mx.bfloat16 if qtype == Q.BF16 else mx.float16
    assert model.model.norm.weight.dtype == dtype
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear) == (qtype in BITS)
    ids = ids_for(config)
    expected = logits(H.model_with(config, reference), ids)
    error = np.abs(logits(model, ids) - expected).max()
    assert TOL < error <= logit_tolerance(dtype, expected), error


def test_unpermuted_rows_match_llama_cpp_interleaved_rope(tmp_path, bpe):
    """llama.cpp applies the interleaved RoPE to the permuted rows: a model with rope_traditional=True on the
    file's raw rows equals the un-permuted half-split model; on the raw rows the half-split one does not."""
    config = H.model_config(bpe[0].get_vocab_size(), tied=True)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config, seed=7), bpe[1])
    model, _, _ = pg.load_gguf(tmp_path / "m.gguf")
    mlx_names = {H.gguf_name(name): name for name in H.random_weights(config)}
    raw = {mlx_names[t.name]: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    ids = ids_for(config, length=40)
    interleaved = logits(H.model_with({**config, "rope_traditional": True}, raw), ids)
    assert np.abs(logits(model, ids) - interleaved).max() <= TOL
    assert np.abs(logits(H.model_with(config, raw), ids) - interleaved).max() > 100 * TOL


def test_llama_qkv_biases_are_unpermuted_and_a_missing_output_bias_is_zero(tmp_path, bpe):
    """llama.cpp permutes Q/K biases like the rows; its llama graph allows Q/K/V biases without an output
    bias, which mlx-lm's llama (one attention_bias flag) gets as zeros."""
    config = H.model_config(bpe[0].get_vocab_size(), tied=True, attention_bias=True)
    weights = H.random_weights(config, seed=13)
    for layer in range(config["num_hidden_layers"]):
        weights[f"model.layers.{layer}.self_attn.o_proj.bias"][:] = 0
    dropped = tuple(f"blk.{layer}.attn_output.bias" for layer in range(config["num_hidden_layers"]))
    H.write_gguf(tmp_path / "b.gguf", config, weights, bpe[1], drop_tensors=dropped)
    model, _, cfg = pg.load_gguf(tmp_path / "b.gguf")
    assert cfg["attention_bias"] is True
    ids = ids_for(config)
    assert np.abs(logits(model, ids) - logits(H.model_with(config, weights), ids)).max() <= TOL


def test_qwen2_biases_and_no_permutation(tmp_path):
    base = H.train_bpe(vocab_size=400)
    tok = H.source_tokenizer(base, "qwen2")
    config = H.model_config(tok.get_vocab_size(), tied=True, model_type="qwen2")
    weights = H.random_weights(config, seed=11)
    assert any(name.endswith("q_proj.bias") for name in weights)
    reference = H.write_gguf(tmp_path / "q.gguf", config, weights, H.bpe_metadata(tok, "qwen2"),
                             types=lambda name: Q.Q8_0)
    model, tokenizer, cfg = pg.load_gguf(tmp_path / "q.gguf")
    assert cfg["model_type"] == "qwen2" and type(model).__module__ == "mlx_lm.models.qwen2"
    ids = ids_for(config)
    assert np.abs(logits(model, ids) - logits(H.model_with(config, reference), ids)).max() <= TOL
    text = H.TEXTS[1]
    assert tokenizer.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids


def test_llama3_rope_freqs_become_mlx_lm_llama3_scaling(tmp_path, bpe):
    """A rope_freqs tensor written with llama.cpp's converter formula is read back as the "llama3" rope_scaling
    whose frequencies (mlx-lm's own Llama3RoPE) are the file's."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    config = H.model_config(bpe[0].get_vocab_size(), tied=True, rope_theta=500000.0, head_dim=64,
                            num_attention_heads=1, num_key_value_heads=1)
    dims = config["head_dim"]
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, dims, 2) / dims)
    factors = []
    for freq in inv_freq:  # the converter's loop
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    factors = np.array(factors, np.float32)
    assert 2 <= ((factors > 1) & (factors < factor)).sum()

    path = tmp_path / "l3.gguf"
    H.write_gguf(path, config, H.random_weights(config), bpe[1])
    H.rewrite(path, add={"rope_freqs.weight": (factors, None)})
    cfg = pg.config_from_gguf(path)
    rope = Llama3RoPE(dims, base=500000.0, scaling_config=cfg["rope_scaling"])
    expected = 500000.0 ** (np.arange(0, dims, 2) / dims) * factors
    np.testing.assert_allclose(np.array(rope._freqs), expected, rtol=1e-5)
    model, _, _ = pg.load_gguf(path)
    assert isinstance(model.model.layers[0].self_attn.rope, Llama3RoPE)


# ----------------------------------------------------------------------------------------- tokenizers

PRES = ["gpt-2", "smollm", "llama-bpe", "qwen2"]


@pytest.fixture(scope="module")
def bpe_by_pre(bpe, tmp_path_factory):
    """{pre: (source tokenizer, loaded TokenizerWrapper)}: one vocabulary and merge list behind each
    pre-tokenizer, as the models using it define it themselves."""
    folder = tmp_path_factory.mktemp("pre")
    config = H.model_config(bpe[0].get_vocab_size(), tied=True)
    weights = H.random_weights(config)
    out = {}
    for pre in PRES:
        source = H.source_tokenizer(bpe[0], pre)
        H.write_gguf(folder / f"{pre}.gguf", config, weights, H.bpe_metadata(source, pre))
        out[pre] = (source, pg.load_tokenizer(folder / f"{pre}.gguf"))
    return out


@pytest.mark.parametrize("pre", PRES)
def test_byte_level_bpe_encodes_like_its_source(bpe_by_pre, pre):
    source, loaded = bpe_by_pre[pre]
    for text in H.TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == source.encode(text, add_special_tokens=False).ids, text
        assert loaded.decode(ids) == text
    im_start = source.token_to_id("<|im_start|>")
    assert loaded.encode("<|im_start|>", add_special_tokens=False) == [im_start]  # control token
    assert loaded.encode("<tool>", add_special_tokens=False) == [source.token_to_id("<tool>")]  # user-defined
    assert loaded.bos_token_id == im_start and loaded.eos_token_ids == {source.token_to_id("<|im_end|>")}
    with_bos = pre == "llama-bpe"  # llama.cpp's default for Llama 3 pre-tokenizers only
    assert loaded.encode("hi") == [im_start] * with_bos + loaded.encode("hi", add_special_tokens=False)


def test_pre_tokenizers_give_different_tokens(bpe_by_pre):
    """The comparison above can fail: the four pre-tokenizers split the test texts differently."""
    encodings = {pre: [bpe_by_pre[pre][1].encode(t, add_special_tokens=False) for t in H.TEXTS] for pre in PRES}
    assert len({json.dumps(e) for e in encodings.values()}) == len(PRES)


@pytest.mark.parametrize("dummy_prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_sentencepiece_vocabulary_encodes_like_sentencepiece(tmp_path, dummy_prefix):
    sp = H.train_spm(tmp_path, dummy_prefix)
    config = H.model_config(sp.get_piece_size(), tied=True)
    H.write_gguf(tmp_path / "s.gguf", config, H.random_weights(config), H.spm_metadata(sp, dummy_prefix))
    loaded = pg.load_tokenizer(tmp_path / "s.gguf")
    texts = H.TEXTS[:4] + H.TEXTS[5:] + ["hello", "  two  spaces", "x\ny", "\u00e9\u00e9\u00e9 \U0001F642"]
    fallback = 0
    for text in texts:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert loaded.decode(ids) == sp.decode(ids)
        fallback += any(sp.is_byte(i) for i in ids)
    assert fallback  # byte fallback was exercised
    assert loaded.encode("hello") == [sp.bos_id()] + sp.encode("hello")  # BOS once (llama.cpp's default)


def test_chat_template_and_special_ids(tmp_path, bpe):
    config = H.model_config(bpe[0].get_vocab_size(), tied=True)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config), bpe[1])
    tokenizer = pg.load_tokenizer(tmp_path / "m.gguf")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>hi<|im_end|>"
    written = json.loads(json.dumps(pg.tokenizer_config(tmp_path / "m.gguf")))
    assert (written["bos_token"], written["eos_token"], written["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>")


# ------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize("keep", [False, True], ids=["float32", "kept"])
def test_convert_folder_loads_with_mlx_lm(tmp_path, bpe, keep):
    from mlx_lm import generate, load

    kinds = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0}
    config = H.model_config(bpe[0].get_vocab_size(), tied=True)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config, seed=2), bpe[1],
                 types=lambda name: kinds.get(name.split(".")[-2], Q.F16))
    out = pg.convert(tmp_path / "m.gguf", tmp_path / "out", keep_quantized=keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no temporary left behind
    model, tokenizer = load(str(out))
    reference, ref_tokenizer, _ = pg.load_gguf(tmp_path / "m.gguf", keep_quantized=keep)
    saved = json.loads((out / "config.json").read_text())
    assert saved["torch_dtype"] == ("float16" if keep else "float32")
    # the folder holds load_gguf's parameters: exactly, or rounded to float16 when quantized weights are kept
    stored, loaded = dict(tree_flatten(model.parameters())), dict(tree_flatten(reference.parameters()))
    assert stored.keys() == loaded.keys()
    for name, array in stored.items():
        assert np.array_equal(np.array(array), np.array(loaded[name].astype(array.dtype))), name
    assert tokenizer.encode(H.TEXTS[0]) == ref_tokenizer.encode(H.TEXTS[0])
    if keep:
        assert saved["quantization"]["bits"] == 4 and saved["quantization"]["model.embed_tokens"]["bits"] == 8
        assert model.model.layers[0].self_attn.v_proj.bits == 8 and model.model.embed_tokens.bits == 8
    else:
        assert "quantization" not in saved and model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
        ids = ids_for(config)
        assert np.abs(logits(model, ids) - logits(reference, ids)).max() <= TOL
        text = generate(model, tokenizer, "The quick", max_tokens=4)
        assert text == generate(reference, ref_tokenizer, "The quick", max_tokens=4)


def test_convert_cli_refuses_an_existing_folder_and_overwrites_on_request(tmp_path, bpe, capsys):
    config = H.model_config(bpe[0].get_vocab_size(), tied=True)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config), bpe[1])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"pose_mlx.convert: error: {tmp_path / 'out'} already exists; pass --overwrite to replace it"]
    assert (tmp_path / "out" / "mine.txt").exists()
    assert convert_main([str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "config.json" in printed and "model.safetensors" in printed
    assert not (tmp_path / "out" / "mine.txt").exists() and (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


# ------------------------------------------------------------------------------------------ bad files


def _field_offset(field, part: int) -> int:
    return int(field.offset) + sum(p.nbytes for p in field.parts[:part])


def _patch(path: Path, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def _tensor_field(path: Path, name: str, part: str) -> int:
    """Byte offset of a tensor info's dims / type / offset field (found with gguf-py's reader)."""
    field = next(t.field for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return _field_offset(field, {"dims": 3, "type": 4, "offset": 5}[part])


def _kv_field(path: Path, key: str, part: int) -> int:
    return _field_offset(gguf.GGUFReader(str(path)).fields[key], part)


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


BAD = {  # name: (how to break the valid file, what the message says)
    "wrong magic": (lambda p: _patch(p, 0, "4s", b"GGML"), "not a GGUF file"),
    "version 1": (lambda p: _patch(p, 4, "<I", 1), "GGUF version 1 is not supported"),
    "truncated header": (lambda p: _truncate(p, _tensor_field(p, "output.weight", "offset") + 4),
                         "the data offset of tensor output.weight"),
    "truncated in the counts": (lambda p: _truncate(p, 100), "cannot fit in the 84 bytes left"),
    "truncated tensor data": (lambda p: _truncate(p, p.stat().st_size - 64), "beyond the end of the file"),
    "forged offset": (lambda p: _patch(p, _tensor_field(p, "blk.0.ffn_up.weight", "offset"), "<Q", 2**40),
                      "tensor blk.0.ffn_up.weight claims"),
    "forged size": (lambda p: _patch(p, _tensor_field(p, "blk.1.attn_q.weight", "dims") + 8, "<Q", 2**34),
                    "tensor blk.1.attn_q.weight claims"),
    "forged array length": (lambda p: _patch(p, _kv_field(p, "tokenizer.ggml.tokens", 4), "<Q", 2**60),
                            "element count 1152921504606846976"),
    "forged tensor count": (lambda p: _patch(p, 8, "<Q", 2**61), "tensor count"),
    "forged metadata count": (lambda p: _patch(p, 16, "<Q", 2**61), "metadata count"),
    "forged string length": (lambda p: _patch(p, 24, "<Q", 2**62), "truncated at byte"),
    "unaligned offset": (lambda p: _patch(p, _tensor_field(p, "output_norm.weight", "offset"), "<Q", 4),
                         "not a multiple of the alignment"),
    "overlapping tensors": (lambda p: _patch(p, _tensor_field(p, "blk.0.ffn_gate.weight", "offset"), "<Q",
                                             _offset_of(p, "blk.0.ffn_up.weight")), "overlap"),
    "zero dimension": (lambda p: _patch(p, _tensor_field(p, "blk.0.attn_k.weight", "dims"), "<Q", 0),
                       "non-positive dimension"),
    "unknown tensor type": (lambda p: _patch(p, _tensor_field(p, "blk.0.attn_v.weight", "type"), "<I", 99),
                            "unknown tensor type 99 in tensor blk.0.attn_v.weight"),
    "unknown value type": (lambda p: _patch(p, _kv_field(p, "llama.block_count", 2), "<I", 13),
                           "unknown value type 13"),
    "unsupported tensor type": ({"q5_k": True}, "unsupported tensor type Q5_K in tensor blk.0.ffn_down.weight"),
    "unsupported architecture": ({"arch": "gemma"}, "unsupported architecture 'gemma'"),
    "missing metadata key": ({"skip": ("llama.block_count",)}, "missing metadata key llama.block_count"),
    "wrong metadata type": ({"metadata": {"llama.block_count": ("two", gguf.GGUFValueType.STRING)}},
                            "metadata llama.block_count must be int"),
    "missing tensor": ({"drop_tensors": ("blk.1.ffn_up.weight",)}, "missing tensor blk.1.ffn_up.weight"),
    "shape disagrees with metadata": ({"metadata": {"llama.feed_forward_length": (192, gguf.GGUFValueType.UINT32)}},
                                      "has shape [256, 64] but the metadata implies [192, 64]"),
    "unsupported pre-tokenizer": ({"pre": "tekken"}, "unsupported pre-tokenizer 'tekken'"),
    "unsupported tokenizer": ({"metadata": {"tokenizer.ggml.model": ("bert", gguf.GGUFValueType.STRING)}},
                              "unsupported tokenizer model 'bert'"),
    "no such file": ({"missing": True}, "no such file"),
}


def _offset_of(path: Path, name: str) -> int:
    return int(next(t.field.parts[5][0] for t in gguf.GGUFReader(str(path)).tensors if t.name == name))


@pytest.fixture(scope="module")
def bad_files(bpe, tmp_path_factory):
    """{case: path of the broken file}, each in a folder of its own."""
    config = H.model_config(bpe[0].get_vocab_size(), tied=False, intermediate_size=256)
    weights = H.random_weights(config)
    out = {}
    for case, (how, _) in BAD.items():
        folder = tmp_path_factory.mktemp("bad")
        path = folder / "model.gguf"
        options = dict(how) if isinstance(how, dict) else {}
        if options.pop("missing", False):
            out[case] = path
            continue
        q5_k = options.pop("q5_k", False)
        H.write_gguf(path, config, weights, H.bpe_metadata(bpe[0], options.pop("pre", "gpt-2")), **options)
        if q5_k:  # gguf-py has no Q5_K quantizer: raw blocks (256 values in 176 bytes), never read
            blocks = np.zeros((config["hidden_size"], config["intermediate_size"] // 256 * 176), np.uint8)
            H.rewrite(path, replace={"blk.0.ffn_down.weight": (blocks, Q.Q5_K)})
        if callable(how):
            how(path)
        out[case] = path
    return out


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_one_user_error(bad_files, case):
    path, fragment = bad_files[case], BAD[case][1]
    with pytest.raises(UserError) as error:
        pg.load_gguf(path)
    message = str(error.value)
    assert fragment in message and message.startswith(str(path)) and "\n" not in message, message


@pytest.mark.parametrize("case", list(BAD))
def test_convert_cli_reports_a_bad_file_in_one_line(bad_files, case, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_main([str(bad_files[case]), str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("pose_mlx.convert: error: ") and BAD[case][1] in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary folder left


def test_random_corruptions_fail_cleanly(tmp_path, bpe):
    """Bytes of the header region overwritten at random (single bytes, 32- and 64-bit fields with extreme
    values, truncations): reading the header, config and tokenizer either works or raises one-line
    UserErrors, never another exception; so does loading with forged tensor-info and metadata numbers."""
    import random

    config = H.model_config(bpe[0].get_vocab_size(), tied=True, hidden_size=32, head_dim=8, intermediate_size=64)
    H.write_gguf(tmp_path / "base.gguf", config, H.random_weights(config), bpe[1])
    data = (tmp_path / "base.gguf").read_bytes()
    end = pg.read_header(tmp_path / "base.gguf").data_offset
    reader = gguf.GGUFReader(str(tmp_path / "base.gguf"))
    fields = [_field_offset(t.field, part) for t in reader.tensors for part in (2, 3, 4, 5)]
    fields += [_field_offset(f, 3) for k, f in reader.fields.items()
               if not k.startswith("GGUF.") and f.types[0] not in (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)]
    extremes = [0, 1, 2, 7, 13, 32, 2**20, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]
    rng = random.Random(0)
    path = tmp_path / "broken.gguf"
    outcomes = Counter()
    for i in range(500):
        broken = bytearray(data)
        full_load = i % 5 == 0
        pos = rng.choice(fields) if full_load else rng.randrange(end)
        kind = rng.choice(["byte", "u32", "u64", "cut"])
        if kind == "byte":
            broken[pos] = rng.randrange(256)
        elif kind == "cut" and not full_load:
            del broken[pos:]
        else:
            width = 4 if kind == "u32" else 8
            broken[pos:pos + width] = rng.choice(extremes).to_bytes(8, "little")[:width]
        path.write_bytes(bytes(broken))
        try:
            if full_load:
                pg.load_gguf(path)
            else:
                header = pg.read_header(path)
                pg.config_from_gguf(header)
                pg.build_tokenizer(header)
            outcomes["loaded"] += 1
        except UserError as error:
            assert "\n" not in str(error) and len(str(error)) < 500, str(error)
            outcomes["user error"] += 1
    assert outcomes["user error"] > 100 and outcomes["loaded"] > 10, outcomes


def test_convert_command_exit_code(bad_files, tmp_path):
    result = subprocess.run([sys.executable, "-m", "pose_mlx.convert", str(bad_files["forged array length"]),
                             str(tmp_path / "out")], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the real model

DOCS = Path("/usr/share/doc/python3.11/html/_sources/tutorial/controlflow.rst.txt")


@pytest.fixture(scope="module")
def real(smollm2):
    return smollm2


def test_real_config(real):
    path, model, tokenizer, config = real
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "vocab_size": 49152, "tie_word_embeddings": True}
    assert {k: config[k] for k in expected} == expected
    # quantized weights are dequantized on the CPU and kept on a GPU (load_gguf's default)
    kept = mx.default_device().type != mx.DeviceType.cpu
    assert len(model.layers) == 30 and isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) == kept
    header = pg.read_header(path)
    assert Counter(t.type_name for t in header.tensors.values()) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_real_tokenizer(real):
    _, _, tokenizer, _ = real
    digits = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in digits] == list("12345")  # SmolLM splits digits
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    for text in H.TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_real_chat_answer(real):
    from mlx_lm import generate

    _, model, tokenizer, _ = real
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=16)


def test_real_passkey(real):
    from pose_mlx.eval.passkey import accuracy_by_length, run_passkey

    _, model, tokenizer, _ = real
    trials, _ = run_passkey(model, tokenizer, [1024, 2048], trials=4, seed=0, show_progress=False)
    accuracy = {a["length"]: a["accuracy"] for a in accuracy_by_length(trials)}
    assert accuracy[1024] >= 0.75 and accuracy[2048] >= 0.75, accuracy


def test_real_perplexity_on_english_prose(real):
    """2047 tokens of the Python tutorial: well below 100 and far below the text's own unigram perplexity."""
    from pose_mlx.eval import longctx

    if not DOCS.is_file():
        pytest.skip(f"{DOCS} not found (Debian's python3.11-doc)")
    _, model, tokenizer, _ = real
    ids = longctx.encode(tokenizer, DOCS.read_text())[:2047]
    ppl = math.exp(longctx.chunked_nll(model, [longctx.bos_id(tokenizer)] + ids).mean())
    counts = np.array(list(Counter(ids).values()), np.float64)
    unigram = math.exp(-(counts * np.log(counts / len(ids))).sum() / len(ids))
    assert ppl < 20 and ppl < unigram / 10, (ppl, unigram)


def test_real_convert_matches_load_gguf(real, tmp_path):
    """convert's float32 folder gives load_gguf's float32 logits (the session's model is float32 only on the CPU:
    a GPU keeps the file's 16-bit precision, so the float32 reference is loaded here as the CPU would)."""
    from mlx_lm import load

    path, model, tokenizer, _ = real
    if model.model.norm.weight.dtype != mx.float32:
        model, _, _ = pg.load_gguf(path, keep_quantized=False)  # float32: `float32_weights` holds for this test
    out = pg.convert(path, tmp_path / "smollm2")
    converted, converted_tokenizer = load(str(out))
    text = "The capital of France is Paris. The capital of Italy is"
    ids = mx.array(tokenizer.encode(text))[None]
    assert converted_tokenizer.encode(text) == tokenizer.encode(text)
    assert np.abs(logits(converted, ids) - logits(model, ids)).max() <= TOL
