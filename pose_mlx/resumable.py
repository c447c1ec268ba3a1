"""Evaluations that survive an interruption: `<output>.partial.jsonl` holds what a run has finished so far.

The file's first line is a header naming the run (model, schedule, lengths, samples, seed, ...), every other line
one finished record (a dataclass as JSON). A run started again with the same header takes the records up and
runs only the rest; a different header, or no file, starts over. The file is removed once the run's output is
written. Used by `pose_mlx.passkey` (one record per trial) and `pose_mlx.ruler` (one per sample), whose long
prompts take minutes each on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from .words import counted


class RecordLog:
    def __init__(self, output: Path, header: dict, record_type: type):
        self.path = Path(output).with_name(Path(output).name + ".partial.jsonl")
        self.header = json.loads(json.dumps(header))  # as it reads back from the file
        self.record_type = record_type

    def load(self) -> list:
        """The records of an interrupted run with the same header ([] when none; a torn last line is ignored)."""
        header, rows = read_partial(self.path)
        if header is None or header != self.header:
            return []
        records = []
        for row in rows:
            try:
                records.append(self.record_type(**row))
            except TypeError:
                break
        return records

    @contextlib.contextmanager
    def resumed(self, prog: str, noun: str, total: int) -> Iterator[list]:
        """Yields the records taken up from an interrupted run (said on stderr) with the file restarted from
        them; on Ctrl-C, says how many finished records (a `noun`, "trial") the file keeps before the interrupt
        goes on."""
        done = self.load()
        if done:
            print(f"taking up {len(done)} of {counted(total, noun)} from {self.path} (an interrupted run)",
                  file=sys.stderr)
        self.start(done)
        try:
            yield done
        except KeyboardInterrupt:
            kept = len(self.load())
            print(f"{prog}: {counted(kept, 'finished ' + noun)} {'is' if kept == 1 else 'are'} kept in {self.path}: "
                  f"the same command takes {'it' if kept == 1 else 'them'} up", file=sys.stderr)
            raise

    def start(self, records: list) -> None:
        """Write the header and the `records` taken up."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(x) + "\n" for x in [self.header, *map(asdict, records)]))

    def append(self, record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def read_partial(path: Path) -> tuple[dict | None, list]:
    """(header, finished records as read from JSON) of a `.partial.jsonl` file, whoever wrote it: (None, []) when
    the file is missing or its header unreadable; reading stops at the first unreadable line (a torn last line)."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.is_file() else []
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        return None, []
    rows = []
    for line in lines[1:]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return header, rows


__all__ = ["RecordLog", "read_partial"]
