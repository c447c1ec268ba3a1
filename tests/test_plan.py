"""`python -m pose_mlx.plan`: reads only config.json, takes finetune's flags, prints a table or one JSON object;
bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _finetune_helpers import text_dir, tiny_model  # noqa: F401
from pose_mlx import memory
from pose_mlx import plan as planner
from pose_mlx.errors import UserError
from pose_mlx.training.data import ExampleStream, row_multiple, tokenize_corpus

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1376, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
              torch_dtype="bfloat16")


@pytest.fixture
def folder(tmp_path):
    """A model folder with a config.json and nothing else: the planner must not need weights."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def run_cli(*argv, env=None):
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_json_schema(folder, capsys):
    assert planner.main(["--model", str(folder), "--target", "16k", "--batch-size", "2", "--json",
                         "--max-memory", "3GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["peak_bytes"], int) and out["peak_bytes"] > 0
    assert out["available_bytes"] == 3 * 2**30 and out["available_source"] == "--max-memory"
    assert out["fits"] is (out["peak_bytes"] <= out["available_bytes"])
    assert set(out["breakdown"]) >= {"weights", "optimizer_state", "activations", "attention_scores", "logits"}
    assert all(isinstance(v, int) and v >= 0 for v in out["breakdown"].values())
    assert sum(out["breakdown"].values()) == out["peak_bytes"]
    assert out["phase"] in ("head", "backward", "update")
    assert isinstance(out["largest_batch"], int) and isinstance(out["largest_window"], int)
    assert all({"change", "peak_bytes", "fits"} <= set(s) for s in out["suggestions"])
    assert out["settings"]["window"] == 2048 and out["settings"]["target"] == 16384  # window: the original
    # the same numbers as the library gives for these settings, on the backend MLX computes on here
    backend = memory.compute_backend()
    assert out["backend"] == backend and out["settings"]["backend"] == backend
    assert out["row_tokens"] == out["details"]["tokens_per_row"] and out["attention"] == out["details"]["attention"]
    expected = memory.training_memory(CONFIG, memory.TrainSettings(window=2048, target=16384, batch_size=2,
                                                                   backend=backend,
                                                                   row_multiple=row_multiple("auto", backend)))
    assert out["peak_bytes"] == expected.peak and out["breakdown"] == expected.breakdown


def test_flags_map_onto_settings(folder, capsys):
    _s, _ref, config, settings = planner.planned_run(
        ["--model", str(folder), "--target", "4x", "--window", "1024", "--full", "--grad-checkpoint", "--no-compile",
         "--batch-size", "4", "--grad-accum", "2", "--lora-layers", "3", "--sampler", "full", "--data", "somewhere",
         "--frobnicate", "7"])
    assert config == CONFIG
    assert "ignoring flags the planner does not use: --frobnicate 7" in capsys.readouterr().err
    backend = memory.compute_backend()
    assert settings == memory.TrainSettings(window=1024, batch_size=4, lora=False, lora_layers=3,
                                            grad_checkpoint=True, compile=False, grad_accum=2, sampler="full",
                                            target=8192, backend=backend,
                                            row_multiple=row_multiple("auto", backend))
    if backend == "cpu":
        assert settings.row_tokens == 8191  # full-length sampling trains on target-token rows


def test_table(folder):
    code, out, err = run_cli("--model", str(folder), "--target", "8x", "--window", "4096", "--max-memory", "2G",
                             "--kernels", "mlx", "--data", "ignored", "--some-unknown-flag")
    assert code == 0, err
    assert "--some-unknown-flag" in err
    for text in ("weights", "attention scores", "peak", "available: 2 GiB (--max-memory)", "verdict: does NOT fit",
                 "largest batch that fits", "gradient checkpointing"):
        assert text in out, text


def _read(ref):
    from pose_mlx.model import source

    return source.read_config(source.resolve(str(ref), weights=False))


def test_read_model_config(folder, monkeypatch, tmp_path):
    assert _read(folder) == CONFIG
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        _read(broken)
    with pytest.raises(UserError, match="no config.json"):
        _read(_empty(tmp_path / "empty"))
    seen = {}

    def download(repo_id, filename, **kwargs):  # only config.json is asked for
        seen["args"] = (repo_id, filename)
        return str(folder / "config.json")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert _read("someone/some-model") == CONFIG
    assert seen["args"] == ("someone/some-model", "config.json")
    seen.clear()
    assert _read("llama-2-13b")["hidden_size"] == 5120 and not seen  # an alias's config ships with the package


def _empty(folder: Path) -> Path:
    folder.mkdir()
    return folder


@pytest.mark.parametrize("argv, needle", [
    (["--target", "8x"], "--model is required"),
    (["--model", "no-such-model-anywhere", "--target", "8x"], "not a known alias"),
    (["--model", "{folder}", "--batch-size", "0"], "--batch-size must be between 1"),
    (["--model", "{folder}", "--max-memory", "12QB"], "is not a size"),
    (["--model", "{folder}", "--target", "4x", "--sampler", "none"], "trains nothing"),
    (["--model", "{folder}", "--sampler", "full"], "--target is required with --sampler full"),
    (["--model", "{folder}", "--target", "banana"], "is not a length"),
    (["--model", "{folder}", "--lora-layers", "99"], "between 1 and the model's 8 blocks"),
    (["--model", "{folder}", "--batch-size", "two"], "invalid int value"),
    (["--model", "{incomplete}"], "lacks intermediate_size, vocab_size"),
    (["--model", "{folder}", "--align-rows", "maybe"], "invalid choice: 'maybe'"),
])
def test_bad_input_is_one_line_exit_2(folder, argv, needle):
    incomplete = folder / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items()
                                                        if k not in ("vocab_size", "intermediate_size")}))
    argv = [a.format(folder=folder, incomplete=incomplete) for a in argv]
    code, out, err = run_cli(*argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pose_mlx.plan: error: ") and needle in lines[0], err


UNREACHABLE = [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}]  # offline; a closed loopback port


@pytest.mark.parametrize("env", UNREACHABLE, ids=["HF_HUB_OFFLINE", "closed-endpoint"])
def test_hub_id_unreachable_is_one_line(tmp_path, env):
    """No retries printed: the hub is probed once and only the (empty) local cache is looked at."""
    code, out, err = run_cli("--model", "meta-llama/Llama-2-7b-hf", "--target", "8x",
                             env={**env, "HF_HOME": str(tmp_path)})
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "meta-llama/Llama-2-7b-hf" in lines[0] and "cannot reach the Hugging Face hub" in \
        lines[0], err


@pytest.mark.parametrize("env", UNREACHABLE, ids=["HF_HUB_OFFLINE", "closed-endpoint"])
def test_alias_plans_offline(tmp_path, env):
    """The docs' Llama-2-7B row (PoSE, 4k window, fp16, LoRA, no checkpointing: bench_plan's table, from its own
    copy of the config) with the hub out of reach, from the shipped config.json."""
    from benchmarks.bench_plan import llama2_table

    row = next(r for r in llama2_table("cpu") if (r["model"], r["sampler"], r["base"], r["training"],
                                                  r["grad_checkpoint"]) ==
               ("Llama-2-7B", "PoSE (4k window)", "fp16", "LoRA", False))
    code, out, err = run_cli("--model", "llama-2-7b", "--target", "32k", "--json",
                             env={**env, "HF_HOME": str(tmp_path)})
    assert code == 0, err
    record = json.loads(out)
    assert record["peak_bytes"] == row["peak_bytes"] and record["settings"]["window"] == 4096
    assert err == ""  # the shipped config names its dtype: no warning


def test_every_alias_ships_its_config():
    """Each alias's shipped config.json: the family of its hub id, a window equal to the alias's, the shapes that
    the benchmark's Llama-2 table used, and a plan at 2x its window."""
    from benchmarks.bench_plan import LLAMA2
    from pose_mlx.model import source

    families = {"llama": "llama", "mistral": "mistral", "qwen2.5": "qwen2", "tinyllama": "llama"}
    for alias, (repo, window) in source.ALIASES.items():
        ref = source.resolve(alias, weights=False)
        config = source.read_config(ref)
        assert ref.name == repo and not ref.is_gguf and config["model_type"] == families[alias.split("-")[0]]
        assert source.original_window(config) == window or alias in ("mistral-7b", "qwen2.5-0.5b"), alias
        arch = memory.architecture(config)
        assert not arch.warnings, (alias, arch.warnings)
        _s, _ref, _config, settings = planner.planned_run(["--model", alias, "--target", "2x"])
        assert settings.window == window and settings.target == 2 * window
    for alias, name in (("llama-2-7b", "Llama-2-7B"), ("llama-2-13b", "Llama-2-13B")):
        config = source.read_config(source.resolve(alias, weights=False))
        assert {k: config[k] for k in LLAMA2[name]} == LLAMA2[name]


def test_gguf_dtype_from_its_tensors_and_no_quantizing_advice(tmp_path, capsys):
    """A Q4_1 file: the weights' dtype comes from the file (no 'names no torch_dtype' warning) and quantizing it
    is not suggested; the same shapes as an unquantized folder do get that suggestion."""
    from gguf import GGMLQuantizationType as Q

    import _gguf_helpers as H

    tok = H.train_bpe()
    config = H.model_config(tok.get_vocab_size(), tied=False, max_position_embeddings=64)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config), H.bpe_metadata(tok, "gpt-2"),
                 types=lambda name: Q.Q4_1)
    flags = ["--target", "4x", "--max-memory", "1MB", "--json"]
    assert planner.main(["--model", str(tmp_path / "m.gguf"), *flags]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["warnings"] == [] and "torch_dtype" not in captured.err
    # as loaded here: dequantized to float32 on the CPU; F32 norms + Q4_1 matrices (float16 scales) on a GPU
    assert record["architecture"]["dtype"] == ("float32" if memory.compute_backend() == "cpu" else "float16")
    assert record["suggestions"] and not any("4-bit" in s["change"] for s in record["suggestions"])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    assert planner.main(["--model", str(tmp_path / "folder"), *flags]) == 0
    record = json.loads(capsys.readouterr().out)
    assert any("4-bit" in s["change"] for s in record["suggestions"])
    from pose_mlx.model.gguf import config_from_gguf

    assert config_from_gguf(tmp_path / "m.gguf")["gguf_quantization"] == "Q4_1"
    H.write_gguf(tmp_path / "f32.gguf", config, H.random_weights(config), H.bpe_metadata(tok, "gpt-2"))
    f32 = config_from_gguf(tmp_path / "f32.gguf")
    assert f32["torch_dtype"] == "float32" and "gguf_quantization" not in f32


def test_exported_folder_is_planned_and_evaluated_in_its_stored_dtype(tmp_path, capsys):
    """A model exported from a Q4_1 file (a real `finetune` export) records the dtype of the weights it wrote in
    config.json (float32 on the CPU, where the file is dequantized), not the file's precision or block types; and
    when a folder's config names no dtype, the planner and the evaluators' memory check read it from the
    safetensors headers instead of assuming 16 bits."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType as Q

    import _gguf_helpers as H
    from pose_mlx import finetune
    from pose_mlx.eval import longctx

    tok = H.train_bpe()
    config = H.model_config(tok.get_vocab_size(), tied=False, max_position_embeddings=64)
    H.write_gguf(tmp_path / "m.gguf", config, H.random_weights(config), H.bpe_metadata(tok, "gpt-2"),
                 types=lambda name: Q.Q4_1)
    out = tmp_path / "out"
    assert finetune.main(["--model", str(tmp_path / "m.gguf"), "--target", "2x", "--sampler", "none", "--output",
                          str(out)]) == 0
    weights = mx.load(str(out / "model.safetensors"))  # the independent side: what MLX reads back
    values = {}
    for array in weights.values():
        name = str(array.dtype).rsplit(".", 1)[-1]
        values[name] = values.get(name, 0) + array.size
    stored = max(values, key=values.get)
    weights_bytes = sum(a.nbytes for a in weights.values())
    assert stored == ("float32" if memory.compute_backend() == "cpu" else "float16")
    exported = json.loads((out / "config.json").read_text())
    assert exported["torch_dtype"] == stored and "gguf_quantization" not in exported
    exported.pop("torch_dtype")
    (out / "config.json").write_text(json.dumps(exported))  # as folders exported before were
    capsys.readouterr()
    assert planner.main(["--model", str(out), "--target", "2x", "--json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["architecture"]["dtype"] == stored and "torch_dtype" not in captured.err
    assert record["breakdown"]["weights"] == weights_bytes
    info = longctx.load_eval_model(str(out))
    _, peak = longctx.check_memory(info, [64], 32)
    assumed = memory.eval_memory(info.config, 64, 32).peak  # the config alone: 16-bit, with a warning
    assert peak - assumed >= weights_bytes // 2 if stored == "float32" else peak == assumed


# ------------------------------------------------------------------------------------- rows for fused attention


def test_align_rows_auto_is_on_only_with_cuda():
    assert [row_multiple("auto", b) for b in ("cpu", "metal", "cuda")] == [1, 1, 128]
    assert [row_multiple("on", b) for b in ("cpu", "metal", "cuda")] == [128, 128, 128]
    assert [row_multiple("off", b) for b in ("cpu", "metal", "cuda")] == [1, 1, 1]
    with pytest.raises(ValueError, match="^align_rows must be auto, on or off, got 'yes'$"):
        row_multiple("yes", "cpu")


def test_the_plan_predicts_the_rows_trained(folder):
    base = ["--model", str(folder), "--target", "16k", "--window", "1000"]
    *_, default = planner.planned_run(base)
    if memory.compute_backend() == "cpu":  # the CPU's default is unchanged: window - 1 inputs, no padding
        assert default.row_multiple == 1 and default.row_tokens == 999
    *_, on = planner.planned_run(base + ["--align-rows", "on"])
    *_, off = planner.planned_run(base + ["--align-rows", "off"])
    assert (on.row_tokens, off.row_tokens) == (1024, 999)
    peaks = [memory.training_memory(CONFIG, s).peak for s in (off, on)]
    assert peaks[0] < peaks[1]  # 25 padding positions per row cost memory like real tokens


class _Bytes:
    """Token ids = UTF-8 bytes (no special tokens)."""

    bos_token_id = eos_token_id = None

    def encode(self, text):
        return list(text.encode())

    def get_vocab(self):
        return {f"<{i}>": i for i in range(256)}


def test_aligned_rows_hold_the_same_examples_padded(tmp_path):
    """Forced on (as on CUDA): the same draws, each row padded with masked tokens to a multiple of 128 inputs."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for k in range(6):
        (folder / f"{k}.txt").write_text("".join(chr(97 + (k * 7 + i) % 26) for i in range(400 + 50 * k)))
    corpus = tokenize_corpus(folder, _Bytes(), tmp_path / "cache", 2, bos=False, eos=False, progress=False)
    plain = ExampleStream(corpus, 300, 2048, batch_size=2, seed=4, pad_id=0)
    aligned = ExampleStream(corpus, 300, 2048, batch_size=2, seed=4, pad_id=0, row_multiple=128)
    for _ in range(3):
        a, b = plain.next_batch(), aligned.next_batch()
        assert a.inputs.shape == (2, 299) and b.inputs.shape == (2, 384)
        for name in ("inputs", "targets", "positions", "mask"):
            assert (getattr(b, name)[:, :299] == getattr(a, name)).all(), name
        assert (b.mask[:, 299:] == 0).all() and b.mask.sum() == a.mask.sum() == 2 * 299
        assert (b.positions[:, 299:] == b.positions[:, 298:299]).all()  # padding repeats the last position
        assert (b.docs == a.docs).all()


def test_padding_changes_neither_the_loss_nor_its_gradient():
    """The masked loss of a causal model over a padded row equals the unpadded one, gradient included."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from pose_mlx.training.data import collate
    from pose_mlx.training.loop import masked_loss

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                                        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=50, rms_norm_eps=1e-5))
    x = np.random.default_rng(1).integers(1, 50, 21)
    example = (x, np.arange(21), np.ones(20, np.float32))
    grad = nn.value_and_grad(model, masked_loss)
    results = []
    for multiple in (1, 128):
        batch = collate([example], [0], pad_id=0, multiple=multiple)
        loss, grads = grad(model, mx.array(batch.inputs), mx.array(batch.targets), mx.array(batch.mask))
        results.append((loss.item(), {k: np.array(v) for k, v in tree_flatten(grads)}))
    (loss1, g1), (loss2, g2) = results
    assert abs(loss1 - loss2) <= 1e-5 * abs(loss1) and loss1 > 1
    for key in g1:
        np.testing.assert_allclose(g2[key], g1[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_finetune_trains_the_rows_the_plan_predicts(tiny_model, text_dir, tmp_path, monkeypatch, capsys):
    """A real run, default and forced on: the batches the model sees have the planned widths, and the targets
    trained (the log's tokens) are the same real ones."""
    from _finetune_helpers import read_log
    from pose_mlx.finetune import main as finetune

    widths = []
    next_batch = ExampleStream.next_batch

    def spy(self):
        batch = next_batch(self)
        widths.append(batch.inputs.shape[1])
        return batch

    monkeypatch.setattr(ExampleStream, "next_batch", spy)
    flags = ["--model", tiny_model, "--target", "64", "--window", "16", "--steps", "2", "--warmup", "1",
             "--data", text_dir, "--cache-dir", tmp_path / "c", "--no-progress"]
    tokens = {}
    for align in ("auto", "on"):
        widths.clear()
        out = tmp_path / align
        assert finetune([str(a) for a in flags + ["--align-rows", align, "--output", out]]) == 0, capsys.readouterr()
        *_, settings = planner.planned_run([str(a) for a in flags + ["--align-rows", align]])
        assert set(widths) == {settings.row_tokens}
        tokens[align] = [r["tokens"] for r in read_log(out / "train_log.jsonl")]
    if memory.compute_backend() == "cpu":
        assert widths == [128] * len(widths) and tokens["auto"] == tokens["on"] == [15, 15]


def test_align_rows_in_yaml_reads_on_and_off(folder, tmp_path):
    """YAML 1.1 reads an unquoted on/off as a boolean; both spellings mean the flag's values."""
    from pose_mlx.settings import parse_invocation

    for text, expected in (("on", "on"), ("off", "off"), ("'auto'", "auto")):
        (tmp_path / "run.yaml").write_text(f"model: {folder}\ntarget: 16k\nalign_rows: {text}\n")
        assert parse_invocation(["--config", str(tmp_path / "run.yaml")]).settings.align_rows == expected


def test_each_advice_variant_reads_as_a_sentence():
    """The refusal of a run that does not fit read "even turn on gradient checkpointing (--grad-checkpoint) needs
    about ...", then named only the first change that fits: it lists every change that fits with its peak (those
    `plan` lists), or says "even with" the smallest peak when none fits, or that nothing fits. (MLX's own path,
    where the smallest peak is the last change's.)"""
    full = memory.TrainSettings(window=1024, batch_size=8, lora=False, compile=False, target=8192, kernels="mlx")
    arch = memory.architecture(CONFIG)
    peak = lambda **changes: memory.training_memory(arch, memory.TrainSettings(**{**full.__dict__, **changes})).peak
    plan = memory.plan_memory(arch, full, 10**15)
    assert [s["change"] for s in plan.suggestions] == [
        "gradient checkpointing (--grad-checkpoint)", "LoRA adapters instead of all weights (--lora)",
        "a 4-bit quantized base with LoRA (mlx_lm.convert -q)",
        "a 4-bit base, LoRA and gradient checkpointing together"]
    size = memory.format_size
    just = peak(grad_checkpoint=True)  # checkpointing fits, and so do others: each is said with its peak
    fitting = memory.plan_memory(arch, full, just)
    said = [s for s in fitting.suggestions if s["fits"]]
    assert len(said) > 1 and said[0]["change"] == "gradient checkpointing (--grad-checkpoint)"
    assert fitting.advice() == "changes that fit: " + ", ".join(f"{s['change']}: about {size(s['peak_bytes'])}"
                                                                for s in said)
    assert fitting.advice(lambda changes: f"run {changes}").endswith(
        "; the first as a whole command: run {'grad_checkpoint': True}")
    tight = memory.plan_memory(arch, full, peak() // 2)
    batch = next(s for s in tight.suggestions if s["change"].startswith("--batch-size"))
    assert batch["change"] == f"--batch-size {tight.largest_batch} --grad-accum {-(-8 // tight.largest_batch)} " \
                              "(the same tokens per update)"
    none = memory.plan_memory(arch, full, 1)
    best = min(s["peak_bytes"] for s in none.suggestions)
    assert none.advice() == f"even with a 4-bit base, LoRA and gradient checkpointing together it needs about " \
                            f"{size(best)}"
    done = memory.TrainSettings(window=2, grad_checkpoint=True, compile=False)
    quantized = memory.architecture({**CONFIG, "quantization": {"bits": 4, "group_size": 64}})
    assert memory.plan_memory(quantized, done, 1).advice() == "no change the planner knows of makes it fit"
    with pytest.raises(UserError) as refusal:
        memory.check_fits(arch, full, just)
    assert str(refusal.value) == (f"this run needs about {size(peak())} at its peak, more than {size(just)}; "
                                  f"{fitting.advice()}; or --force to try anyway")


def test_the_resume_command_of_a_run_on_several_ranks_starts_as_many():
    from types import SimpleNamespace

    command = planner.RunPlan.resume_command.fget
    assert command(SimpleNamespace(output=Path("runs/a b"), world=SimpleNamespace(size=1))) == \
        "python -m pose_mlx.finetune --resume --output 'runs/a b'"
    assert command(SimpleNamespace(output=Path("out"), world=SimpleNamespace(size=2))) == \
        ("python -m pose_mlx.launch -n 2 -- python -m pose_mlx.finetune --resume --output out (or this command "
         "under your mlx.launch line, as 2 ranks)")
