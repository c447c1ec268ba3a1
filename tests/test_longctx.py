"""Chunked prefill, memory estimates, length parsing and model loading of pose_mlx.eval.longctx."""

import numpy as np
import pytest

from pose_mlx.eval import longctx
from pose_mlx.errors import UserError
from pose_mlx.lengths import default_lengths, parse_lengths

import mlx.core as mx

from conftest import build_model
from _eval_helpers import make_eval_folder


def test_parse_lengths_accepts_k_and_x_suffixes_and_sorts():
    assert parse_lengths("2k,4k,8192") == [2048, 4096, 8192]
    assert parse_lengths(" 512 , 1K,512") == [512, 1024]
    assert parse_lengths("1x,2x,8x", original=100) == [100, 200, 800]


@pytest.mark.parametrize("bad", ["", "2k,,4k", "abc", "2.3k", "-4", "1", "4m", "8x"])
def test_parse_lengths_rejects_malformed(bad):
    with pytest.raises(UserError, match="--lengths"):
        parse_lengths(bad)  # no original window known: "8x" cannot be resolved


def test_default_lengths_double_from_half_the_original_window():
    assert default_lengths(128, 1024) == [64, 128, 256, 512, 1024]
    assert default_lengths(100, 300) == [50, 100, 200, 300]


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])
def test_chunked_prefill_matches_full_forward(family, chunk):
    model = build_model(family)
    tokens = np.random.default_rng(1).integers(0, 97, size=50).astype(np.int32)
    full = np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))
    chunked = longctx.chunked_logits(model, tokens, chunk)
    assert chunked.shape == full.shape
    assert np.abs(chunked - full).max() <= 1e-4


def test_chunked_nll_is_log_softmax_of_the_full_forward():
    model = build_model("llama")
    tokens = np.random.default_rng(2).integers(0, 97, size=40).astype(np.int32)
    logp = _log_softmax(np.array(model(mx.array(tokens)[None])[0], dtype=np.float64))
    expected = -logp[np.arange(39), tokens[1:]]
    got = longctx.chunked_nll(model, tokens, chunk=9)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_prefill_allocates_an_empty_cache_once_and_restores_its_step():
    """Into an empty cache the prefill reserves the whole prompt at the first chunk (no copy per 256-token
    growth), then gives mlx-lm's step back so generation grows the cache as usual; a filled cache is left
    to grow by steps."""
    from mlx_lm.models.cache import make_prompt_cache

    model = build_model("llama")
    tokens = np.random.default_rng(3).integers(0, 97, size=600).astype(np.int32)
    cache = make_prompt_cache(model)
    step = cache[0].step
    longctx.prefill(model, tokens, cache, chunk=64)
    assert all(c.keys.shape[2] == 768 and c.offset == 600 and c.step == step for c in cache)  # 600 -> 3 x 256
    # mlx-lm grows a cache from its offset by whole steps: 600 + 256 for 200 more tokens, 800 + 2 x 256 for 300
    model(mx.array([[5] * 200]), cache=cache)
    assert all(c.keys.shape[2] == 856 for c in cache)
    longctx.prefill(model, tokens[:300], cache, chunk=64)  # not empty: grows by steps as before
    assert all(c.keys.shape[2] == 1312 and c.step == step for c in cache)
    cache = make_prompt_cache(model)  # room for an answer: 600 + 200 -> 4 x 256, not grown by the answer
    longctx.prefill(model, tokens, cache, chunk=64, room=200)
    model(mx.array([[5] * 200]), cache=cache)
    assert all(c.keys.shape[2] == 1024 and c.offset == 800 for c in cache)

def test_check_memory_refuses_or_warns_above_what_the_machine_offers(tmp_path, monkeypatch, capsys):
    """The planner's evaluation prediction against the available memory: refused in one line, or a warning with
    --force."""
    import pose_mlx.memory as memory

    info = longctx.load_eval_model(str(make_eval_folder(tmp_path / "m", max_position_embeddings=64)))
    monkeypatch.setattr(memory.device, "available_memory", lambda: (10_000, "test"))
    with pytest.raises(UserError, match=r"more than the 9.77 KiB this machine offers \(test\)"):
        longctx.check_memory(info, [64, 4096], chunk=64)
    described, peak = longctx.check_memory(info, [4096], chunk=64, force=True)
    assert "warning" in capsys.readouterr().err and "at 4096 tokens" in described
    # MLX's peak and, on the CPU path, NumPy's score tiles; the folder's weights are float32 (its config names no
    # dtype: the memory check reads the safetensors headers)
    estimate = memory.eval_memory({**info.config, "torch_dtype": "float32"}, 4096, 64)
    assert described.startswith(memory.format_size(estimate.peak + estimate.details["numpy_bytes"]) + " at 4096")
    assert peak == estimate.peak


def test_cache_held_to_bounds_mlx_cache_for_the_block_and_restores_it():
    """Inside the block MLX's buffer cache may hold at most the limit (by default it may grow to the device's
    memory limit, which starves other processes on a shared GPU); the previous limit comes back on exit, also
    after an exception."""
    default = mx.set_cache_limit(0)
    mx.set_cache_limit(default)
    with longctx.cache_held_to(12345):
        assert mx.set_cache_limit(12345) == 12345
    assert mx.set_cache_limit(default) == default
    with pytest.raises(RuntimeError), longctx.cache_held_to(777):
        raise RuntimeError("stop")
    assert mx.set_cache_limit(default) == default


def test_load_eval_model_reads_windows_from_config(tmp_path):
    folder = make_eval_folder(tmp_path / "m", max_position_embeddings=96,
                              rope_scaling={"type": "linear", "factor": 2.0, "original_max_position_embeddings": 48})
    info = longctx.load_eval_model(str(folder))
    assert (info.original, info.maximum) == (48, 96)


def test_folder_without_tokenizer_is_a_clear_error(tmp_path):
    folder = make_eval_folder(tmp_path / "m", tokenizer=False)
    with pytest.raises(UserError, match="no tokenizer files"):
        longctx.load_eval_model(str(folder))


def test_schedule_extends_a_raw_model_with_position_interpolation(tmp_path):
    folder = make_eval_folder(tmp_path / "m", max_position_embeddings=64)
    info = longctx.load_eval_model(str(folder), schedule="linear", target="4x")
    assert (info.original, info.maximum) == (64, 256)
    ext = info.model.pose_extension
    assert ext.schedule == "linear" and ext.factor == pytest.approx(4.0)


def test_folder_with_saved_schedule_is_evaluated_with_it(tmp_path):
    from pose_mlx.model.patch import save_extension

    folder = make_eval_folder(tmp_path / "m", max_position_embeddings=64)
    info = longctx.load_eval_model(str(folder), schedule="linear", target="256")  # reference: extended in memory
    save_extension(info.model, folder)
    saved = longctx.load_eval_model(str(folder))
    assert (saved.original, saved.maximum) == (64, 256) and "pose_mlx.json" in saved.schedule
    tokens = np.arange(1, 200, dtype=np.int32) % 150
    np.testing.assert_allclose(longctx.chunked_logits(saved.model, tokens, 64),
                               longctx.chunked_logits(info.model, tokens, 64), atol=1e-5)
    with pytest.raises(UserError, match="already extended"):
        longctx.load_eval_model(str(folder), schedule="linear", target="512")


def test_both_commands_run_on_a_folder_exported_by_finetune(tmp_path, capsys, monkeypatch):
    from pose_mlx import finetune
    from pose_mlx.eval import passkey, perplexity

    base = make_eval_folder(tmp_path / "base", max_position_embeddings=128)
    out = tmp_path / "extended"
    assert finetune.main(["--model", str(base), "--target", "4x", "--sampler", "none", "--output", str(out),
                          "--no-progress"]) == 0
    info = longctx.load_eval_model(str(out))
    assert (info.original, info.maximum) == (128, 512)
    monkeypatch.chdir(tmp_path)  # without --output the JSON goes into the model folder's eval/, not here
    data = tmp_path / "doc.txt"
    data.write_text(" ".join(f"The sky is blue {i}." for i in range(400)))
    assert perplexity.main(["--model", str(out), "--data", str(data), "--lengths", "128,512", "--stride", "64",
                            "--no-progress"]) == 0
    assert passkey.main(["--model", str(out), "--trials", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "| 128 |" in captured.out and "| 512 |" in captured.out  # default passkey lengths: 64 is below the template
    results = out / "eval"
    assert sorted(p.name for p in results.glob("*.json")) == ["passkey-128_256_512-1trials.json",
                                                              "perplexity-128_512-doc.json"]
    assert f"writing {results / 'passkey-128_256_512-1trials.json'}" in captured.err
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("*.png"))


def test_target_shorter_than_the_window_names_the_flag(tmp_path):
    folder = make_eval_folder(tmp_path / "m", max_position_embeddings=64)
    with pytest.raises(UserError, match="--target: 32 is shorter than the original window 64"):
        longctx.load_eval_model(str(folder), schedule="linear", target="32")


def test_loading_silences_transformers_warnings_logged_after_import(monkeypatch, capfd, tmp_path):
    """transformers is imported (by mlx_lm) before a model loads, so the env variable alone would come too late."""
    import transformers

    from pose_mlx.model.source import quiet_transformers

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    before = transformers.logging.get_verbosity()
    logger = transformers.logging.get_logger("transformers.modeling_rope_utils")
    try:
        transformers.logging.set_verbosity_warning()
        quiet_transformers()
        logger.warning("Unrecognized keys in `rope_parameters`")
        assert "Unrecognized keys" not in capfd.readouterr().err
    finally:
        transformers.logging.set_verbosity(before)


@pytest.mark.parametrize("chunk", [7, 32, 100])
def test_dynamic_ntk_perplexity_does_not_depend_on_the_chunk(tmp_path, chunk):
    """Dynamic NTK sets its base from the whole window's length, as one forward pass does: chunked prefill gives
    the full forward's NLLs whatever the chunk size (it changed them when the base followed each chunk's end)."""
    from pose_mlx.model.patch import extend

    model = build_model("llama")
    extend(model, "dynamic", 32, 256)
    tokens = np.random.default_rng(3).integers(0, 97, size=200).astype(np.int32)
    logp = _log_softmax(np.array(model(mx.array(tokens)[None])[0], dtype=np.float64))
    expected = -logp[np.arange(199), tokens[1:]]
    np.testing.assert_allclose(longctx.chunked_nll(model, tokens, chunk=chunk), expected, atol=1e-4)


@pytest.mark.parametrize("path, schedule, label", [
    ("/m/pretrained", "as configured", "pretrained"),
    ("/m/pretrained", "yarn x8 (--schedule, no training)", "pretrained + yarn x8, no training"),
    ("/m/pretrained", "none x8 (--schedule, no training)", "pretrained"),  # positions unchanged, only allowed further
    ("/m/pose", "yarn x8 (from pose_mlx.json)", "pose (yarn x8)"),
    ("/m/SmolLM2.Q4_1.gguf", "as configured", "SmolLM2.Q4_1"),
])
def test_label_says_what_was_done_to_the_model(path, schedule, label):
    info = longctx.EvalModel(None, None, path, 128, 1024, schedule, {})
    assert info.label == label
