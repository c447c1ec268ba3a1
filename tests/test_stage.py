"""The training stage (`pose_mlx.training.stage.fine_tune`) called directly on a planned run: what it trains
(LoRA adapters only, every weight with --full, nothing for --sampler none), the run folder it writes, and the
summary it returns, checked against the log.jsonl it leaves (read here line by line) and counts by hand."""

import json
import shutil

import numpy as np
from mlx.utils import tree_flatten

from _finetune_helpers import text_dir, tiny_model  # noqa: F401
from pose_mlx.model.patch import extend, use_positions
from pose_mlx.model.source import load
from pose_mlx.plan import make_plan
from pose_mlx.settings import parse_invocation
from pose_mlx.training.lora import lora_modules
from pose_mlx.training.stage import fine_tune

WINDOW, BATCH, STEPS = 16, 2, 4
PROJECTIONS = 7  # q, k, v, o, gate, up, down: the linear layers of a llama block


def _stage(tiny_model, data, tmp_path, *flags):  # noqa: F811
    """(plan, the model after fine_tune, its parameters before, fine_tune's summary)."""
    argv = ["--model", str(tiny_model), "--target", "4x", "--data", str(data), "--output", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--window", str(WINDOW), "--batch-size", str(BATCH),
            "--steps", str(STEPS), "--lr", "1e-3", "--warmup", "1", "--no-progress", "--no-compile", *flags]
    plan = make_plan(parse_invocation(argv))
    try:
        model, tokenizer = load(tiny_model, apply_schedule=False)
        extend(model, plan.settings.schedule, plan.original, plan.target)
        before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
        summary = fine_tune(model, tokenizer, plan, use_positions)
    finally:
        plan.release()
    return plan, model, before, summary


def _log(plan) -> list[dict]:
    return [json.loads(line) for line in (plan.partial / "log.jsonl").read_text().splitlines() if line.strip()]


def test_a_lora_stage_trains_only_the_adapters_and_sums_its_log(tiny_model, text_dir, tmp_path):  # noqa: F811
    plan, model, before, summary = _stage(tiny_model, text_dir, tmp_path, "--eval-every", "2", "--seed", "3")
    log = _log(plan)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    # every row is a full window of long documents: WINDOW - 1 predicted tokens per row, BATCH rows per step
    assert [r["tokens"] for r in log] == [BATCH * (WINDOW - 1)] * STEPS
    evals = [r.get("eval_loss") for r in log]
    assert evals[0] is None and evals[2] is None and None not in (evals[1], evals[3])  # steps 2 and 4
    assert summary["steps"] == STEPS and summary["tokens"] == STEPS * BATCH * (WINDOW - 1)
    assert summary["tokens_per_step"] == BATCH * (WINDOW - 1)
    assert summary["final_loss"] == log[-1]["loss"] and summary["eval_loss"] == evals[3]
    assert summary["peak_memory_gb"] == max(r["peak_memory_gb"] or 0.0 for r in log)
    assert (summary["training"], summary["lr"], summary["seed"]) == ("lora", 1e-3, 3)
    assert isinstance(summary["data_fingerprint"], str) and summary["data_fingerprint"]
    assert (plan.partial / "checkpoint" / "state.json").exists()
    # the adapters: in every block (--lora-layers -1), the only trainable parameters, and trained
    loras = lora_modules(model)
    assert len(loras) == 2 * PROJECTIONS
    assert {k for k, _ in tree_flatten(model.trainable_parameters())} == {f"{n}.lora_{ab}" for n, _ in loras
                                                                         for ab in "ab"}
    assert all(np.any(np.array(m.lora_b)) for _, m in loras)  # B starts at zero; training moved it
    after = {k.replace(".linear.", "."): np.array(v) for k, v in tree_flatten(model.parameters())
             if ".lora_" not in k}
    assert set(after) == set(before)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


def test_a_full_stage_trains_every_weight(tiny_model, text_dir, tmp_path):  # noqa: F811
    plan, model, before, summary = _stage(tiny_model, text_dir, tmp_path, "--full")
    assert summary["training"] == "full" and summary["steps"] == STEPS and summary["eval_loss"] is None
    assert not lora_modules(model)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert set(trainable) == set(before)
    changed = [k for k, v in trainable.items() if not np.array_equal(np.array(v), before[k])]
    assert "model.embed_tokens.weight" in changed and any(".self_attn.q_proj." in k for k in changed)
    assert summary["final_loss"] == _log(plan)[-1]["loss"]


def test_sampler_none_trains_nothing(tiny_model, tmp_path):  # noqa: F811
    plan, model, before, summary = _stage(tiny_model, tmp_path / "unused", tmp_path, "--sampler", "none")
    assert summary == {} and not lora_modules(model) and not plan.partial.exists()
    after = dict(tree_flatten(model.parameters()))
    assert set(after) == set(before) and all(np.array_equal(np.array(after[k]), before[k]) for k in before)


def test_unreadable_data_files_are_counted_in_one_warning(tiny_model, text_dir, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(text_dir, data)
    (data / "empty.txt").write_text("  \n")
    (data / "binary.txt").write_bytes(b"text\x00with a NUL")
    (data / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    _stage(tiny_model, data, tmp_path, "--steps", "1")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: --data {data}: skipped 2 unreadable files or lines (1 binary, 1 not UTF-8)"]


def test_empty_data_files_are_not_called_unreadable(tiny_model, text_dir, tmp_path, capsys):  # noqa: F811
    """The README's data, the stdlib `email` package, holds an empty __init__.py: it was reported as "skipped 1
    unreadable files"; an empty file has nothing to read, so it costs no warning."""
    data = tmp_path / "data"
    shutil.copytree(text_dir, data)
    (data / "__init__.py").write_text("")
    (data / "blank.md").write_text("\n\n")
    _stage(tiny_model, data, tmp_path, "--steps", "1")
    err = capsys.readouterr().err
    assert "unreadable" not in err and not [line for line in err.splitlines() if line.startswith("warning:")]

