"""The simulator's grid (`pose_mlx.sim.grid`): the runs it declares, the finetune settings each becomes (checked
against what `pose_mlx.finetune`'s own command line makes of the same run), and what it reads back."""

import json
from collections import Counter

import pytest

from pose_mlx.settings import parse_invocation
from pose_mlx.sim import grid, report
from pose_mlx.sim.__main__ import SEEDED
from pose_mlx.sim.grid import Run, collect, cost, finetune_settings, grid_runs, load_schedule

SIZES = dict(window=32, factor=8, steps=10, cost_steps=3, full_batch=2, lr=1e-3, seed=0)


def test_every_declared_run_is_in_the_grid_once():
    runs = grid_runs(8)
    names = [r.name for r in runs]
    assert not [n for n, k in Counter(names).items() if k > 1]
    # the runs the report, RULER, the seeds and the claims name are all in the grid
    named = {n for _, _, table in report.TABLES for n in table} | set(report.NLL_RUNS) | set(report.HEATMAP_RUNS)
    assert named | set(grid.RULER_RUNS) | set(SEEDED) <= set(names)
    # the cost runs: PoSE and full-length at Lt = 2 Lc, 4 Lc ... the target, nothing beyond
    cost_runs = sorted((r.sampler, r.factor) for r in runs if r.cost_only)
    assert cost_runs == sorted((s, f) for s in ("pose", "full") for f in (2, 4, 8))
    assert [r.factor for r in grid_runs(4) if r.cost_only] == [2, 2, 4, 4]
    assert all(r.factor is None for r in runs if not r.cost_only)


@pytest.mark.parametrize("name, sampler, schedule, chunks, content, params", [
    ("original", "none", "none", 2, "uniform", ""),
    ("only-ntk", "none", "ntk", 2, "uniform", ""),
    ("pose-yarn", "pose", "yarn", 2, "uniform", ""),
    ("full-linear", "full", "linear", 2, "uniform", ""),
    ("pose-linear-n3", "pose", "linear", 3, "uniform", ""),
    ("pose-linear-aligned", "pose", "linear", 2, "aligned", ""),
    ("adapt-dynamic", "plain", "dynamic", 2, "uniform", ""),
    ("pose-yarn-notemp", "pose", "yarn", 2, "uniform", "attention_factor=1"),
])
def test_a_run_has_the_settings_its_name_says(name, sampler, schedule, chunks, content, params):
    (run,) = [r for r in grid_runs(8) if r.name == name]
    assert (run.sampler, run.schedule, run.chunks, run.content, run.params) == (sampler, schedule, chunks, content,
                                                                                params)
    assert run.folder == ("adapt" if sampler == "plain" else name)  # the adapt-* controls share one fine-tuning
    spec = run.spec()
    assert spec["scaling"] == schedule and ("params" in spec) == bool(params)


def _argv(run: Run, tmp_path, output, **s) -> list[str]:
    """The `pose_mlx.finetune` command line of `run`, written out by hand from the grid's rules (module docstring):
    the reference the typed settings are checked against."""
    f = run.factor or s["factor"]
    argv = ["--model", str(tmp_path / "base"), "--original", str(s["window"]), "--target", f"{f}x", "--schedule",
            "none" if run.sampler == "plain" else run.schedule, "--sampler", run.sampler, "--output", str(output)]
    for p in filter(None, run.params.split(",")):
        argv += ["--schedule-param", p]
    if run.sampler == "none":
        return argv
    batch = s["full_batch"] if run.sampler == "full" or run.cost_only else s["full_batch"] * f
    return argv + ["--full", "--data", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"), "--chunks",
                   str(run.chunks), "--content", run.content, "--steps",
                   str(s["cost_steps"] if run.cost_only else s["steps"]), "--batch-size", str(batch), "--lr",
                   str(s["lr"]), "--warmup", "1", "--seed", str(s["seed"]), "--save-every", "2", "--no-progress"]


def test_each_run_becomes_the_settings_its_command_line_would(tmp_path):
    for run in grid_runs(8):
        output = tmp_path / "runs" / run.folder
        typed = finetune_settings(run, tmp_path / "base", tmp_path / "data", tmp_path / "cache", output, **SIZES)
        assert typed.settings == parse_invocation(_argv(run, tmp_path, output, **SIZES)).settings, run.name
        assert not typed.resume and not typed.overwrite


def test_every_trained_run_updates_on_the_same_number_of_tokens(tmp_path):
    """full_batch rows of Lt tokens (full-length) or full_batch * Lt / Lc rows of Lc (the others); the cost runs
    full_batch rows each, of Lc (PoSE) or Lt (full-length) tokens."""
    target = SIZES["factor"] * SIZES["window"]
    for run in grid_runs(8):
        if run.sampler == "none":
            continue
        s = finetune_settings(run, tmp_path, tmp_path, tmp_path, tmp_path / run.folder, **SIZES).settings
        row = target if run.sampler == "full" else SIZES["window"]
        if run.cost_only:
            assert s.batch_size == SIZES["full_batch"] and s.steps == SIZES["cost_steps"]
        else:
            assert s.batch_size * row == SIZES["full_batch"] * target and s.steps == SIZES["steps"]


def test_an_unfinished_run_is_resumed_and_a_broken_one_started_over(tmp_path):
    (run,) = [r for r in grid_runs(8) if r.name == "pose-linear"]
    output = tmp_path / "pose-linear"

    def invocation():
        return finetune_settings(run, tmp_path, tmp_path, tmp_path, output, **SIZES)

    partial = tmp_path / "pose-linear.partial"
    partial.mkdir()  # killed before run.json was written: nothing to resume
    assert (invocation().resume, invocation().overwrite) == (False, True)
    (partial / "run.json").write_text("{}")
    assert (invocation().resume, invocation().overwrite) == (True, False)


def test_the_plain_runs_are_extended_at_load_the_others_by_their_folder():
    runs = {r.name: r for r in grid_runs(8)}
    assert load_schedule(runs["adapt-yarn"], 8) == ("yarn", "8x")
    assert load_schedule(runs["pose-yarn"], 8) == load_schedule(runs["original"], 8) == (None, None)


def test_cost_and_collect_read_the_commands_outputs(tmp_path):
    log = [{"seconds": s, "peak_memory_gb": m, "tokens": 62, "loss": l}
           for s, m, l in ((9.0, 0.5, 4.0), (1.0, 0.7, 3.5), (3.0, 0.6, 3.0), (2.0, 0.6, 2.5))]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log) + "\n")
    # the first update (which compiles) left out of the median: median(1, 3, 2) = 2
    assert cost(tmp_path) == {"seconds_per_step": 2.0, "peak_memory_gb": 0.7, "tokens_per_step": 62,
                              "final_loss": 2.5, "steps": 4}
    assert cost(tmp_path / "untrained") is None
    ppl, key = tmp_path / "p.json", tmp_path / "k.json"
    ppl.write_text(json.dumps({"results": [{"length": 32, "ppl": 7.5}, {"length": 64, "ppl": 9.25}]}))
    key.write_text(json.dumps({"accuracy": [{"length": 64, "accuracy": 0.4}]}))
    (run,) = [r for r in grid_runs(8) if r.name == "pose-linear"]
    entry = collect(run, tmp_path, ppl, key)
    assert entry == {"spec": run.spec(), "cost": cost(tmp_path), "ppl": {"32": 7.5, "64": 9.25},
                     "passkey": {"64": 0.4}}
    assert collect(run, tmp_path, None, tmp_path / "missing.json")["passkey"] == {}
