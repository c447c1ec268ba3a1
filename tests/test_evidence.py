"""The one-line pointer to the evidence that plan prints: it comes from the committed record
(benchmarks/results/real_model/results.json), not from typed-in numbers, and picks the block measured nearest the
requested extension factor."""

import copy
import json
from pathlib import Path

import pytest

from pose_mlx import evidence

ROOT = Path(__file__).resolve().parents[1]
LINE_4X = ("at 4x (SmolLM2-135M-Instruct, 8k -> 32k) training-free dynamic NTK retrieved the passkey as well as "
           "PoSE + YaRN; PoSE + YaRN gave the lowest 32k perplexity among the runs that retrieved as well - "
           "docs/evidence.md")


def _record() -> dict:
    return json.loads((ROOT / evidence.RECORD).read_text())


def test_the_shipped_summary_is_the_records():
    """pose_mlx/evidence.json is what `python -m experiments.evidence_summary` makes of the record today."""
    assert json.loads(evidence.SHIPPED.read_text()) == evidence.summarize(_record(), ROOT)


def test_the_4x_line_says_what_the_record_says():
    """Checked against the record itself: dynamic NTK is its best training-free run and no registered passkey test
    tells it from the headline PoSE + YaRN run; that run's 32k perplexity is the lowest of those the tests do not
    find it better than."""
    record = _record()
    assert (record["best_training_free"], record["headline"]) == ("dynamic", "pose-yarn-lr3e-5")
    against_free = [t["verdict"] for t in record["tests"] if (t["pose"], t["control"]) == (record["headline"],
                                                                                           "dynamic")]
    assert against_free == ["not distinguishable", "not distinguishable"]
    ppl = {run: record["runs"][run]["ppl"]["32768"] for run in ("pose-yarn-lr3e-5", "dynamic", "adapt-dynamic")}
    assert min(ppl, key=ppl.get) == "pose-yarn-lr3e-5"
    assert evidence.pointer(4.0) == "evidence: " + LINE_4X


def _with_8x(record: dict) -> dict:
    """The record with a future 8x block: the 4x block's schema at target 65536, where the training-free run
    retrieved better and the YaRN control had the lowest perplexity."""
    block = copy.deepcopy({k: v for k, v in record.items() if not k.startswith("factor_")})
    block["target"] = 65536
    for test in block["tests"]:
        if (test["pose"], test["control"]) == (block["headline"], "dynamic"):
            test["verdict"] = "worse"
        if test["pose"] == block["headline"] and test["control"] == "adapt-yarn":
            test["verdict"] = "not distinguishable"
    for run in block["runs"].values():
        run.setdefault("ppl", {})["65536"] = 9.0
    block["runs"]["adapt-yarn"]["ppl"]["65536"] = 4.0
    return {**record, "factor_8x": block}


@pytest.mark.parametrize("factor, chosen", [(2, 4), (4, 4), (5.5, 4), (6, 8), (8, 8), (16, 8)])
def test_the_block_nearest_the_factor_is_chosen(factor, chosen):
    """Nearest in ratio: 6x is 1.33x from 8x and 1.5x from 4x."""
    summary = evidence.summarize(_with_8x(_record()), ROOT)
    assert [b["factor"] for b in summary["blocks"]] == [4.0, 8.0]
    line = evidence.pointer(factor, summary)
    if chosen == 4:
        assert line.endswith(LINE_4X)
    else:
        assert line.endswith("at 8x (SmolLM2-135M-Instruct, 8k -> 64k) training-free dynamic NTK retrieved the "
                             "passkey better than PoSE + YaRN; fine-tuning without PoSE + YaRN gave the lowest 64k "
                             "perplexity among the runs that retrieved as well - docs/evidence.md")
    assert line.startswith("evidence: " if factor == chosen else f"evidence (the measured factor nearest {factor:g}x)")


def test_only_the_4x_block_serves_every_factor_today():
    for factor in (2, 6, 16):
        assert evidence.pointer(factor).endswith(LINE_4X)


def test_plan_says_the_line_once_after_the_model_line(tmp_path, capsys):
    """`python -m pose_mlx.plan` prints the line once, right after its model line (and puts it in --json); without
    --target, no line. (It was printed before the model line, and by every finetune run as well.)"""
    from pose_mlx import plan

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=1024)))
    assert plan.main(["--model", str(tmp_path), "--target", "16x", "--max-memory", "8G"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: ") and lines[1] == evidence.pointer(16) and lines.count(lines[1]) == 1
    assert plan.main(["--model", str(tmp_path), "--target", "4k", "--max-memory", "8G", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence"] == "evidence: " + LINE_4X
    assert plan.main(["--model", str(tmp_path), "--max-memory", "8G", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evidence"] is None


def test_a_registered_block_waiting_for_its_trials_says_nothing():
    """The 8x block is committed before its trials: it names no best training-free run yet, so the summary and
    the line keep to the measured blocks."""
    record = _record()
    waiting = {**record["factor_8x"], "best_training_free": None}
    assert evidence.summarize({**record, "factor_8x": waiting}, ROOT)["blocks"] == evidence.summarize(
        {k: v for k, v in record.items() if k != "factor_8x"}, ROOT)["blocks"]
