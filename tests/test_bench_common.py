"""benchmarks.common: the results record, the fine-tuning command the real-model benchmarks build (read back by the
product's own planner), and the per-update clocks of the pose_mlx-vs-mlx-lm runs against hand-computed values."""

import datetime
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]


def test_write_results_adds_the_run_record_and_the_results_win(tmp_path):
    path = common.write_results("probe", {"answer": 42, "python": "given"}, tmp_path / "deeper" / "probe.json")
    assert path == tmp_path / "deeper" / "probe.json"
    record = json.loads(path.read_text())
    assert record["benchmark"] == "probe" and record["answer"] == 42
    assert record["python"] == "given"  # a result's key wins over the metadata's
    assert record["mlx_version"] == metadata.version("mlx") and record["mlx_lm_version"] == metadata.version("mlx-lm")
    date = datetime.datetime.fromisoformat(record["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 3600


def test_default_results_path_is_benchmarks_results(monkeypatch, tmp_path):
    assert common.RESULTS_DIR == ROOT / "benchmarks" / "results"
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)  # write_results reads it at call time
    assert common.write_results("named", {"x": 1}) == tmp_path / "named.json"
    assert json.loads((tmp_path / "named.json").read_text())["x"] == 1


@pytest.mark.parametrize("extra", [
    dict(schedule="yarn", window=1024, steps=40, lr=3e-5, rank=16),
    dict(schedule="linear", window=512, steps=7, lr=1e-4, rank=8, warmup=0, sampler="plain", batch_size=2, seed=3,
         original=4096, target=16384, schedule_params={"factor": 4.0}),
])
def test_finetune_command_is_read_back_by_the_planner(tmp_path, extra):
    """`python -m pose_mlx.plan` takes the fine-tuning flags: it accepts every flag the builder writes (nothing
    ignored or refused) and plans the window, target, batch, LoRA rank and sampler that were asked for."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192, tie_word_embeddings=True,
        torch_dtype="float32")))
    cmd = common.finetune_command(model, tmp_path / "train", tmp_path / "work", tmp_path / "out", **extra)
    assert cmd[0] == "pose_mlx.finetune"
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.plan", *cmd[1:], "--json"], capture_output=True,
                          text=True, cwd=ROOT, env=common.child_env(), timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    settings = json.loads(proc.stdout)["settings"]
    assert settings["window"] == extra["window"] and settings["lora_rank"] == extra["rank"] and settings["lora"]
    assert settings["target"] == extra.get("target", common.TARGET)
    assert settings["batch_size"] == extra.get("batch_size", 1) and settings["sampler"] == extra.get("sampler", "pose")
    given = dict(zip(cmd[1::], cmd[2::]))
    assert given["--warmup"] == str(extra.get("warmup", max(1, extra["steps"] // 20)))
    assert given["--original"] == str(extra.get("original", common.ORIGINAL))


def test_periods_spread_a_skipped_report_over_its_updates():
    """Reports of updates 1, 2 and 4 (3's skipped, 5 is the last): the 2 -> 4 span counts as two updates of its
    mean; the clocks' differences by hand."""
    marks = {1: (10.0, 5.0, 100), 2: (10.5, 5.4, 103), 4: (11.5, 6.2, 109), 5: (99.0, 99.0, 999)}
    out = common.periods(marks, steps=5)
    assert out["wall"] == pytest.approx([0.5, 0.5, 0.5])
    assert out["cpu"] == pytest.approx([0.4, 0.4, 0.4])
    assert out["switches"] == pytest.approx([3.0, 3.0, 3.0])
    assert common.periods({1: (0.0, None, None), 3: (3.0, None, None)}, steps=4) == {
        "wall": pytest.approx([1.5, 1.5]), "cpu": None, "switches": None}  # off Linux: no CPU clock
    with pytest.raises(SystemExit, match="reports seen only for updates"):
        common.periods({2: (1.0, 1.0, 1)}, steps=5)


def test_a_progress_bar_report_is_marked_when_it_arrives_not_at_the_next_redraw():
    """A tqdm bar writes "\\r" + text: update 1's report is followed 0.1 s later by update 2's, which stays on
    screen 1.5 s before update 3's. The span between the reports of updates 1 and 2 is 0.1 s; marking a report
    only when the next redraw ends its line would make it update 3's 1.5 s."""
    code = ("import json, sys, time\n"
            f"print({common.PROBE!r} + json.dumps({{'gflops': 1.0, 'library': None}}), flush=True)\n"
            "for n, pause in ((0, 0.0), (1, 0.1), (2, 1.5), (3, 0.0)):\n"
            "    sys.stderr.write(f'\\r{n}/3 [00:00<00:00, loss=1.0]'); sys.stderr.flush(); time.sleep(pause)\n"
            "sys.stderr.write('\\n')\n")
    result = common.run_tool([sys.executable, "-c", code], "pose_mlx", SimpleNamespace(threads=0))
    assert sorted(result["marks"]) == [0, 1, 2, 3]
    assert common.periods(result["marks"], steps=3)["wall"][0] < 1.0


def test_own_seconds_of_mlx_lm_come_from_its_report_lines():
    """mlx-lm's per-update lines (update, loss, trend, tokens/s, peak): seconds = batch (window - 1) / tokens/s for
    updates 2 .. steps-1 only."""
    args = SimpleNamespace(batch=2, window=513, steps=4)
    stdout = "\n".join(["  1  3.2 \u25bc  100  0.5k", "  2  3.1 \u25bc  1,024  0.5k", "  3  3.0 \u25b2  2,048  0.5k",
                        "  4  2.9 \u25bc  4,096  0.5k", "Trainable parameters: 1.0% (0.1M/10.0M)"])
    assert common.own_seconds("mlx_lm", {"stdout": stdout}, args, Path(".")) == pytest.approx([1.0, 0.5])


def test_run_logged_stops_a_command_when_the_budget_runs_out(tmp_path, monkeypatch):
    """Under a budget the command gets SIGTERM at its end (`reserve` s before it) and OutOfTime is raised, and the
    process knows a command was stopped; with none left it never starts."""
    import time

    from benchmarks import common
    from benchmarks.common import OutOfTime, run_logged, set_budget

    monkeypatch.setattr(common, "_stopped", [])
    sleeper = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"]
    try:
        set_budget(30.0)
        with pytest.raises(OutOfTime, match="no time left"):
            run_logged(sleeper, tmp_path / "r.log", reserve=30.0)  # all of it reserved: it does not start
        assert common.stopped_by_budget()
        set_budget(1.0)
        t0 = time.monotonic()
        with pytest.raises(OutOfTime):
            run_logged(sleeper, tmp_path / "a.log", grace=5)
        assert time.monotonic() - t0 < 15
        set_budget(0.0)
        with pytest.raises(OutOfTime, match="no time left"):
            run_logged(sleeper, tmp_path / "b.log")
        assert not (tmp_path / "b.log").exists()
        set_budget(None)
        assert run_logged(["timeit", "-n", "1", "-r", "1", "pass"], tmp_path / "c.log") < 15
    finally:
        set_budget(None)
