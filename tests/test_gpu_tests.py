"""benchmarks.gpu_tests: the suite dealt into shards (by hand), a shard's record and when it counts, and a dry run of
one small shard end to end."""

import json

import pytest

from benchmarks import gpu_tests
from pose_mlx.errors import UserError


def test_shards_deal_the_largest_files_first_onto_the_lightest_shard():
    counts = {"tests/a.py": 50, "tests/b.py": 40, "tests/c.py": 30, "tests/d.py": 20, "tests/e.py": 10,
              "tests/f.py": 10}
    # a -> 0 (50); b -> 1 (40); c -> 1 (70); d -> 0 (70); e -> 0 (80, tie to the lower shard); f -> 1 (80)
    assert gpu_tests.shards(counts, 2) == [["tests/a.py", "tests/d.py", "tests/e.py"],
                                           ["tests/b.py", "tests/c.py", "tests/f.py"]]
    dealt = gpu_tests.shards(counts, 3)
    assert sorted(f for shard in dealt for f in shard) == sorted(counts) and len(dealt) == 3
    assert gpu_tests.shards(dict(reversed(counts.items())), 3) == dealt  # the same from any order


def test_a_shard_counts_once_a_complete_gpu_record_of_it_exists(tmp_path):
    def record(i, **kw):
        base = {"files": [f"tests/{i}.py"], "device": "Device(gpu, 0)", "dry_run": False, "complete": True,
                "passed": 10, "failed": 1, "skipped": 2, "errors": 0, "failed_names": [f"tests/{i}.py::t"]}
        gpu_tests.record_path(i, 2, tmp_path).write_text(json.dumps({**base, **kw}))

    assert gpu_tests.shard_pending(1, 2, tmp_path) == "not run on a GPU yet"
    record(1, device="Device(cpu, 0)")
    assert gpu_tests.shard_pending(1, 2, tmp_path) == "its record is not a GPU's"
    record(1, complete=False)
    assert gpu_tests.shard_pending(1, 2, tmp_path) == "its last run was stopped before the end"
    record(1)
    assert gpu_tests.shard_pending(1, 2, tmp_path) is None
    assert gpu_tests.summary(2, tmp_path)["complete"] is False  # one shard of two
    record(2)
    assert gpu_tests.summary(2, tmp_path) == {"passed": 20, "failed": 2, "skipped": 4, "errors": 0, "shards": 2,
                                              "failed_names": ["tests/1.py::t", "tests/2.py::t"], "complete": True}
    with pytest.raises(UserError, match="I/K"):
        gpu_tests.parse_shard("3/2")


def test_a_dry_run_shard_runs_its_files_and_records_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_tests, "collect", lambda: {"tests/test_rope_schedules.py": 40, "tests/test_stats.py": 30})
    assert gpu_tests.main(["--shard", "2/2", "--dry-run", "--workers", "0", "--output", str(tmp_path)]) == 0
    record = json.loads(gpu_tests.record_path(2, 2, tmp_path).read_text())
    assert record["files"] == ["tests/test_stats.py"] and record["complete"] and record["dry_run"]
    assert record["passed"] > 0 and record["failed"] == 0 and record["shard"] == [2, 2]
    assert "test_stats.py" in gpu_tests.record_path(2, 2, tmp_path).with_suffix(".log").read_text()
    assert "shard 2/2:" in capsys.readouterr().out
