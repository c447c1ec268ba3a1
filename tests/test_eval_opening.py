"""The evaluators' entry points (`python -m pose_mlx.passkey` runs `pose_mlx.eval.passkey`, ...) and their shared
opening (`pose_mlx.eval.opening`): its order, the lengths and memory check it hands on, its model line and output
path."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pose_mlx import memory
from pose_mlx.errors import UserError
from pose_mlx.eval import longctx
from pose_mlx.eval.opening import open_evaluation

from _eval_helpers import make_eval_folder

ROOT = Path(__file__).resolve().parents[1]
EVALUATORS = ["passkey", "perplexity", "ruler"]


@pytest.mark.parametrize("name", EVALUATORS)
def test_old_entry_point_runs_the_package_command(name, monkeypatch):
    """`python -m pose_mlx.NAME --help` prints the help of `pose_mlx.eval.NAME`'s parser, exit code 0; the entry
    module holds nothing but that command's `main`."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal width: the same in both processes
    proc = subprocess.run([sys.executable, "-m", f"pose_mlx.{name}", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    command = importlib.import_module(f"pose_mlx.eval.{name}")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == command.build_parser().format_help()
    assert proc.stdout.startswith(f"usage: python -m pose_mlx.{name} ")
    entry = importlib.import_module(f"pose_mlx.{name}")
    assert entry.main is command.main
    assert {n for n in vars(entry) if not n.startswith("_")} == {"main", "sys"}


@dataclass(kw_only=True)
class Settings(longctx.EvalSettings):
    """The least settings an evaluator has: the shared ones, lengths and output."""

    lengths: str | None = None
    output: str | None = None


def test_nothing_is_loaded_before_the_flags_and_the_lengths_grammar_pass(tmp_path):
    """Steps 2-3 refuse before the model is read: a missing model folder is never reported first."""
    missing = str(tmp_path / "no-model")
    calls = []

    def check(args):
        calls.append(args.chunk)
        raise UserError("--trials: own check")

    with pytest.raises(UserError, match="--chunk must be between"):
        open_evaluation("x", Settings(model=missing, chunk=0), check=check)
    assert calls == []  # --chunk comes before the command's own check
    with pytest.raises(UserError, match="--trials: own check"):
        open_evaluation("x", Settings(model=missing), check=check)
    with pytest.raises(UserError, match="--lengths 'x' is not a length"):
        open_evaluation("x", Settings(model=missing, lengths="2k,x"))


def test_fit_and_answer_reach_the_memory_check(tmp_path, monkeypatch):
    """The lengths are what `fit` keeps; the memory check is of the longest plus `answer` tokens (last-position
    logits), or of the longest alone with every position's logits when `answer` is None."""
    folder = str(make_eval_folder(tmp_path / "m", max_position_embeddings=64))
    seen = []
    monkeypatch.setattr(longctx, "check_memory", lambda info, lengths, chunk, force, all_logits=True:
                        seen.append((lengths, chunk, force, all_logits)) or ("estimate", 4321))
    # default lengths for a 64-token window: 32, 64; `fit` drops the first
    opening = open_evaluation("x", Settings(model=folder, chunk=16),
                              fit=lambda args, info, lengths: [n for n in lengths if n > 32], answer=7)
    assert opening.lengths == [64] and opening.info.original == 64 and opening.estimate == "estimate"
    assert opening.peak == 4321
    assert seen.pop() == ([64 + 7], 16, False, False)
    opening = open_evaluation("x", Settings(model=folder, lengths="16,48", force=True),
                              answer=lambda args: len(args.model))
    assert opening.lengths == [16, 48] and seen.pop() == ([48 + len(folder)], longctx.DEFAULT_CHUNK, True, False)
    open_evaluation("x", Settings(model=folder, lengths="16,48"))
    assert seen.pop() == ([16, 48], longctx.DEFAULT_CHUNK, False, True)


def test_announce_says_the_model_and_returns_the_output_path(tmp_path, monkeypatch, capsys):
    folder = make_eval_folder(tmp_path / "tiny", max_position_embeddings=64)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(memory.device, "available_memory", lambda: (1 << 40, "test"))
    opening = open_evaluation("kind", Settings(model=str(folder), lengths="32"), answer=0)
    expected, _ = longctx.check_memory(opening.info, [32], longctx.DEFAULT_CHUNK, all_logits=False)
    capsys.readouterr()
    assert opening.announce("note one", "note two") == folder / "eval" / "kind-32.json"
    assert capsys.readouterr().err.splitlines() == [
        f"model {folder}: schedule as configured; original window 64, max 64; note one; note two; "
        f"memory estimate {expected}",
        f"no --output given: writing {folder / 'eval' / 'kind-32.json'}"]
    given = tmp_path / "out" / "r.json"
    opening = open_evaluation("kind", Settings(model=str(folder), output=str(given)), answer=0)
    capsys.readouterr()
    assert opening.announce() == given
    assert capsys.readouterr().err == (f"model {folder}: schedule as configured; original window 64, max 64; "
                                       f"memory estimate {opening.estimate}\n")


@pytest.fixture(scope="module")
def window_256(tmp_path_factory):
    """A tiny model whose config declares a 256-token window (its pre-training window too)."""
    return make_eval_folder(tmp_path_factory.mktemp("window") / "m", max_position_embeddings=256)


def _evaluator_argv(name: str, folder: Path, tmp_path: Path) -> list[str]:
    data = tmp_path / "doc.txt"
    data.write_text(" ".join(f"The sky is blue {i}." for i in range(400)))
    extra = {"passkey": ["--trials", "1"], "perplexity": ["--data", str(data), "--docs", "1"],
             "ruler": ["--tasks", "niah_single_1", "--samples", "1", "--no-chat"]}[name]
    return ["--model", str(folder), *extra, "--no-progress", "--output", str(tmp_path / "out" / f"{name}.json")]


@pytest.mark.parametrize("name", EVALUATORS)
def test_a_length_beyond_the_declared_window_is_refused_naming_the_override(name, window_256, tmp_path, capsys):
    """`passkey --lengths 4x` of a 16k model started a 32k run without a word. Extended to 2x at load (window 512),
    `--lengths 4x` is refused by every evaluator before anything is computed or written, in one line that says
    what 4x meant and names --allow-beyond-window."""
    command = importlib.import_module(f"pose_mlx.eval.{name}")
    argv = _evaluator_argv(name, window_256, tmp_path) + ["--schedule", "yarn", "--target", "2x",
                                                         "--lengths", "1x,4x"]
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"pose_mlx.{name}: error: --lengths: 1024 is beyond the window this model declares, 512 tokens "
                   "(--target); 4x means 4 x the model's pre-training window 256 = 1024; measure up to 512 (2x), or "
                   "pass --allow-beyond-window to measure past it on purpose\n")
    assert not (tmp_path / "out").exists()
    assert command.main(_evaluator_argv(name, window_256, tmp_path) + ["--lengths", "300,2k"]) == 2
    assert ("--lengths: 300, 2048 are beyond the window this model declares, 256 tokens (its config); measure up to "
            "256 (1x)") in capsys.readouterr().err


def test_beyond_the_window_on_purpose_runs_and_says_so(window_256, tmp_path, capsys):
    """With --allow-beyond-window the same passkey run measures 1024 tokens, and its model line says it does so
    on purpose."""
    from pose_mlx.eval import passkey

    argv = _evaluator_argv("passkey", window_256, tmp_path) + ["--schedule", "yarn", "--target", "2x",
                                                              "--lengths", "1x,4x", "--allow-beyond-window"]
    assert passkey.main(argv) == 0
    err = capsys.readouterr().err
    [model_line] = [line for line in err.splitlines() if line.startswith("model ")]
    assert "; original window 256, max 512; 1024 beyond it on purpose (--allow-beyond-window); memory " in model_line
    record = json.loads((tmp_path / "out" / "passkey.json").read_text())
    assert [a["length"] for a in record["accuracy"]] == [256, 1024]


def test_the_declared_window_reads_rope_scaling():
    """max_position_embeddings, or a rope_scaling factor times the original window where that is longer (Qwen2.5
    keeps 32768 beside a YaRN factor 4: 131072)."""
    from pose_mlx.model.source import declared_window, original_window

    qwen = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 32768}}
    assert declared_window(qwen, original_window(qwen)) == 131072
    llama3 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                   "original_max_position_embeddings": 8192}}
    assert declared_window(llama3, original_window(llama3)) == 131072
    linear = {"max_position_embeddings": 8192, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert original_window(linear) == 4096 and declared_window(linear, 4096) == 8192
    assert declared_window({"n_positions": 1024}, 1024) == 1024 and declared_window({}, None) is None
