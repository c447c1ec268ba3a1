"""`python -m pose_mlx.generate`: the same greedy answer as mlx-lm's own generation, chunked prefill through the
CPU attention path, the chat template, the prompt file + question, and bad input in one line."""

from __future__ import annotations

import io
import json
import re
import shlex

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load

from _eval_helpers import make_eval_folder
from conftest import cpu_only, smollm2  # noqa: F401 (a fixture)
from pose_mlx import generate
from pose_mlx.eval import cpu_attention, longctx

TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random llama folder with a 512-token window and a chat template."""
    folder = make_eval_folder(tmp_path_factory.mktemp("gen") / "tiny", max_position_embeddings=512)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def answer(capsys, *argv) -> tuple[int, str, str]:
    code = generate.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_answer_equals_mlx_lm_generate(tiny, capsys):
    model, tokenizer = mlx_load(str(tiny))
    reference = mlx_generate(model, tokenizer, TEXT, max_tokens=24, verbose=False)
    assert len(tokenizer.encode(reference, add_special_tokens=False)) >= 10  # a real answer, not an early stop
    code, out, err = answer(capsys, "--model", str(tiny), "--prompt", TEXT, "--max-tokens", "24")
    assert code == 0, err
    assert out == reference + "\n"
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"model {tiny}: ") and "prompt 24 tokens" in lines[0]  # (the announce line)
    assert lines[-1].startswith("prompt: 24 tokens, ") and "generation: 24 tokens" in lines[-1]
    assert "tokens/s" in lines[-1] and "stopped: --max-tokens 24" in lines[-1]


@cpu_only("the NumPy attention of pose_mlx.eval.cpu_attention")
def test_chunked_prefill_runs_the_cpu_attention_and_gives_the_same_tokens(tiny, capsys, monkeypatch):
    calls, original = [], cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda q, k, v, *a, **kw: (calls.append(q.shape[2]),
                                                                                original(q, k, v, *a, **kw))[1])
    long_text = " ".join([TEXT] * 8)
    answers = {}
    for chunk in ("7", "4096"):
        calls.clear()
        code, answers[chunk], err = answer(capsys, "--model", str(tiny), "--prompt", long_text, "--max-tokens",
                                           "16", "--chunk", chunk)
        assert code == 0, err
        prompt = int(err.split("prompt ")[1].split()[0])
        assert prompt > 150
        # mlx-lm prefills all but the last prompt token in chunks; that token and each generated one come alone
        size, layers = int(chunk), 2
        chunks = [size] * ((prompt - 1) // size) + ([(prompt - 1) % size] if (prompt - 1) % size else [])
        prefill = [n for n in chunks for _layer in range(layers)]
        assert calls[: len(prefill)] == prefill
        assert set(calls[len(prefill):]) == {1} and len(calls) - len(prefill) >= layers * 16
    assert answers["7"] == answers["4096"] and len(answers["7"]) > 10


def test_the_prefill_bar_follows_the_prefill_work_and_closes_before_the_answer(capsys):
    """The prefill's bar counted tokens, so its ETA ignored that later chunks attend to more: it moves by each
    chunk's predicted work (`cost.Compute`), says the tokens read, and closes when mlx-lm reports the whole prompt."""
    from pose_mlx.eval.cost import Compute

    compute = Compute(block_parameters=1000, attention=10, output=7)
    bar = generate.PrefillBar(compute, 100, 10, True)
    bar(0, 100)
    bar(50, 100)
    assert bar.work.bar.postfix == "100 tokens: 50/100 read"
    assert bar.work.bar.n == pytest.approx(bar.work.bar.total * compute.prefill(50, 0) / compute.prefill(100, 0))
    assert bar.work.bar.n < bar.work.bar.total / 2  # the second half attends to more keys
    bar(100, 100)
    assert "prefill 1/1 prompt: 100%" in capsys.readouterr().err
    short = generate.PrefillBar(compute, 10, 10, True)  # one chunk: no bar
    assert short.work.bar.disable


def test_dynamic_ntk_prefill_in_chunks_equals_one_pass(tiny):
    """A dynamic-NTK model rotates every key by a base set by the whole prompt's length: the chunks of the
    prefill must use that length, not the length read so far."""
    info = longctx.load_eval_model(str(tiny), "dynamic", "4x", original=64)
    prompt = info.tokenizer.encode(" ".join([TEXT] * 10))
    assert len(prompt) > info.original  # the base moves only past the original window
    first = {}
    for chunk in (16, len(prompt)):
        response = next(generate.generate(info.model, info.tokenizer, prompt, 4, chunk=chunk))
        first[chunk] = np.array(response.logprobs)
    np.testing.assert_allclose(first[16], first[len(prompt)], atol=1e-4)


def test_chat_template_wraps_the_prompt(tiny, capsys):
    model, tokenizer = mlx_load(str(tiny))
    expected = tokenizer.encode("<|system|>Be brief.</s><|user|>Hello there</s><|assistant|>",
                                add_special_tokens=False)
    assert generate.prompt_tokens(tokenizer, "Hello there", chat=True, system="Be brief.") == expected
    without_system = tokenizer.encode("<|user|>Hello there</s><|assistant|>", add_special_tokens=False)
    assert generate.prompt_tokens(tokenizer, "Hello there", chat=True) == without_system
    code, out, err = answer(capsys, "--model", str(tiny), "--chat", "--system", "Be brief.", "--prompt",
                            "Hello there", "--max-tokens", "3")
    assert code == 0, err
    assert f"prompt {len(expected)} tokens" in err


def test_prompt_file_then_question(tmp_path, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text("Line one.\nLine two.\n\n")
    args = generate.GenerateSettings(model="m", prompt_file=str(doc), prompt="What is line two?")
    assert generate.read_prompt(args) == "Line one.\nLine two.\n\nWhat is line two?"
    args = generate.GenerateSettings(model="m", prompt_file=str(doc))
    assert generate.read_prompt(args) == "Line one.\nLine two.\n\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("Über stdin.".encode())))
    args = generate.GenerateSettings(model="m", prompt_file="-", prompt="Q?")
    assert generate.read_prompt(args) == "Über stdin.\n\nQ?"


def hinted(err: str) -> list[list[str]]:
    """The whole commands a refusal gives (in backquotes), as argument lists."""
    return [shlex.split(command) for command in re.findall(r"`([^`]+)`", err)]


def test_a_prompt_that_fills_the_window_is_refused_and_the_answer_is_capped(tiny, capsys):
    """The refusal's hint was "extend it at load (e.g. --schedule yarn --target 2x)": it is the whole command,
    which runs when pasted; --allow-beyond-window reads past the window on purpose."""
    long_text = " ".join([TEXT] * 30)
    code, out, err = answer(capsys, "--model", str(tiny), "--prompt", long_text, "--max-tokens", "8")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("pose_mlx.generate: error: the prompt is ") and "window this model declares, 512" in err
    assert err.endswith("or pass --allow-beyond-window to read past the window anyway\n")
    [command] = hinted(err)
    assert command == ["python", "-m", "pose_mlx.generate", "--model", str(tiny), "--schedule", "yarn", "--target",
                       "2x", "--prompt", long_text, "--max-tokens", "8"]
    code, out, err = answer(capsys, *command[3:])
    assert code == 0 and "window 1024; prompt " in err  # extended at load, the same prompt fits
    code, out, err = answer(capsys, "--model", str(tiny), "--prompt", long_text, "--max-tokens", "8",
                            "--allow-beyond-window")
    assert code == 0 and "answer up to 8;" in err and "generation: 8 tokens" in err
    _model, tokenizer = mlx_load(str(tiny))
    fitting = " ".join([TEXT] * 21)
    room = 512 - len(tokenizer.encode(fitting))
    assert 0 < room < 40
    code, out, err = answer(capsys, "--model", str(tiny), "--prompt", fitting, "--max-tokens", "1k")
    assert code == 0, err
    assert f"answer up to {room} (the model's window of 512 tokens)" in err
    last = err.strip().splitlines()[-1]
    assert f"generation: {room} tokens" in last and "(stopped: the model's window of 512 tokens)" in last


@pytest.mark.parametrize("argv, message", [
    ([], "no prompt: give --prompt TEXT, --prompt-file FILE"),
    (["--prompt", "  \n"], "the prompt is empty"),
    (["--prompt-file", "missing.txt"], "--prompt-file missing.txt: cannot read it (No such file or directory)"),
    (["--prompt-file", "."], "--prompt-file .: cannot read it (Is a directory)"),
    (["--prompt-file", "latin1.txt"], "--prompt-file latin1.txt: not UTF-8 text (byte 1)"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--prompt", "hi", "--max-tokens", "2x"], "--max-tokens"),
    (["--prompt", "hi", "--temp", "-1"], "--temp must be a finite number >= 0"),
    (["--prompt", "hi", "--temp", "nan"], "--temp must be a finite number >= 0"),
    (["--prompt", "hi", "--system", "s"], "--system: only with --chat"),
    (["--prompt", "hi", "--chunk", "0"], "--chunk must be between 1"),
])
def test_bad_input_is_one_line_before_loading_the_model(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("é".encode("latin-1").join([b"a", b"b"]))
    code, out, err = answer(capsys, "--model", str(tmp_path / "no-such-model"), *argv)
    assert code == 2 and out == ""
    assert err.startswith("pose_mlx.generate: error: ") and message in err and err.count("\n") == 1


def test_chat_without_a_template_is_refused(tmp_path, capsys):
    folder = make_eval_folder(tmp_path / "plain")
    code, out, err = answer(capsys, "--model", str(folder), "--chat", "--prompt", "hi")
    assert code == 2 and "--chat: the model's tokenizer has no chat template" in err


def test_the_real_model_answers_from_its_prompt(smollm2):  # noqa: F811
    _path, model, tokenizer, _config = smollm2
    prompt = generate.prompt_tokens(tokenizer, "The secret word is 'pineapple'. Remember it.\n\n"
                                               "What is the secret word?", chat=True)
    text = "".join(r.text for r in generate.generate(model, tokenizer, prompt, 24, chunk=8))
    assert "pineapple" in text.lower()
    mx.clear_cache()


def test_a_fine_tuned_model_too_short_for_the_prompt_points_to_finetune(tiny, tmp_path, capsys):
    """The hint was `python -m pose_mlx.finetune --target 4x`, without --model or --data: for a folder finetune
    wrote, it is the fine-tuning again to a longer target from its run.json (which `plan`, offline, accepts with
    those flags) and its base extended at load (which runs)."""
    from pose_mlx import finetune, plan, toy

    data = tmp_path / "texts"
    data.mkdir()
    for i, text in enumerate(toy.stdlib_texts(max_files=4, min_chars=6000)):
        (data / f"doc{i}.txt").write_text(text)
    folder = tmp_path / "extended"
    assert finetune.main(["--model", str(tiny), "--target", "2x", "--data", str(data), "--output", str(folder),
                          "--window", "32", "--steps", "2", "--lora-layers", "1", "--cache-dir",
                          str(tmp_path / "cache"), "--no-progress"]) == 0
    capsys.readouterr()
    long_text = " ".join([TEXT] * 50)
    code, out, err = answer(capsys, "--model", str(folder), "--prompt", long_text, "--max-tokens", "8")
    assert code == 2 and "at least the window this model declares, 1024 (the target of its extension" in err
    again, base = hinted(err)
    assert again[:3] == ["python", "-m", "pose_mlx.finetune"] and again[again.index("--target") + 1] == "4x"
    assert again[again.index("--data") + 1] == str(data) and again[again.index("--model") + 1] == str(tiny)
    assert plan.main(again[3:]) == 0 and "verdict: fits" in capsys.readouterr().out
    assert base[:5] == ["python", "-m", "pose_mlx.generate", "--model", str(tiny)]
    code, out, err = answer(capsys, *base[3:])
    assert code == 0 and "window 2048; prompt " in err, err
