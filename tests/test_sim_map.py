"""The simulator's factor map (`python -m pose_mlx.sim.map`): at --quick size against the grid it must reproduce,
its recipe read back from the runs' own logs, resume, and the ranking / agreement of a column by hand.

Runtime: ~1.5-2 min on 2 cores (the --quick grid once, then the --quick map at 2x and 8x with two seeds).
"""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from pose_mlx.sim import __main__ as sim
from pose_mlx.sim import map as sim_map
from pose_mlx.sim import map_report
from pose_mlx.sim.map_layout import GRID_NAMES
from pose_mlx.sim.agreement import map_agreement, map_ranking, map_scores, real_block

ROOT = Path(__file__).resolve().parents[1]
REAL_JSON = ROOT / "benchmarks" / "results" / "real_model" / "results.json"


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The --quick grid: the runs the map's 8x cells must reproduce."""
    out = tmp_path_factory.mktemp("grid")
    assert sim.main(["--quick", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def quick(grid, tmp_path_factory):
    out = tmp_path_factory.mktemp("map")
    argv = ["--quick", "--out", str(out), "--factors", "2,8", "--check-against", str(grid / "results.json")]
    assert sim_map.main(argv) == 0
    return out, argv


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]


def test_quick_map_reproduces_the_grid_at_its_factor(quick, grid):
    out, _ = quick
    results, theirs = (json.loads((p / "results.json").read_text()) for p in (out, grid))
    check = results["reproduction"]
    assert check["reproduces"] is True and "why_not" not in check
    rows = {(r["method"], r["seed"], r["measure"]): r for r in check["rows"]}
    # seed 0: every method's perplexity and passkey at Lt; seed 1: the grid's seeded runs' perplexity only
    assert set(rows) == {(m, 0, k) for m in GRID_NAMES for k in ("ppl", "passkey")} | {
        ("pose-yarn", 1, "ppl"), ("full-yarn", 1, "ppl")}
    target = str(theirs["config"]["target"])
    for (method, seed, measure), row in rows.items():
        name = GRID_NAMES[method]
        grid_value = (theirs["runs"][name][measure][target] if seed == 0
                      else theirs["ppl"][name][target]["values"][1])
        assert row["grid"] == grid_value and row["map"] == pytest.approx(grid_value, rel=1e-9)
        assert results["map"]["8"][method]["per_seed"][str(seed)][measure] == row["map"]
    # the same runs: each trains exactly as the grid's (the same losses, update by update)
    for mine, its in (("pose-yarn-8x", "pose-yarn"), ("full-yarn-8x.s1", "full-yarn.s1"), ("adapt", "adapt")):
        losses = [[r["loss"] for r in _log(folder)] for folder in (out / "runs" / mine, grid / "runs" / its)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-6) and len(losses[0]) == theirs["config"]["steps"]


def test_a_grid_that_differs_does_not_reproduce(quick, grid, tmp_path):
    out, argv = quick
    theirs = json.loads((grid / "results.json").read_text())
    target = str(theirs["config"]["target"])
    theirs["runs"]["pose-yarn"]["ppl"][target] *= 1.001  # above PPL_RTOL = 1e-4
    (tmp_path / "results.json").write_text(json.dumps(theirs))
    config = replace(sim_map.parse_config(argv), check_against=str(tmp_path / "results.json"))
    check = map_report.reproduction(config, out)
    assert check["reproduces"] is False
    assert [(r["method"], r["measure"]) for r in check["rows"] if not r["matches"]] == [("pose-yarn", "ppl")]
    assert "DOES NOT REPRODUCE" in map_report.format_check(check)
    theirs["config"]["lr"] = 1.0  # another recipe: nothing to compare
    (tmp_path / "results.json").write_text(json.dumps(theirs))
    check = map_report.reproduction(config, out)
    assert check["reproduces"] is None and check["why_not"] == "made with other settings (lr)"


def test_quick_map_recipe_from_the_runs_own_records(quick):
    out, _ = quick
    results = json.loads((out / "results.json").read_text())
    c = results["config"]
    window, batch = c["window"], c["window_batch"]
    assert results["complete"] is True and c["factors"] == [2, 8] and c["seeds"] == [0, 1]
    for f in (2, 8):
        target = f * window
        for seed, suffix in ((0, ""), (1, ".s1")):
            # the window methods: B sequences of Lc at every factor; full-length: B / f of Lt (L - 1 targets each)
            assert _log(out / "runs" / f"pose-yarn-{f}x{suffix}")[-1]["tokens"] == batch * (window - 1)
            assert _log(out / "runs" / f"full-yarn-{f}x{suffix}")[-1]["tokens"] == batch // f * (target - 1)
            schedule = json.loads((out / "runs" / f"pose-yarn-{f}x{suffix}" / "pose_mlx.json").read_text())
            assert (schedule["schedule"]["schedule"], schedule["schedule"]["target"]) == ("yarn", target)
            # adapt: one plain fine-tuning per seed, extended at load with the factor's target
            ppl = json.loads((out / "eval" / f"adapt-dynamic-{f}x{suffix}.ppl.json").read_text())
            assert ppl["schedule"] == f"dynamic x{f} (--schedule, after plain fine-tuning)"
            assert ppl["model"].endswith(f"runs/adapt{suffix}") and [r["length"] for r in ppl["results"]] == [target]
            for method, entry in results["map"][str(f)].items():
                assert entry["per_seed"][str(seed)]["ppl"] > 1
    assert sorted(p.name for p in (out / "runs").iterdir() if p.name.startswith("adapt")) == ["adapt", "adapt.s1"]
    # the training-free methods' perplexity does not depend on the seed: scored once per factor
    assert not (out / "eval" / "yarn-8x.s1.ppl.json").exists()
    yarn = results["map"]["8"]["yarn"]["per_seed"]
    assert yarn["0"]["ppl"] == yarn["1"]["ppl"]
    # passkey: the grid's lengths from the prompt's up (their trials are the grid's), each seed its own keys
    keys = {}
    for seed, suffix in ((0, ""), (1, ".s1")):
        record = json.loads((out / "eval" / f"pose-yarn-8x{suffix}.passkey.json").read_text())
        assert record["seed"] == seed and record["lengths"][-1] == 8 * window
        keys[seed] = [t["key"] for t in record["trials"] if t["length"] == 8 * window]
    assert len(keys[0]) == c["passkey_trials_per_seed"] and keys[0] != keys[1]
    # no passkey where the prompt does not fit in Lt (2x at toy size): None, not 0
    assert results["map"]["2"]["yarn"]["passkey"] is None and results["map"]["8"]["yarn"]["passkey"] is not None
    for f, column in results["map"].items():
        for entry in column.values():
            assert entry["ppl"] == pytest.approx(sum(s["ppl"] for s in entry["per_seed"].values()) / 2)
    for f, column in results["map"].items():  # the ranking of each column: by the means, best first
        by_ppl = sorted(column, key=lambda m: column[m]["ppl"])
        assert [m for tied in results["ranking"][f]["ppl"] for m in tied] == by_ppl
    # the quick map's factors are 2 and 8: the real model has no 2x block, and its 8x block (registered, waiting
    # for its trials) has no measured run yet, so there is nothing to rank against
    assert set(results["agreement"]) <= {"8"}
    assert all(a["methods"] == [] and a["ppl_tau"] is None for a in results["agreement"].values())
    assert set(results["stage_seconds"]) >= {"finetune adapt", "evaluate pose-yarn-8x.s1"}
    for png in ("passkey.png", "ppl.png"):
        assert (out / png).stat().st_size > 5000


def test_rerun_is_cached_and_report_writes_elsewhere(quick, tmp_path, capsys):
    out, argv = quick
    before = (out / "results.json").read_text()
    assert sim_map.main(argv) == 0
    printed = capsys.readouterr().out
    assert ": running" not in printed and "REPRODUCES" in printed
    assert (out / "results.json").read_text() == before
    assert sim_map.main(argv + ["--report", str(tmp_path / "report")]) == 0
    assert json.loads((tmp_path / "report" / "results.json").read_text())["map"] == json.loads(before)["map"]
    assert (tmp_path / "report" / "ppl.png").is_file()


def test_a_report_of_an_unfinished_run_leaves_cells_out(quick, tmp_path):
    out, argv = quick
    partial = tmp_path / "partial"
    shutil.copytree(out, partial, symlinks=True)
    (partial / "eval" / "full-yarn-8x.s1.ppl.json").unlink()
    (partial / "eval" / "full-yarn-8x.s1.passkey.json").unlink()
    # YaRN-only's perplexity is shared by the seeds: without seed 1's passkey, its seed 1 is not measured yet
    (partial / "eval" / "yarn-8x.s1.passkey.json").unlink()
    table = map_report.collect(sim_map.parse_config(argv), partial)
    for method in ("full-yarn", "yarn"):
        assert set(table["8"][method]["per_seed"]) == {"0"}
        assert table["8"][method]["ppl"] == table["8"][method]["per_seed"]["0"]["ppl"]
        assert table["8"][method]["passkey"] == table["8"][method]["per_seed"]["0"]["passkey"]
    assert set(table["2"]["yarn"]["per_seed"]) == {"0", "1"}  # no passkey at 2x (toy size): perplexity is all


@pytest.mark.parametrize("flags, message", [
    (["--factors", "3"], "--factors: 3 must be >= 2 and divide the 32"),
    (["--factors", "64"], "--factors: 64 must be >= 2 and divide"),
    (["--factors", "2,x"], "--factors: a comma-separated list of integers"),
    (["--seeds", "0,0"], "--seeds: 0,0 lists a value twice"),
    (["--check-against", "nowhere.json"], "--check-against nowhere.json: no such file"),
])
def test_bad_flags_are_one_line_and_create_nothing(tmp_path, capsys, flags, message):
    assert sim_map.main(["--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_report_of_nothing_is_a_user_error(tmp_path, capsys):
    assert sim_map.main(["--out", str(tmp_path / "none"), "--report", str(tmp_path / "r")]) == 2
    assert "holds no map run yet" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_blocks_put_the_grid_factor_of_the_first_seed_first():
    config = sim_map.parse_config(["--factors", "2,4,8,16", "--seeds", "0,1"])
    assert sim_map.blocks(config) == [(0, 8), (0, 2), (0, 4), (0, 16), (1, 2), (1, 4), (1, 8), (1, 16)]
    assert [config.full_batch(f) for f in (2, 4, 8, 16)] == [16, 8, 4, 2]  # 4096 tokens per update each
    no_grid_factor = sim_map.parse_config(["--factors", "2,4", "--seeds", "1"])
    assert sim_map.blocks(no_grid_factor) == [(1, 2), (1, 4)]


# ranking and agreement of one column, by hand


def _map(ppl: dict, passkey: dict, factor: int = 8) -> dict:
    methods = list(ppl)
    return {"config": {"methods": methods, "targets": {str(factor): factor * 128}},
            "map": {str(factor): {m: {"ppl": ppl[m], "passkey": passkey[m], "per_seed": {}} for m in methods}}}


def _real_runs(ppl: dict, passkey: dict, target: int) -> dict:
    return {m: {"ppl": {str(target): ppl[m]}, "passkey": {str(target): passkey[m]}} for m in ppl}


MAP_PPL = {"yarn": 12.0, "dynamic": 11.0, "adapt-yarn": 10.0, "pose-yarn": 8.0, "full-yarn": 7.5}
MAP_PASSKEY = {"yarn": 0.5, "dynamic": 0.5, "adapt-yarn": 0.2, "pose-yarn": 0.0, "full-yarn": None}


def test_map_ranking_groups_ties_and_skips_unmeasured():
    table = _map(MAP_PPL, MAP_PASSKEY)
    assert map_ranking(table, 8) == {"ppl": [["full-yarn"], ["pose-yarn"], ["adapt-yarn"], ["dynamic"], ["yarn"]],
                                     "passkey": [["yarn", "dynamic"], ["adapt-yarn"], ["pose-yarn"]]}
    assert map_scores(table, 4, "ppl") == {}  # no such column


def test_map_agreement_by_hand():
    real = {"original": 8192, "target": 32768, "runs": {}}
    # the 8x block: perplexity swaps dynamic and adapt-yarn (1 discordant pair of the 4 methods both measured on
    # both measures: full-yarn has no passkey in the map, no run in the real model) -> (5 - 1) / 6
    # passkey: map yarn = dynamic (tied in x); real dynamic = adapt-yarn (tied in y); the other 4 pairs concordant:
    # tau-b = 4 / sqrt((6 - 1) (6 - 1)) = 0.8
    real["factor_8x"] = {"target": 65536, "runs": _real_runs(
        {"yarn": 30.0, "dynamic": 9.0, "adapt-yarn": 9.5, "pose-yarn": 6.0},
        {"yarn": 0.9, "dynamic": 0.6, "adapt-yarn": 0.6, "pose-yarn": 0.1}, 65536)}
    a = map_agreement(_map(MAP_PPL, MAP_PASSKEY), real, 8)
    assert a["methods"] == ["yarn", "dynamic", "adapt-yarn", "pose-yarn"]
    assert a["ppl_tau"] == pytest.approx(4 / 6) and a["passkey_tau"] == pytest.approx(0.8)
    assert (a["sim_target"], a["real_target"], a["holds"]) == (1024, 65536, False)
    assert a["real"]["ppl"]["dynamic"] == 9.0 and a["sim"]["passkey"]["yarn"] == 0.5
    assert map_agreement(_map(MAP_PPL, MAP_PASSKEY), real, 16) is None  # no 16x block
    # a block of runs alone: the target is the factor times the real window
    real["factor_8x"] = real["factor_8x"]["runs"]
    assert real_block(real, 8)["target"] == 65536
    assert map_agreement(_map(MAP_PPL, MAP_PASSKEY), real, 8)["ppl_tau"] == pytest.approx(4 / 6)


def test_the_committed_real_model_is_the_4x_block():
    real = json.loads(REAL_JSON.read_text())
    assert real_block(real, 4) is real
    if "factor_8x" not in real:
        assert real_block(real, 8) is None
    table = _map({"yarn": 10.6, "dynamic": 12.1, "adapt-yarn": 11.2, "adapt-dynamic": 12.5, "pose-yarn": 8.1},
                 {"yarn": 0.3, "dynamic": 0.0, "adapt-yarn": 0.05, "adapt-dynamic": 0.0, "pose-yarn": 0.45}, 4)
    a = map_agreement(table, real, 4)
    assert a["real_target"] == 32768 and a["methods"] == ["yarn", "dynamic", "adapt-yarn", "adapt-dynamic",
                                                          "pose-yarn"]
    # the real model's numbers are those `agreement` uses for the grid (its confirmation stage where it has it)
    assert a["real_source"]["pose-yarn"]["ppl"].startswith("pose-yarn-lr3e-5")
    assert all(math.isfinite(a[k]) for k in ("ppl_tau", "passkey_tau"))
