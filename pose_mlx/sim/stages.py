"""Cached stages with a progress line each: '[k/n] name: done in 12 s; ETA 3 min' or '... cached'.

ETA = (seconds per unit of estimated work, measured over the stages this process ran) x the work left.
With a `record` file, each stage's own time is kept when it runs (JSON {stage: seconds}), so a run that went in
parts still knows what it cost from scratch: `recorded()` sums every stage once, whichever process ran it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from ..files import write_atomic


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Stages:
    def __init__(self, weights: dict[str, float], stream=None, record: Path | None = None):
        if any(w <= 0 for w in weights.values()):
            raise ValueError("weights must be positive")
        self.weights, self.stream = dict(weights), stream or sys.stdout
        self.done: set[str] = set()
        self.seconds = self.work = 0.0
        self.record = None if record is None else Path(record)
        self.times: dict[str, float] = (json.loads(self.record.read_text())
                                        if self.record is not None and self.record.is_file() else {})

    def recorded(self) -> tuple[float, list[str]]:
        """(seconds of every stage as recorded when it ran, the stages that have no recorded time)."""
        return (sum(self.times[n] for n in self.weights if n in self.times),
                [n for n in self.weights if n not in self.times])

    def eta(self) -> float | None:
        left = sum(w for n, w in self.weights.items() if n not in self.done)
        return None if self.work == 0 else self.seconds / self.work * left

    def reuse(self, name: str, seconds: float | None, source: str) -> None:
        """Take stage `name`'s output from `source` (an earlier run) instead of running it; its recorded time, if
        any, counts as this run's (`recorded()`), as a cached stage's does."""
        index = list(self.weights).index(name) + 1
        if seconds is not None:
            self.times[name] = seconds
        self.done.add(name)
        print(f"[{index}/{len(self.weights)}] {name}: taken from {source}", file=self.stream, flush=True)

    def run(self, name: str, cached: Callable[[], bool], fn: Callable[[], object]) -> None:
        """Run `fn` unless `cached()` says its output exists; print one progress line either way."""
        index = list(self.weights).index(name) + 1
        head = f"[{index}/{len(self.weights)}] {name}"
        if cached():
            self.done.add(name)
            print(f"{head}: cached", file=self.stream, flush=True)
            return
        print(f"{head}: running", file=self.stream, flush=True)
        t0 = time.perf_counter()
        fn()
        spent = time.perf_counter() - t0
        self.times[name] = spent
        if self.record is not None:
            write_atomic(self.record, json.dumps(self.times, indent=1) + "\n")
        self.done.add(name)
        self.seconds += spent
        self.work += self.weights[name]
        eta = self.eta()
        print(f"{head}: done in {_duration(spent)}; ETA {_duration(eta) if eta is not None else '?'}",
              file=self.stream, flush=True)
