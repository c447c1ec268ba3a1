"""End-to-end tests of `python -m pose_mlx.finetune` (in-process through `main(argv)`) on a tiny model."""


import json
import re
import shlex
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate

from _finetune_helpers import ORIGINAL, read_log, text_dir, tiny_model, with_config  # noqa: F401
from pose_mlx.finetune import main
from pose_mlx.model.source import ALIASES

FAST = ["--window", "16", "--steps", "4", "--lr", "1e-3", "--warmup", "1", "--no-progress"]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


def _logits(model, ids):
    return np.array(model(mx.array([ids])).astype(mx.float32))


def test_end_to_end_8x_lora(tiny_model, text_dir, tmp_path, capsys):
    """Train 4 LoRA steps at 8x with the default schedule (YaRN); the output is a plain mlx-lm folder that generates
    and knows its schedule."""
    out = tmp_path / "out"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "8x", "--data", text_dir, "--output", out,
                        "--cache-dir", tmp_path / "cache", *FAST)
    assert code == 0, err
    assert not (tmp_path / "out.partial").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 8 * ORIGINAL
    assert (config["rope_scaling"]["rope_type"], config["rope_scaling"]["factor"]) == ("yarn", 8.0)
    record = json.loads((out / "pose_mlx.json").read_text())
    assert (record["original"], record["target"], record["window"]) == (ORIGINAL, 8 * ORIGINAL, 16)
    assert (record["sampler"], record["steps"]) == ("pose", 4)
    assert record["schedule"]["schedule"] == "yarn" and record["mlx_lm_exact"] and record["data_fingerprint"]
    log = read_log(out / "train_log.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens"] == 15 and r["peak_memory_gb"] > 0 for r in log)
    assert record["final_loss"] == log[-1]["loss"]
    model, tokenizer = load(str(out))
    assert not any("lora" in k for k in dict(model.parameters()))
    prompt = tokenizer.encode("def main(")
    generated = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    greedy, ids = [], list(prompt)
    for _ in range(len(generated)):  # mlx-lm decodes greedily by default: the same tokens, one full forward each
        greedy.append(int(np.argmax(_logits(model, ids)[0, -1])))
        ids.append(greedy[-1])
    assert generated == greedy and len(generated) >= 1
    # a long prompt (beyond the original window) runs through the KV cache
    ids = tokenizer.encode("x = 1\n" * 60)[: 3 * ORIGINAL]
    assert np.isfinite(_logits(model, ids)).all()


def test_lora_changes_weights_and_no_fuse_keeps_adapters(tiny_model, text_dir, tmp_path, capsys):
    """--no-fuse: base weights untouched + adapters; base + adapters equals the fused export (<= 1e-4)."""
    common = ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--cache-dir", tmp_path / "c", *FAST]
    assert run_cli(capsys, *common, "--output", tmp_path / "fused")[0] == 0
    assert run_cli(capsys, *common, "--output", tmp_path / "split", "--no-fuse")[0] == 0
    assert (tmp_path / "split" / "adapters.safetensors").is_file()
    base = mx.load(str(tiny_model / "model.safetensors"))
    split = mx.load(str(tmp_path / "split" / "model.safetensors"))
    fused = mx.load(str(tmp_path / "fused" / "model.safetensors"))
    assert split.keys() == base.keys() == fused.keys()
    for k in base:
        np.testing.assert_array_equal(np.array(split[k]), np.array(base[k]))
    assert any(not np.allclose(np.array(fused[k]), np.array(base[k])) for k in base)
    ids = list(range(3, 3 + 3 * ORIGINAL))
    m_fused, _ = load(str(tmp_path / "fused"))
    m_split, _ = load(str(tmp_path / "split"), adapter_path=str(tmp_path / "split"))
    np.testing.assert_allclose(_logits(m_split, ids), _logits(m_fused, ids), atol=1e-4)
    from pose_mlx import load as pose_load  # our loader (and so the evaluators) applies the adapters itself

    m_ours, _ = pose_load(str(tmp_path / "split"))
    np.testing.assert_allclose(_logits(m_ours, ids), _logits(m_fused, ids), atol=1e-4)


def test_full_finetune_and_grad_options(tiny_model, text_dir, tmp_path, capsys):
    """--full with gradient checkpointing, accumulation and batch 2: trains all weights, 2*2*15 targets/step."""
    out = tmp_path / "full"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "64", "--data", text_dir, "--output", out,
                        "--cache-dir", tmp_path / "c", "--full", "--grad-checkpoint", "--grad-accum", "2",
                        "--batch-size", "2", "--sampler", "randpos", *FAST)
    assert code == 0, err
    log = read_log(out / "train_log.jsonl")
    assert all(r["tokens"] == 2 * 2 * 15 for r in log)
    base = mx.load(str(tiny_model / "model.safetensors"))
    new = mx.load(str(out / "model.safetensors"))
    changed = [k for k in base if not np.allclose(np.array(new[k]), np.array(base[k]))]
    assert any("norm" in k for k in changed) and any("embed" in k for k in changed)


def test_full_length_baseline(tiny_model, text_dir, tmp_path, capsys):
    """--sampler full trains on contiguous target-length sequences (64 tokens -> 63 targets per step)."""
    out = tmp_path / "fl"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "64", "--data", text_dir, "--output", out,
                        "--cache-dir", tmp_path / "c", "--sampler", "full", *FAST)
    assert code == 0, err
    assert [r["tokens"] for r in read_log(out / "train_log.jsonl")] == [63] * 4
    assert json.loads((out / "pose_mlx.json").read_text())["sampler"] == "full"


def test_deprecated_method_flag_still_works(tiny_model, tmp_path, capsys):
    """--method / --scaling (earlier names of --sampler / --schedule) work, with one warning each."""
    out = tmp_path / "old"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "4x", "--method", "none", "--scaling", "ntk",
                        "--output", out)
    assert code == 0, err
    record = json.loads((out / "pose_mlx.json").read_text())
    assert record["sampler"] == "none" and record["schedule"]["schedule"] == "ntk"
    assert "--method is deprecated; use --sampler" in err and "--scaling is deprecated; use --schedule" in err


def test_sampler_none_exports_without_data(tiny_model, tmp_path, capsys):
    """PI-only: no --data, no training; mlx_lm.load gives the extended model exactly."""
    out = tmp_path / "pi"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "8x", "--sampler", "none", "--output", out)
    assert code == 0, err
    record = json.loads((out / "pose_mlx.json").read_text())
    assert record["steps"] == 0 and record["mlx_lm_exact"] is True
    base = mx.load(str(tiny_model / "model.safetensors"))
    new = mx.load(str(out / "model.safetensors"))
    for k in base:
        np.testing.assert_array_equal(np.array(new[k]), np.array(base[k]))


def test_yaml_config_and_flags_win(tiny_model, text_dir, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {tiny_model}\ntarget: 4x\ndata: {text_dir}\nsteps: 3\nwindow: 16\nlr: 1e-3\n"
                   f"warmup: 1\nno-progress: true\ncache_dir: {tmp_path / 'c'}\nlora: true\n"
                   "schedule: yarn\nschedule_params: {beta_fast: 16}\n")
    out = tmp_path / "y"
    assert run_cli(capsys, "--config", cfg, "--steps", "2", "--output", out)[0] == 0
    assert len(read_log(out / "train_log.jsonl")) == 2
    record = json.loads((out / "pose_mlx.json").read_text())
    assert record["schedule"]["schedule"] == "yarn" and record["schedule"]["params"] == {"beta_fast": 16}
    assert record["lr"] == 1e-3  # YAML's 1e-3 (a string to PyYAML's YAML 1.1 rules) is read as a number
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    code, err = run_cli(capsys, "--config", bad, "--model", tiny_model, "--target", "2x")
    assert code == 2 and "stepz" in err and "did you mean 'steps'" in err


def test_help_lists_aliases(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for alias, (repo, window) in ALIASES.items():
        assert alias in out and repo in out
    for flag in ("--target", "--schedule-param", "--sampler", "--grad-checkpoint", "--no-fuse", "--eval-every",
                 "--resume"):
        assert flag in out
    assert {"llama-7b", "llama-2-7b", "llama-2-13b", "mistral-7b", "tinyllama", "qwen2.5-0.5b"} <= set(ALIASES)


def test_help_lists_every_schedule_and_its_parameters(capsys):
    """--help names each registered schedule with the keyword parameters its function accepts."""
    import inspect

    from pose_mlx.rope import SCHEDULES

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    section = out.split("--schedule-param keys with defaults:")[1].split("deprecated flags")[0]
    lines = {line.split()[0]: line for line in section.splitlines() if line.strip()}
    assert set(lines) == set(SCHEDULES)
    for name, fn in SCHEDULES.items():
        for q in inspect.signature(fn).parameters.values():
            if q.kind is q.KEYWORD_ONLY:
                assert f"{q.name}=" in lines[name] or q.name in lines[name].split(), (name, q.name)
    assert "beta_fast=32.0" in lines["yarn"] and "bins=" in lines["dprope"]


def test_eval_every_logs_heldout_loss(tiny_model, text_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                        "--cache-dir", tmp_path / "c", "--eval-every", "2", "--heldout", "0.25",
                        "--eval-batches", "2", *FAST)
    assert code == 0, err
    log = read_log(out / "train_log.jsonl")
    assert [("eval_loss" in r) for r in log] == [False, True, False, True]
    assert all(math.isfinite(r["eval_loss"]) for r in log if "eval_loss" in r)


def test_qlora_on_a_4bit_base(tiny_model, text_dir, tmp_path, capsys):
    """LoRA trains on a quantized base; fused output stays 4-bit, --no-fuse output = base + adapters."""
    import shutil

    from mlx_lm.utils import quantize_model, save_config, save_model

    model, _, config = load(str(tiny_model), return_config=True)
    model, config = quantize_model(model, config, 32, 4)
    qdir = tmp_path / "q4"
    qdir.mkdir()
    save_model(qdir, model)
    save_config(config, qdir / "config.json")
    for f in tiny_model.glob("tokenizer*"):
        shutil.copyfile(f, qdir / f.name)
    common = ["--model", qdir, "--target", "4x", "--data", text_dir, "--cache-dir", tmp_path / "c", *FAST]
    assert run_cli(capsys, *common, "--output", tmp_path / "fused")[0] == 0
    assert run_cli(capsys, *common, "--output", tmp_path / "split", "--no-fuse")[0] == 0
    fused, _ = load(str(tmp_path / "fused"))
    assert type(fused.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    split, _ = load(str(tmp_path / "split"), adapter_path=str(tmp_path / "split"))
    base, _ = load(str(qdir))
    ids = list(range(3, 3 + 2 * ORIGINAL))
    trained = _logits(split, ids)
    assert np.abs(trained - _logits(base, ids)).max() > 1e-3  # the adapters learned something
    assert np.isfinite(_logits(fused, ids)).all()


def _mlx_lm_data(folder, text_dir):
    """An mlx-lm data folder: train.jsonl (text), valid.jsonl (text), test.jsonl (a marker that must never be read)."""
    folder.mkdir()
    texts = sorted(p.read_text() for p in text_dir.glob("*.txt"))
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:8]))
    (folder / "valid.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[8:10]))
    (folder / "test.jsonl").write_text('{"broken": \n')  # not even JSON: reading it would fail the run
    return folder


def test_mlx_lm_data_folder_trains_on_train_and_evaluates_on_valid(tiny_model, text_dir, tmp_path, capsys):
    """train.jsonl is the training set, valid.jsonl the held-out set of --eval-every, test.jsonl is never read."""
    from pose_mlx.training.data import read_documents

    data = _mlx_lm_data(tmp_path / "data", text_dir)
    assert len(list(read_documents(data))) == 8 and len(list(read_documents(data, split="valid"))) == 2
    out = tmp_path / "out"
    code, err = run_cli(capsys, "--model", tiny_model, "--target", "4x", "--data", data, "--output", out,
                        "--cache-dir", tmp_path / "c", "--eval-every", "2", "--eval-batches", "1", *FAST)
    assert code == 0, err
    log = read_log(out / "train_log.jsonl")
    assert [("eval_loss" in r) for r in log] == [False, True, False, True]
    meta = [json.loads(p.read_text()) for p in (tmp_path / "c").glob("*/meta.json")]
    assert sorted(m["num_docs"] for m in meta) == [2, 8]  # valid and train, tokenized separately; no test


def test_chat_and_completions_records_use_the_chat_template(tiny_model, tmp_path, capsys):
    """mlx-lm's chat ({"messages"}) and completions ({"prompt", "completion"}) records are rendered with the
    tokenizer's chat template before tokenization."""
    import shutil

    from pose_mlx.training.data import chat_renderer, read_documents

    model = shutil.copytree(tiny_model, tmp_path / "chat-model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    _, tokenizer = load(str(model))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n"
                    + json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    docs = list(read_documents(data, render=chat_renderer(tokenizer)))
    assert docs == ["<|user|>hi\n<|assistant|>hello\n", "<|user|>2+2=\n<|assistant|>4\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(Exception, match="bad.jsonl:1: 'messages' must be"):
        list(read_documents(bad, render=chat_renderer(tokenizer)))


def test_mlx_lm_yaml_keys_mean_the_same_here(tiny_model, text_dir, tmp_path, capsys):
    """iters, learning_rate, batch_size, max_seq_length, num_layers, lora_parameters.rank/scale, fine_tune_type
    and grad_accumulation_steps are read as this tool's settings; an unknown key is refused with a suggestion."""
    from pose_mlx.settings import parse_invocation

    cfg = tmp_path / "lora.yaml"
    cfg.write_text(f"model: {tiny_model}\ntrain: true\ndata: {text_dir}\niters: 7\nlearning_rate: 1e-4\n"
                   "batch_size: 2\nmax_seq_length: 16\nnum_layers: 1\ngrad_accumulation_steps: 3\n"
                   "fine_tune_type: lora\nlora_parameters: {rank: 4, scale: 10.0, dropout: 0.0}\nsteps_per_eval: 5\n")
    s = parse_invocation(["--config", str(cfg), "--target", "4x"]).settings
    assert (s.steps, s.lr, s.batch_size, s.window, s.lora_layers, s.grad_accum) == (7, 1e-4, 2, 16, 1, 3)
    assert (s.lora_rank, s.lora_scale, s.full, s.eval_every) == (4, 10.0, False, 5)
    cfg.write_text(f"model: {tiny_model}\ntarget: 4x\nlearning_rat: 1e-4\n")
    code, err = run_cli(capsys, "--config", cfg)
    assert code == 2 and "did you mean 'learning_rate'" in err


def test_max_memory_refuses_before_loading_and_force_overrides(tiny_model, text_dir, tmp_path, capsys, monkeypatch):
    """A run predicted above --max-memory stops before any weight is read, naming the peak and a change; --force
    runs it anyway. The default limit is what this machine offers."""
    import pose_mlx.model.source as source
    import pose_mlx.memory as memory

    loads = []
    real_load = source.load
    monkeypatch.setattr(source, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    args = ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--cache-dir", tmp_path / "c", *FAST]
    code, err = run_cli(capsys, *args, "--output", tmp_path / "a", "--max-memory", "64KB")
    assert code == 2 and "needs about" in err and "more than 64 KiB" in err and "--force" in err
    assert loads == [] and not (tmp_path / "a").exists()
    code, err = run_cli(capsys, *args, "--output", tmp_path / "b", "--max-memory", "64KB", "--force")
    assert code == 0, err
    monkeypatch.setattr(memory.device, "available_memory", lambda: (2**16, "test"))
    code, err = run_cli(capsys, *args, "--output", tmp_path / "d")
    assert code == 2 and "more than 64 KiB" in err


def test_the_memory_refusal_offers_plans_changes_and_a_command_that_fits(tiny_model, text_dir, tmp_path, capsys):
    """The refusal named only --grad-checkpoint or --force while `plan` for the same run also offered a shorter
    --window: it lists the changes plan marks as fitting, and gives the first as a whole command, which `plan`
    (offline, the same flags) accepts and finds fitting."""
    from pose_mlx import plan

    args = [str(a) for a in ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--cache-dir",
                             tmp_path / "c", "--output", tmp_path / "a", *FAST, "--window", "64"]]
    assert plan.main([*args, "--max-memory", "1K", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    peaks = sorted(s["peak_bytes"] for s in record["suggestions"] if s["run_changes"] is not None)
    limit = f"{(peaks[0] + record['peak_bytes']) // 2}B"  # above the cheapest change of the run's flags, below the run
    code, err = run_cli(capsys, *args, "--max-memory", limit)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert plan.main([*args, "--max-memory", limit]) == 0
    table = capsys.readouterr().out
    fitting = [line.strip().rsplit("  ", 2)[0].strip() for line in table.splitlines()
               if line.startswith("  ") and line.endswith("   fits")]
    said = err.split("changes that fit: ")[1].split("; the first")[0]
    offered = re.findall(r"(.+?): about \S+ \S+(?:, |$)", said)
    assert fitting and offered == fitting, (offered, table)
    command = shlex.split(err.split("the first as a whole command: ")[1].removesuffix("; or --force to try anyway\n"))
    assert command[:3] == ["python", "-m", "pose_mlx.finetune"]
    assert f"the first that fits, as a whole command: {shlex.join(command)}" in table  # plan gives the same
    assert plan.main(command[3:]) == 0 and "verdict: fits" in capsys.readouterr().out


def test_header_before_loading(tiny_model, text_dir, tmp_path, capsys, monkeypatch):
    """The header names the run before a weight is read (a load that fails still shows it): lengths, schedule,
    sampler, LoRA, rows and batch, and the same predicted peak that `python -m pose_mlx.plan` gives."""
    from pose_mlx import finetune, memory, plan
    from pose_mlx.errors import UserError
    from pose_mlx.model import source

    def failing_load(*args, **kwargs):
        raise UserError("load refused by the test")

    monkeypatch.setattr(source, "load", failing_load)
    flags = ["--model", tiny_model, "--target", "8x", "--data", text_dir, "--cache-dir", tmp_path / "c",
             "--schedule", "yarn", "--window", "16", "--batch-size", "3", "--max-memory", "64GB"]
    code = main([str(a) for a in [*flags, "--output", tmp_path / "out", "--steps", "7", "--no-progress"]])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip() == "pose_mlx.finetune: error: load refused by the test"  # stderr: the one line
    head = captured.out
    lines = head.strip().splitlines()
    assert len(lines) == 4 and not [line for line in lines if line.startswith("evidence")]  # plan says that
    assert f"original {ORIGINAL} -> target {8 * ORIGINAL} tokens (8x)" in lines[0]
    assert "schedule yarn, sampler pose (2 chunks), LoRA rank 8 on 2 blocks, 16-token rows, batch 3" in lines[1]
    assert "7 steps at lr 2e-05" in lines[1] and f"output {tmp_path / 'out'}" in lines[3]
    device = finetune.DEVICES[memory.compute_backend()]
    assert lines[2] == (f"training: 7 updates x 45 tokens = 315 tokens on {device}; each update's time goes to "
                        f"{tmp_path / 'out.partial' / 'log.jsonl'}")  # 3 rows of 15 targets an update
    assert plan.main([str(a) for a in flags] + ["--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["peak_bytes"] > 0
    assert f"predicted peak memory {memory.format_size(predicted['peak_bytes'])} of 64 GiB" in head
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()  # nothing left behind


def test_header_then_progress_then_summary(tiny_model, text_dir, tmp_path, capsys):
    """A whole run prints the header (four lines on stdout) before anything else, the summary line last (on
    stderr, as the progress bar)."""
    out = tmp_path / "out"
    code = main([str(a) for a in ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                                  "--cache-dir", tmp_path / "c", "--full", *FAST]])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith(f"model {tiny_model}: original {ORIGINAL} -> target {4 * ORIGINAL}")
    assert "full fine-tuning, 16-token rows, batch 1, 4 steps" in lines[1]
    assert lines[2].startswith("training: 4 updates x 15 tokens = 60 tokens on ")
    assert lines[3].startswith("predicted peak memory ") and lines[3].endswith(f"output {out}")
    summary = captured.err.strip().splitlines()[-1]
    assert summary.startswith("trained 4 steps") and summary.endswith(f"wrote {out}")


@pytest.mark.parametrize("flag, low, high", [  # the ranges the project documents for these flags
    ("--steps", 1, 10**9), ("--seed", 0, 2**32 - 1), ("--window", 2, 1 << 24), ("--chunks", 1, 1 << 24),
    ("--eval-batches", 1, 1 << 20), ("--save-every", 0, 10**9)])
def test_each_range_is_enforced_from_the_flag_and_the_yaml_key(flag, low, high, tmp_path):
    """A setting is declared once: its range holds, with the same one-line message, whether the value comes from
    the flag or from the YAML file; the ends of the range are accepted."""
    from pose_mlx.errors import UserError
    from pose_mlx.settings import parse_invocation

    key = flag.lstrip("-").replace("-", "_")
    for value in (low, high):
        assert getattr(parse_invocation(["--model", "m", flag, str(value)]).settings, key) == value
    for value in (low - 1, high + 1):
        config = tmp_path / "run.yaml"
        config.write_text(f"{key}: {value}\n")
        messages = []
        for argv in ([flag, str(value)], ["--config", str(config)]):
            with pytest.raises(UserError) as error:
                parse_invocation(["--model", "m", *argv])
            messages.append(str(error.value))
        assert messages[0] == messages[1] == f"{flag} must be between {low} and {high}, got {value}"


def test_every_setting_has_a_flag_in_help_and_a_yaml_key(capsys, tmp_path):
    """Each field of RunSettings can be set from the command line (its flags are in --help) and from YAML under
    its own name, with the same result as its default."""
    from dataclasses import fields

    import yaml

    from pose_mlx.settings import RunSettings, flags_of, read_yaml

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    defaults = RunSettings()
    for f in fields(RunSettings):
        assert all(flag.option in out for flag in flags_of(f)), f.name
        value = getattr(defaults, f.name)
        (tmp_path / "one.yaml").write_text(yaml.safe_dump({f.name: value}))
        assert read_yaml(tmp_path / "one.yaml") == {f.name: value}, f.name


def test_the_cost_line_and_the_progress_bar_time_left(tiny_model, text_dir, tmp_path, capsys):
    """Before training one line says what will run and where (the updates, the target tokens of each, the device)
    and that the time left shows on the progress bar, which has it once the first update is timed."""
    import re

    out = tmp_path / "out"
    code = main([str(a) for a in ["--model", tiny_model, "--target", "4x", "--data", text_dir, "--output", out,
                                  "--cache-dir", tmp_path / "c", "--window", "16", "--steps", "4", "--batch-size",
                                  "2", "--grad-accum", "3", "--lr", "1e-3", "--warmup", "1"]])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    cost = [line for line in captured.out.splitlines() if line.startswith("training: ")]
    assert len(cost) == 1 and cost[0].startswith("training: 4 updates x 90 tokens = 360 tokens on ")  # 2 x 3 x 15
    assert cost[0].endswith("the progress bar shows the time left from the first update on")
    states = re.split(r"[\r\n]", captured.err)
    shown = [state for state in states if re.search(r"\b[1-4]/4 \[", state)]  # tqdm redraws at most each 0.1 s
    assert shown and all(re.search(r"\b[1-4]/4 \[[\d:]+<[\d:]+,", state) for state in shown), captured.err
