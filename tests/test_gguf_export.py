"""GGUF out (`python -m pose_mlx.convert FOLDER OUT.gguf`, `finetune --export-gguf`): folder -> GGUF -> model gives
the folder's logits (f32 to float32 rounding; f16, bf16 and Q8_0 as gguf-py's own rounding of the weights gives
them), beyond the original window, for llama, mistral and qwen2 and every schedule llama.cpp can run; the rest are
refused in one line. The GGUF side is read by gguf-py's reader, the Q/K row order checked against the test
helpers' own permutation, the RoPE keys against `pose_mlx.rope`'s YaRN, the tokenizers against the tokenizers the
folders were made from.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten

gguf = pytest.importorskip("gguf")  # the `test` extra
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import _gguf_helpers as H  # noqa: E402
from pose_mlx import toy  # noqa: E402
from pose_mlx.convert import main as convert_main  # noqa: E402
from pose_mlx.model import gguf as pg  # noqa: E402
from pose_mlx.model.export import export_model  # noqa: E402
from pose_mlx.model.gguf.rope_keys import llamacpp_rope, rope_keys  # noqa: E402
from pose_mlx.model.gguf.write import export_gguf  # noqa: E402
from pose_mlx.model.patch import extend  # noqa: E402
from pose_mlx.model.source import load as pose_load  # noqa: E402
from pose_mlx.rope import scaled_inv_freq  # noqa: E402

ORIGINAL, TARGET = 64, 256
SEQ = list(range(3, 3 + 3 * ORIGINAL))  # 192 tokens, 3x the original window


@pytest.fixture(autouse=True)
def float32_weights(monkeypatch):
    """load_gguf reads float32 weights, as on the CPU backend (see test_gguf.py's fixture of the same name)."""
    monkeypatch.setattr("pose_mlx.model.gguf.load._default_device_is_cpu", lambda: True)


@pytest.fixture(scope="module")
def bpe():
    return H.train_bpe()


def _gguf_folder(tmp: Path, bpe, arch: str = "llama", pre: str = "gpt-2", **overrides) -> Path:
    """A folder converted from a tiny GGUF file (random weights, hidden 64, rows multiples of 32 except the FFN's
    down projection) with `bpe` behind pre-tokenizer `pre`."""
    config = H.model_config(bpe.get_vocab_size(), tied=arch == "qwen2", model_type=arch, hidden_size=64,
                            intermediate_size=80, max_position_embeddings=ORIGINAL, **overrides)
    tok = H.source_tokenizer(bpe, pre)
    H.write_gguf(tmp / "src.gguf", config, H.random_weights(config), H.bpe_metadata(tok, pre, template="{{x}}"))
    return pg.convert(tmp / "src.gguf", tmp / "folder")


def _extended(folder: Path, out: Path, schedule: str, params: dict | None = None, target: int = TARGET) -> Path:
    """`folder` extended with `schedule` and exported (pose_mlx.json records the schedule)."""
    model, _, config = pose_load(str(folder), return_config=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, schedule, int(config["max_position_embeddings"]), target, **(params or {}))
    export_model(model, config, folder, out, record={"steps": 0})
    return out


def _logits(model, ids=SEQ) -> np.ndarray:
    return np.array(model(mx.array([ids])).astype(mx.float32))


def _assert_f32_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal to float32 rounding: the two sides run other RoPE code (pose_mlx's layer, mlx-lm's), so errors of
    float32's 6e-8 grow through the layers to ~1e-6 of the largest logit."""
    assert np.max(np.abs(actual - expected)) <= 1e-5 * np.max(np.abs(expected))


def _fields(path: Path) -> dict:
    """The GGUF file's metadata as gguf-py reads it."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


# ----------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("schedule, params", [("yarn", {}), ("yarn", {"mscale": 1.7}), ("linear", {}),
                                              ("ntk", {}), ("none", {}), ("abf", {"beta": 20.0})])
def test_f32_round_trip_gives_the_folders_logits(tmp_path, bpe, arch, schedule, params):
    folder = _extended(_gguf_folder(tmp_path, bpe, arch), tmp_path / "ext", schedule, params)
    export_gguf(folder, tmp_path / "x.gguf", "f32")
    expected = _logits(pose_load(str(folder))[0])
    model, _, config = pg.load_gguf(tmp_path / "x.gguf")
    _assert_f32_close(_logits(model), expected)
    assert config["max_position_embeddings"] == TARGET


def test_f32_round_trip_of_llama3_and_a_mistral_folder(tmp_path):
    # head dim 16, base 400: two pairs with wavelengths between L/4 and L, which the reader needs to fit Llama 3
    folder = toy.make_model_folder(tmp_path / "m", model_type="mistral", hidden_size=64, num_layers=2, num_heads=4,
                                   max_position_embeddings=ORIGINAL, rope_theta=400.0, seed=3)
    for schedule in ("llama3", "yarn"):
        ext = _extended(folder, tmp_path / schedule, schedule)
        export_gguf(ext, tmp_path / f"{schedule}.gguf", "f32")
        assert _fields(tmp_path / f"{schedule}.gguf")["general.architecture"] == "llama"
        model, _, config = pg.load_gguf(tmp_path / f"{schedule}.gguf")
        _assert_f32_close(_logits(model), _logits(pose_load(str(ext))[0]))
    assert "rope_freqs.weight" in _tensors(tmp_path / "llama3.gguf")


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_folder_with_interleaved_rope_is_reordered_for_llama_cpp(tmp_path, model_type):
    """rope_traditional folders rotate pairs (2i, 2i+1): already llama.cpp's llama order (rows kept), while qwen2's
    half-split RoPE in llama.cpp needs the rows un-interleaved; both read back with the folder's logits."""
    folder = toy.make_model_folder(tmp_path / "m", model_type=model_type, hidden_size=64, num_layers=2, num_heads=4,
                                   max_position_embeddings=ORIGINAL, rope_traditional=True, seed=5)
    ext = _extended(folder, tmp_path / "ext", "yarn")
    export_gguf(ext, tmp_path / "x.gguf", "f32")
    _assert_f32_close(_logits(pg.load_gguf(tmp_path / "x.gguf")[0]), _logits(pose_load(str(ext))[0]))


def _rounded(folder: Path, outtype: str):
    """The folder's model with each matrix rounded as gguf-py rounds it for `outtype` (rows not a multiple of 32
    as F16 under q8_0), the independent reference of the f16/bf16/q8_0 files."""
    model = pose_load(str(folder))[0]
    qtype = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    rounded = []
    for name, w in tree_flatten(model.parameters()):
        a = np.array(w.astype(mx.float32))
        if a.ndim == 2:
            kind = Q.F16 if qtype == Q.Q8_0 and a.shape[1] % 32 else qtype
            a = a.astype(np.float16).astype(np.float32) if kind == Q.F16 else \
                dequantize(quantize(a, kind), kind).reshape(a.shape)
        rounded.append((name, mx.array(a)))
    model.load_weights(rounded)
    return model


@pytest.mark.parametrize("outtype, file_type", [("f16", 1), ("bf16", 32), ("q8_0", 7)])
def test_16_and_8_bit_files_hold_the_weights_as_gguf_py_rounds_them(tmp_path, bpe, outtype, file_type):
    folder = _extended(_gguf_folder(tmp_path, bpe), tmp_path / "ext", "yarn")
    export_gguf(folder, tmp_path / "x.gguf", outtype)
    fields, tensors = _fields(tmp_path / "x.gguf"), _tensors(tmp_path / "x.gguf")
    assert fields["general.file_type"] == file_type
    down = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.F16}[outtype]  # 80-wide rows: no Q8_0 blocks
    assert tensors["blk.0.ffn_down.weight"].tensor_type == down
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    if outtype == "q8_0":
        assert tensors["blk.0.attn_q.weight"].tensor_type == Q.Q8_0 and fields["general.quantization_version"] == 2
    model, _, _ = pg.load_gguf(tmp_path / "x.gguf")
    _assert_f32_close(_logits(model), _logits(_rounded(folder, outtype)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q_and_k_rows_are_in_llama_cpps_order(tmp_path, bpe, arch):
    """llama: rows of W_q/W_k interleaved per head as llama.cpp's converter writes them (the helpers' own
    permutation); qwen2 (half-split RoPE in llama.cpp too): unchanged."""
    folder = _gguf_folder(tmp_path, bpe, arch)
    export_gguf(folder, tmp_path / "x.gguf", "f32")
    weights = mx.load(str(folder / "model.safetensors"))
    tensors = _tensors(tmp_path / "x.gguf")
    for short, name, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        w = np.array(weights[f"model.layers.1.self_attn.{name}.weight"])
        expected = H.permute(w, heads) if arch == "llama" else w
        np.testing.assert_array_equal(np.array(tensors[f"blk.1.{short}.weight"].data).reshape(w.shape), expected)


def test_a_quantized_folder_and_unfused_lora_export_dense(tmp_path, bpe):
    """A folder that keeps Q8_0 blocks (convert --keep-quantized; it computes in float16) gives the float32 logits
    of the Q8_0 file it came from, and one with LoRA adapters beside the base weights (--no-fuse) the logits that
    folder computes."""
    from pose_mlx.training.lora import LoraSpec, add_lora, save_unfused

    config = H.model_config(bpe.get_vocab_size(), tied=False, hidden_size=64, intermediate_size=80,
                            max_position_embeddings=ORIGINAL)
    weights = {k: w.astype(np.float16).astype(np.float32) if w.ndim == 1 else w  # the folder keeps norms in f16
               for k, w in H.random_weights(config).items()}
    H.write_gguf(tmp_path / "q.gguf", config, weights, H.bpe_metadata(bpe, "gpt-2"),
                 types=lambda name: Q.Q8_0 if not name.endswith("ffn_down.weight") else Q.F16)
    quantized = pg.convert(tmp_path / "q.gguf", tmp_path / "quantized", keep_quantized=True)
    export_gguf(quantized, tmp_path / "q8.gguf", "f32")
    model = pg.load_gguf(tmp_path / "q8.gguf")[0]
    _assert_f32_close(_logits(model), _logits(pg.load_gguf(tmp_path / "q.gguf")[0]))

    base = _gguf_folder(tmp_path, bpe)
    model, _, config = pose_load(str(base), return_config=True)
    spec = LoraSpec(rank=4, scale=20.0, num_layers=-1)
    add_lora(model, spec, seed=0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.01
    extend(model, "linear", ORIGINAL, TARGET)
    export_model(model, config, base, tmp_path / "lora", save_weights=lambda m, f: save_unfused(m, f, spec))
    export_gguf(tmp_path / "lora", tmp_path / "lora.gguf", "f32")
    expected = _logits(pose_load(str(tmp_path / "lora"))[0])
    _assert_f32_close(_logits(pg.load_gguf(tmp_path / "lora.gguf")[0]), expected)


# --------------------------------------------------------------------------------------------- RoPE keys


def test_yarn_keys_are_what_llama_cpp_reads(tmp_path, bpe):
    folder = _extended(_gguf_folder(tmp_path, bpe), tmp_path / "ext", "yarn", {"mscale": 1.7})
    export_gguf(folder, tmp_path / "x.gguf", "f32")
    fields = _fields(tmp_path / "x.gguf")
    s = TARGET / ORIGINAL
    assert fields["llama.context_length"] == TARGET and fields["llama.rope.scaling.type"] == "yarn"
    assert fields["llama.rope.scaling.factor"] == s and fields["llama.rope.scaling.original_context_length"] == 64
    # llama.cpp scales q and k by attn_factor * (1 + 0.1 ln s); YaRN with mscale m by 0.1 m ln s + 1
    assert math.isclose(fields["llama.rope.scaling.attn_factor"] * (1 + 0.1 * math.log(s)),
                        0.1 * 1.7 * math.log(s) + 1, rel_tol=1e-6)
    folder = _extended(folder.parent / "folder", tmp_path / "plain", "yarn")
    export_gguf(folder, tmp_path / "plain.gguf", "f32")
    assert "llama.rope.scaling.attn_factor" not in _fields(tmp_path / "plain.gguf")


@pytest.mark.parametrize("base, dims, factor, original", [(10000.0, 128, 4.0, 4096), (100000.0, 64, 4.0, 8192),
                                                          (500.0, 8, 8.0, 32), (1e6, 128, 16.0, 32768)])
def test_llama_cpps_yarn_is_pose_mlx_yarn(base, dims, factor, original):
    """What llama.cpp computes from the keys (ggml's blend of angles, its attention factor) equals
    `pose_mlx.rope`'s YaRN (the Hugging Face form) for the same schedule."""
    inv_freq, attention = scaled_inv_freq("yarn", dims, base, factor, original)
    keys, _ = rope_keys("yarn", {}, factor, original, attention)
    metadata = {"llama.rope.freq_base": base, "llama.context_length": int(original * factor),
                **{f"llama.{k}": v for k, v in keys.items()}}
    theta, scale = llamacpp_rope(metadata, "llama", dims)
    np.testing.assert_allclose(theta, inv_freq, rtol=1e-12)
    assert math.isclose(scale, attention, rel_tol=1e-12)


# ----------------------------------------------------------------------------------------------- refusals


REFUSED = {  # name: (schedule, parameters, what the one line says)
    "dynamic NTK": ("dynamic", {}, "changes with the length of the sequence read"),
    "DPRoPE": ("dprope", {}, "per-dimension factors"),
    "LongRoPE": ("longrope", {}, "Phi-3's"),
    "YaRN wavelength blend": ("yarn", {"blend": "wavelength"}, "blends inverse frequencies"),
    "YaRN betas": ("yarn", {"beta_fast": 16.0}, "always use 32 and 1"),
    "YaRN untruncated": ("yarn", {"truncate": False}, "rounds YaRN's correction range"),
}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory, bpe):
    return _gguf_folder(tmp_path_factory.mktemp("base"), bpe)


def _refused(capsys, argv, out: Path) -> str:
    assert convert_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("pose_mlx.convert: error: "), err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]
    return err[0]


@pytest.mark.parametrize("name", list(REFUSED))
def test_schedules_llama_cpp_cannot_run_are_refused_in_one_line(tmp_path, base_folder, capsys, name):
    schedule, params, reason = REFUSED[name]
    folder = _extended(base_folder, tmp_path / "ext", schedule, params)
    (tmp_path / "out").mkdir()
    assert reason in _refused(capsys, [folder, tmp_path / "out" / "x.gguf"], tmp_path / "out" / "x.gguf")


def test_llama3_on_qwen2_is_refused(tmp_path, bpe, capsys):
    folder = _extended(_gguf_folder(tmp_path, bpe, "qwen2"), tmp_path / "ext", "llama3")
    message = _refused(capsys, [folder, tmp_path / "x.gguf"], tmp_path / "x.gguf")
    assert "only to the llama architecture" in message


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, base_folder, capsys):
    out = tmp_path / "x.gguf"
    assert "no such file or folder" in _refused(capsys, [tmp_path / "missing", out], out)
    assert "--keep-quantized is for reading" in _refused(capsys, [base_folder, out, "--keep-quantized"], out)
    assert "invalid choice" in _refused(capsys, [base_folder, out, "--outtype", "q4_k"], out)
    (tmp_path / "notes").mkdir()
    assert "not a model folder" in _refused(capsys, [tmp_path / "notes", out], out)
    gemma = toy.make_model_folder(tmp_path / "gemma", model_type="gemma", hidden_size=32, num_heads=4, seed=0,
                                  extra_config={"head_dim": 8, "num_key_value_heads": 1})
    assert "this model is 'gemma'" in _refused(capsys, [gemma, out], out)
    out.write_bytes(b"GGUF old")
    assert convert_main([str(base_folder), str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err and out.read_bytes() == b"GGUF old"
    assert convert_main([str(base_folder), str(out), "--overwrite", "--outtype", "f32"]) == 0
    assert _fields(out)["general.file_type"] == 0


def test_f16_overflow_is_refused(tmp_path, base_folder, capsys):
    weights = dict(mx.load(str(base_folder / "model.safetensors")))
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name] * 0 + 1e5
    folder = tmp_path / "big"
    folder.mkdir()
    for f in base_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    message = _refused(capsys, [folder, tmp_path / "x.gguf"], tmp_path / "x.gguf")
    assert name in message and "--outtype bf16" in message


def test_interrupted_write_leaves_nothing(tmp_path, base_folder, monkeypatch):
    from pose_mlx.model.gguf import write

    calls = []
    real = write._encode

    def stop(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(write, "_encode", stop)
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        export_gguf(base_folder, tmp_path / "out" / "x.gguf", "f32")
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
@pytest.mark.parametrize("form", ["reader", "model's own"])
def test_bpe_tokenizer_json_becomes_a_gguf_tokenizer_that_encodes_alike(tmp_path, bpe, pre, form):
    """The folder's tokenizer.json, as the reader writes it or in the model's own form (e.g. SmolLM's Digits +
    ByteLevel), gives GGUF keys whose tokenizer encodes as the source tokenizer (llama.cpp's pre-tokenizer found
    by its splitting)."""
    source = H.source_tokenizer(bpe, pre)
    folder = _gguf_folder(tmp_path, bpe, pre=pre)
    if form == "model's own":
        source.save(str(folder / "tokenizer.json"))
    export_gguf(folder, tmp_path / "x.gguf", "f32")
    ours = pg.build_tokenizer(tmp_path / "x.gguf")
    for text in H.TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == source.encode(text).ids, (pre, text)
    fields = _fields(tmp_path / "x.gguf")
    assert fields["tokenizer.chat_template"] == "{{x}}" and fields["tokenizer.ggml.model"] == "gpt2"


@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_sentencepiece_tokenizer_json_becomes_a_gguf_tokenizer_that_encodes_alike(tmp_path, dummy_prefix):
    sp = H.train_spm(tmp_path, dummy_prefix)
    config = H.model_config(sp.get_piece_size(), tied=True, max_position_embeddings=ORIGINAL)
    H.write_gguf(tmp_path / "spm.gguf", config, H.random_weights(config), H.spm_metadata(sp, dummy_prefix))
    folder = pg.convert(tmp_path / "spm.gguf", tmp_path / "folder")
    export_gguf(folder, tmp_path / "x.gguf", "f32")
    fields = _fields(tmp_path / "x.gguf")
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] == dummy_prefix
    ours = pg.build_tokenizer(tmp_path / "x.gguf")
    for text in H.TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == sp.encode(text), text


def test_the_source_gguf_tokenizer_is_copied_when_the_folder_names_it(tmp_path):
    """A folder that finetune exported from a GGUF file (pose_mlx.json's source_model) gets that file's
    tokenizer keys as they are: scores included."""
    sp = H.train_spm(tmp_path, True)
    config = H.model_config(sp.get_piece_size(), tied=True, max_position_embeddings=ORIGINAL)
    meta = H.spm_metadata(sp, True)
    H.write_gguf(tmp_path / "spm.gguf", config, H.random_weights(config), meta)
    folder = pg.convert(tmp_path / "spm.gguf", tmp_path / "folder")
    ext = _extended(folder, tmp_path / "ext", "yarn")
    record = json.loads((ext / "pose_mlx.json").read_text())
    (ext / "pose_mlx.json").write_text(json.dumps({**record, "source_model": str(tmp_path / "spm.gguf")}))
    info = export_gguf(ext, tmp_path / "x.gguf", "f32")
    assert info["tokenizer"] == str(tmp_path / "spm.gguf")
    fields = _fields(tmp_path / "x.gguf")
    for key, (value, _) in meta.items():
        got = fields[key]
        assert (np.allclose(got, value) if key.endswith("scores") else got == value), key


def test_a_wordpiece_tokenizer_is_refused(tmp_path, base_folder, capsys):
    from tokenizers import Tokenizer, models

    folder = tmp_path / "wp"
    folder.mkdir()
    for f in base_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    message = _refused(capsys, [folder, tmp_path / "x.gguf"], tmp_path / "x.gguf")
    assert "WordPiece tokenizer" in message


# ---------------------------------------------------------------------------------------- finetune, real model


def test_finetune_export_gguf_writes_beside_the_folder(tmp_path, bpe, capsys):
    from pose_mlx.finetune import main

    _gguf_folder(tmp_path, bpe)
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {tmp_path / 'src.gguf'}\ntarget: 4x\nsampler: none\nexport_gguf: f32\n"
                      f"output: {out}\nno-progress: true\n")
    assert main(["--config", str(config)]) == 0, capsys.readouterr().err
    path = tmp_path / "run.gguf"
    fields = _fields(path)
    assert fields["llama.context_length"] == 4 * ORIGINAL and fields["tokenizer.ggml.pre"] == "gpt-2"
    _assert_f32_close(_logits(pg.load_gguf(path)[0]), _logits(pose_load(str(out))[0]))
    argv = ["--model", str(tmp_path / "src.gguf"), "--target", "4x", "--sampler", "none", "--output",
            str(tmp_path / "dyn"), "--schedule", "dynamic", "--export-gguf"]
    assert main(argv) == 2 and "--schedule dynamic (dynamic NTK) cannot be written" in capsys.readouterr().err
    assert not (tmp_path / "dyn").exists() and not (tmp_path / "dyn.gguf").exists()
    argv = ["--model", str(tmp_path / "src.gguf"), "--target", "4x", "--sampler", "none", "--output", str(out),
            "--export-gguf", "--overwrite"]
    path.write_text("not a model")
    assert main(argv) == 2 and "is not a GGUF file; it is left alone" in capsys.readouterr().err


def test_real_smollm2_yarn_32k_round_trip(smollm2, tmp_path):
    """SmolLM2-135M-Instruct extended 8k -> 32k with YaRN: the GGUF file gives the folder's logits, and carries
    the source file's tokenizer."""
    path = smollm2[0]
    folder = pg.convert(path, tmp_path / "folder")
    ext = _extended(folder, tmp_path / "ext", "yarn", target=32768)
    info = export_gguf(ext, tmp_path / "x.gguf", "f32", source_gguf=path)
    assert info["rope"]["llama.rope.scaling.factor"] == 4.0
    ids = list(smollm2[2].encode("The capital of France is Paris. " * 8))
    model = pg.load_gguf(tmp_path / "x.gguf")[0]
    _assert_f32_close(_logits(model, ids), _logits(pose_load(str(ext))[0], ids))
    assert _fields(tmp_path / "x.gguf")["tokenizer.ggml.pre"] == "smollm"
