"""experiments/bench_evidence.py's scheduler: every task runs, failures are retried once alone, and the tasks that
still fail come back (the screening evaluates only the candidates whose fine-tuning did not fail); its status."""

import json
import threading

import pytest

import experiments.bench_evidence as bench
from experiments.bench_evidence import run_all


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


def test_protocol_fine_tunings_carry_their_loss_scale(tmp_path):
    """Every screening candidate's fine-tuning command parses as pose_mlx.finetune settings with the loss scale
    the protocol registers: 1 for the first stage (trained before loss scaling existed), 4096 for `*-scaled`."""
    from experiments.evidence_runs import protocol_finetune
    from experiments.protocol import load_protocol
    from benchmarks.common import ROOT
    from pose_mlx.settings import parse_invocation

    protocol = load_protocol(ROOT / "benchmarks" / "protocols" / "real_model.yaml")
    candidates = protocol["recipe"]["candidates"]
    assert {n for n, c in candidates.items() if c["train"]["loss_scale"] > 1} == {
        n for n in candidates if n.endswith("-scaled")}
    for name, c in candidates.items():
        cmd = protocol_finetune(c["train"], protocol, tmp_path / "m.gguf", tmp_path, tmp_path / "train",
                                tmp_path / name)
        assert cmd[0] == "pose_mlx.finetune"
        settings = parse_invocation(cmd[1:]).settings
        assert settings.loss_scale == c["train"]["loss_scale"], name
        assert settings.sampler == c["train"]["sampler"] and settings.lr == protocol["training"]["lr"]


def test_status_reads_what_an_interrupted_evaluation_left(tmp_path, monkeypatch):
    """`--stage status`: an evaluation is done (with its record's device), partly done (the records that
    pose_mlx's RecordLog kept for an interrupted run at the output evaluate() gives it, a torn last line not
    counted) or waiting."""
    from dataclasses import dataclass

    from benchmarks.common import ROOT
    from experiments.protocol import load_protocol
    from pose_mlx.resumable import RecordLog

    @dataclass
    class Trial:
        depth: float
        correct: bool

    monkeypatch.setattr(bench, "EVAL", tmp_path / "eval")
    monkeypatch.setattr(bench, "SCREEN", tmp_path / "screen")  # nothing screened
    protocol = load_protocol(ROOT / "benchmarks" / "protocols" / "real_model.yaml")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "dynamic.passkey.32768.json").write_text(json.dumps({"device": "Device(gpu, 0) H200"}))
    log = RecordLog((tmp_path / "eval" / "adapt-yarn.passkey.32768.json").with_suffix(".partial.json"), {"n": 24}, Trial)
    log.start([Trial(1.0, False), Trial(0.95, True)])
    log.append(Trial(0.9, True))
    with open(log.path, "a") as f:
        f.write('{"depth": 0.8')  # killed while writing
    assert bench.standing("dynamic", "passkey", 32768, protocol) == "done (Device(gpu, 0) H200)"
    assert bench.standing("adapt-yarn", "passkey", 32768, protocol) == "3/24 in a partial record"
    assert bench.standing("none", "passkey", 32768, protocol) == "waiting"
    assert [bench.records("none", "passkey", n, protocol) for n in (8192, 32768)] == [30, 10]  # the base's counts
    assert bench.records("adapt-yarn", "ruler", 16384, protocol) == 5 * 3 and bench.records("none", "ppl", 32768, protocol) is None
    lines = bench.status(protocol, ["dynamic", "adapt-yarn"], None)
    assert "  adapt-yarn passkey 32768: 3/24 in a partial record" in lines
    assert lines[-2].startswith("1 done, 1 partial, ")
    assert lines[-1] == "screening winner: not decided yet (what decides it is unmeasured)"  # nothing screened


def test_the_tests_plot_draws_one_row_per_test_and_nothing_without_tests(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from experiments.evidence_runs import plot_tests

    tests = [{"length": 16384, "pose": "p", "control": c, "difference": d, "ci95": ci, "verdict": v}
             for c, d, ci, v in [("dynamic", -0.03, [-0.18, 0.11], "not distinguishable"),
                                 ("adapt-yarn", 0.7, [0.47, 0.83], "better")]]
    drawn = {}
    savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **k: drawn.update(fig=fig) or savefig(fig, path, **k))
    plot_tests(tests, tmp_path / "tests.png")
    ax = drawn["fig"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["16k: p vs adapt-yarn", "16k: p vs dynamic"]  # bottom up: the first test on top
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["better", "not distinguishable"]
    assert (tmp_path / "tests.png").stat().st_size > 0
    plot_tests([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_the_headline_is_the_better_pose_run_by_the_registered_rule():
    """The screening's rule applied to the confirmation's PoSE runs, by hand: qualified = 4k passkey >= 0.95 and
    unseen-domain perplexity within 3% of the base's; none qualified: the higher 4k passkey, ties to the lower 32k
    perplexity; while the screening's winner is unmeasured, the run that has numbers."""
    from benchmarks.common import ROOT
    from experiments.protocol import load_protocol

    protocol = load_protocol(ROOT / "benchmarks" / "protocols" / "real_model.yaml")
    protocol["runs"]["winner"] = {"role": "pose", "train": {}}
    runs = {"none": {"ppl_unseen": {"2048": 14.81}},
            "pose-yarn-lr3e-5": {"passkey": {"4096": 29 / 30, "32768": 20 / 24}, "ppl_unseen": {"2048": 14.25},
                                 "ppl": {"32768": 5.55}}}
    assert bench.headline(protocol, runs) == "pose-yarn-lr3e-5"  # the winner unmeasured
    runs["winner"] = {"passkey": {"4096": 1.0, "32768": 0.5}, "ppl_unseen": {"2048": 15.6}, "ppl": {"32768": 6.31}}
    # 14.25 is 3.8% below the base's 14.81 and 15.6 5.3% above: neither qualifies, the higher 4k passkey wins
    assert bench.headline(protocol, runs) == "winner"
    runs["winner"]["passkey"]["4096"] = 29 / 30
    assert bench.headline(protocol, runs) == "pose-yarn-lr3e-5"  # tied at 4k: the lower 32k perplexity, 5.55
    runs["winner"]["ppl_unseen"]["2048"] = 14.9  # 0.6% above: the only qualified run, whatever its 32k passkey
    assert bench.headline(protocol, runs) == "winner"


def test_the_short_documents_supplement_pools_token_weighted_and_finds_what_was_left_out(tmp_path, monkeypatch):
    from experiments import evidence_short_documents as short
    protocol = {"target": 32768, "perplexity": {"target": {"documents": 4}}}
    for folder in ("eval", "supplement"):
        monkeypatch.setattr(bench, folder.upper(), tmp_path / folder)
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(short, "EVAL", tmp_path / "eval")
    assert bench.supplement("run", protocol) == {}  # nothing measured yet
    record = {"documents": 3, "results": [{"length": 32768, "ppl": 4.0, "tokens": 3}]}
    (tmp_path / "eval" / "run.ppl.32768.json").write_text(json.dumps(record))
    assert bench.supplement("run", protocol) == {}  # the supplement's record is missing
    record = {"documents": 1, "results": [{"length": 32768, "ppl": 16.0, "tokens": 1}], "device": "cpu"}
    (tmp_path / "supplement" / "run.ppl_whole.32768.json").write_text(json.dumps(record))
    got = bench.supplement("run", protocol)["ppl_supplement"]["32768"]
    # by hand: exp((3 ln 4 + 1 ln 16) / 4) = exp(10 ln 2 / 4) = 2 ** 2.5
    assert got["ppl_all"] == pytest.approx(2 ** 2.5) and got["documents_all"] == 4 and got["ppl_short"] == 16.0
    test = tmp_path / "test"
    test.mkdir()
    for name in ("0000-a.txt", "0001-b.txt", "0002-c.txt", "0003-d.txt"):
        (test / name).write_text(name)
    assert [p.name for p in short.short_documents(protocol, test)] == ["0003-d.txt"]
