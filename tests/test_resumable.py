"""pose_mlx.resumable: what a `.partial.jsonl` file gives back, written by hand line by line."""

import json
from dataclasses import dataclass

from pose_mlx.resumable import RecordLog, read_partial


@dataclass
class Trial:
    depth: float
    correct: bool


def _write(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_records_are_read_up_to_a_torn_line_and_taken_up_only_under_the_same_header(tmp_path):
    log = RecordLog(tmp_path / "out.json", {"model": "a", "trials": 3}, Trial)
    assert log.path.name == "out.json.partial.jsonl" and read_partial(log.path) == (None, []) and log.load() == []
    rows = [json.dumps({"depth": 1.0, "correct": True}), json.dumps({"depth": 0.5, "correct": False})]
    _write(log.path, json.dumps({"model": "a", "trials": 3}), *rows, '{"depth": 0.0, "corr')
    assert read_partial(log.path) == ({"model": "a", "trials": 3},
                                      [{"depth": 1.0, "correct": True}, {"depth": 0.5, "correct": False}])
    assert log.load() == [Trial(1.0, True), Trial(0.5, False)]
    # another run's file (here another model folder): readable, but not this run's to take up
    assert RecordLog(tmp_path / "out.json", {"model": "b", "trials": 3}, Trial).load() == []
    # a record of another shape ends what can be taken up, as a torn line does
    _write(log.path, json.dumps({"model": "a", "trials": 3}), rows[0], json.dumps({"depth": 0.2}), rows[1])
    assert log.load() == [Trial(1.0, True)] and len(read_partial(log.path)[1]) == 3
    _write(log.path, "{not json", *rows)
    assert read_partial(log.path) == (None, []) and log.load() == []
