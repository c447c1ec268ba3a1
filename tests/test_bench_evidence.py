"""benchmarks/bench_evidence.py's scheduler: every task runs, failures are retried once alone, and the tasks that
still fail come back (the screening evaluates only the candidates whose fine-tuning did not fail)."""

import threading

from benchmarks.bench_evidence import run_all


def test_run_all_retries_failures_once_alone_and_returns_what_still_fails(capsys):
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def task(name: str, fails: int) -> str:
        with lock:
            calls[name] = calls.get(name, 0) + 1
            n = calls[name]
        if n <= fails:
            raise SystemExit(f"{name} failed (try {n})")
        return f"{name} ok"

    failed = run_all([("a", 0), ("b", 1), ("c", 2)], task, jobs=2, label=1)
    assert failed == [("c", 2)]
    assert calls == {"a": 1, "b": 2, "c": 2}  # b succeeds on its retry, c fails twice
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["a: a ok", "b: FAILED: b failed (try 1)", "c: FAILED: c failed (try 1)"]
    assert out[3:] == ["b: b ok", "c: FAILED: c failed (try 2)"]


def test_run_all_with_one_job_tries_each_task_once():
    calls = []

    def task(name: str) -> str:
        calls.append(name)
        raise RuntimeError("no memory")

    assert run_all([("x",), ("y",)], task, jobs=1, label=1) == [("x",), ("y",)]
    assert calls == ["x", "y"]
