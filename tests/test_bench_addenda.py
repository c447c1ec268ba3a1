"""The protocol addenda's scripts (benchmarks/evidence_8x.py, evidence_full_length.py): what they run, and the
registered decisions computed from hand-made numbers."""

import pytest

from benchmarks import evidence_8x as e8
from benchmarks.protocol import load_protocol


@pytest.fixture(scope="module")
def protocol8():
    return load_protocol(e8.PROTOCOL)


def test_8x_runs_every_registered_evaluation_once_and_reuses_only_the_base_at_16k_and_32k(protocol8):
    tasks = e8.evaluations(protocol8)
    assert len(tasks) == len(set(tasks))
    runs = list(protocol8["runs"])
    passkey = {(n, length) for n, kind, length in tasks if kind == "passkey"}
    expected = {(n, length) for n in runs for length in protocol8["passkey"]["trials"]}
    assert expected - passkey == {("none", 16384), ("none", 32768)}
    assert {(n, k) for n, k, length in tasks if length == 65536} == {
        (n, k) for n in runs for k in ("passkey", "ppl", "ruler")}
    # cheapest first: every 2k perplexity before any passkey, every passkey before the 64k perplexity and RULER
    kinds = [k for _, k, _ in tasks]
    assert kinds.index("passkey") > max(i for i, k in enumerate(kinds) if k == "ppl_unseen")
    assert min(i for i, k in enumerate(kinds) if k in ("ppl", "ruler")) > max(i for i, k in enumerate(kinds) if k == "passkey")
    assert e8.evaluations(protocol8, max_length=32768) == [t for t in tasks if t[2] <= 32768]


def test_8x_perplexity_verdicts_and_goal_follow_the_registered_rule(protocol8):
    runs = {"pose-yarn-64k": {"ppl": {"65536": 10.0}}, "dynamic": {"ppl": {"65536": 10.3}},
            "yarn": {"ppl": {"65536": 10.1}}, "adapt-yarn": {"ppl": {"65536": 9.7}}, "adapt-dynamic": {}}
    tests = {t["control"]: t for t in e8.perplexity_tests(protocol8, runs)}
    assert set(tests) == {"dynamic", "yarn", "adapt-yarn"}  # adapt-dynamic unmeasured, the base no control
    assert tests["dynamic"]["verdict"] == "better" and tests["dynamic"]["ratio"] == pytest.approx(10 / 10.3)
    assert tests["yarn"]["verdict"] == "not distinguishable"  # 0.990: inside (0.98, 1.02)
    assert tests["adapt-yarn"]["verdict"] == "worse"  # 1.031
    passkey = [{"length": 65536, "control": "dynamic", "verdict": "worse"},
               {"length": 65536, "control": "yarn", "verdict": "better"},
               {"length": 65536, "control": "adapt-yarn", "verdict": "better"},
               {"length": 32768, "control": "adapt-dynamic", "verdict": "better"}]
    g = e8.goal(protocol8, passkey, list(tests.values()))
    assert g["against"]["dynamic"]["held"] is False  # better on perplexity but worse on passkey
    assert g["against"]["yarn"]["held"] is True  # better on passkey, not distinguishable on perplexity
    assert g["against"]["adapt-yarn"]["held"] is False  # better on passkey, worse on perplexity
    assert g["against"]["adapt-dynamic"]["held"] is None and g["held"] is None  # nothing at 64k yet


def test_8x_evaluations_wait_for_the_registered_prediction(protocol8, tmp_path, capsys):
    if "prediction" in protocol8:
        pytest.skip("the prediction is registered")
    with pytest.raises(SystemExit) as stop:
        e8.main(["--stage", "eval", "--work", str(tmp_path)])
    assert stop.value.code == 2 and "prediction" in capsys.readouterr().err
