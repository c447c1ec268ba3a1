"""Cached stages with a progress line each: '[k/n] name: done in 12 s; ETA 3 min' or '... cached'.

ETA = (seconds per unit of estimated work, measured over the stages this process ran) x the work left.
"""

from __future__ import annotations

import sys
import time
from typing import Callable


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Stages:
    def __init__(self, weights: dict[str, float], stream=None):
        if any(w <= 0 for w in weights.values()):
            raise ValueError("weights must be positive")
        self.weights, self.stream = dict(weights), stream or sys.stdout
        self.done: set[str] = set()
        self.seconds = self.work = 0.0

    def eta(self) -> float | None:
        left = sum(w for n, w in self.weights.items() if n not in self.done)
        return None if self.work == 0 else self.seconds / self.work * left

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
        self.done.add(name)
        self.seconds += spent
        self.work += self.weights[name]
        eta = self.eta()
        print(f"{head}: done in {_duration(spent)}; ETA {_duration(eta) if eta is not None else '?'}",
              file=self.stream, flush=True)
