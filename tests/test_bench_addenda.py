"""The protocol addenda's scripts (experiments/evidence_8x.py, evidence_full_length.py): what they run, and the
registered decisions computed from hand-made numbers."""

import pytest
from _finetune_helpers import text_dir  # noqa: F401

from experiments import evidence_8x as e8
from experiments.protocol import load_protocol


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


# ------------------------------------------------------------------------------------------ addendum A (full length)

from experiments import evidence_full_length as efl  # noqa: E402


def test_pieces_close_at_the_minimum_and_fold_remainders_back():
    groups = [("a", [("a/1", 40), ("a/2", 70), ("a/3", 10)]),  # 40+1+70 = 111 closes; 10 folds into it
              ("b", [("b/1", 30)]),  # too short for a piece: folds into a's last piece
              ("c", [("c/1", 120), ("c/2", 5), ("c/3", 6)])]  # 120 closes; 5+1+6 folds into it
    pieces = efl.plan_pieces(groups, 100)
    assert [p["files"] for p in pieces] == [["a/1", "a/2", "a/3", "b/1"], ["c/1", "c/2", "c/3"]]
    assert [p["tokens"] for p in pieces] == [40 + 1 + 70 + 1 + 10 + 1 + 30, 120 + 1 + 5 + 1 + 6]
    assert pieces[0]["folders"] == ["a", "b"]
    # a first folder too short for a piece is carried into the next folder's first piece
    carried = efl.plan_pieces([("top", [("x", 20)]), ("d", [("d/1", 90), ("d/2", 90), ("d/3", 100)])], 100)
    assert [p["files"] for p in carried] == [["x", "d/1"], ["d/2", "d/3"]]
    assert [p["tokens"] for p in carried] == [111, 191] and carried[0]["folders"] == ["top", "d"]
    with pytest.raises(ValueError, match="fewer than one piece"):
        efl.plan_pieces([("a", [("a/1", 10)])], 100)


def test_snapshots_keep_every_multiple_of_the_interval_from_a_live_checkpoint_folder(tmp_path):
    import json
    import shutil

    from experiments.curve import Snapshots

    ckpt, dest, saved = tmp_path / "checkpoint", tmp_path / "kept", []
    ckpt.mkdir()
    watcher = Snapshots(ckpt, dest, every=25, on_saved=saved.append, convert=shutil.copyfile)

    def checkpoint(step, previous=None):
        (ckpt / f"weights-{step}.safetensors").write_bytes(str(step).encode())
        if previous is not None:
            (ckpt / "previous.json").write_text(json.dumps({"step": previous, "files": {"weights": f"weights-{previous}.safetensors"}}))
        (ckpt / "state.json").write_text(json.dumps({"step": step, "files": {"weights": f"weights-{step}.safetensors"}}))

    checkpoint(25)
    watcher.sweep()
    checkpoint(50, previous=25)
    (ckpt / "weights-25.safetensors").unlink()  # the trainer deleted it: already kept
    watcher.sweep()
    checkpoint(60, previous=50)
    watcher.sweep()
    assert sorted(p.name for p in dest.iterdir()) == ["weights-25.safetensors", "weights-50.safetensors"]
    assert (dest / "weights-50.safetensors").read_bytes() == b"50" and saved == [25, 50]  # each handed on once


def test_snapshots_are_kept_in_float16_as_the_committed_adapters_are(tmp_path):
    import json

    import mlx.core as mx

    from experiments.curve import Snapshots

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    weights = {"a.lora_a": mx.array([[1.0, 1 / 3], [2.0 ** -20, 65504.0]]), "a.lora_b": mx.array([0.1])}
    mx.save_safetensors(str(ckpt / "weights-25.safetensors"), weights)
    (ckpt / "state.json").write_text(json.dumps({"step": 25, "files": {"weights": "weights-25.safetensors"}}))
    Snapshots(ckpt, tmp_path / "kept", every=25).sweep()
    kept = mx.load(str(tmp_path / "kept" / "weights-25.safetensors"))
    assert {k: v.dtype for k, v in kept.items()} == {"a.lora_a": mx.float16, "a.lora_b": mx.float16}
    assert kept["a.lora_a"].tolist() == weights["a.lora_a"].astype(mx.float16).tolist()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["weights-25.safetensors"]


def test_lanes_take_curve_points_before_evaluations_and_report_failures(capsys):
    import threading

    gate, taken, order = threading.Event(), threading.Event(), []

    def task(name):
        taken.set()
        gate.wait(5)
        order.append(name)
        if name == "bad":
            raise SystemExit("broken")
        return name

    lanes = efl.Lanes(1)
    lanes.put(1, ("first",), task, "first")  # taken at once, then waits on the gate
    assert taken.wait(5)
    for priority, name in ((1, "eval-a"), (1, "bad"), (0, "curve-25"), (0, "curve-50")):
        lanes.put(priority, (name,), task, name)
    gate.set()
    assert lanes.finish() == [("bad",)]
    assert order == ["first", "curve-25", "curve-50", "eval-a", "bad"]
    assert "bad: FAILED: broken" in capsys.readouterr().out


def test_the_claim_is_decided_by_the_target_perplexity_and_the_amended_passkeys():
    protocol = load_protocol(efl.PROTOCOL)
    names = list(protocol["runs"])
    assert efl.claim_evaluations(protocol, names) == [
        (n, "ppl", 32768) for n in names] + [(n, "passkey", 16384) for n in names] + [
        (n, "passkey", 32768) for n in names]
    assert {efl.records(n, "passkey", 32768, protocol) for n in names} == {274}  # the amended counts


def test_a_curve_point_whose_copy_is_gone_after_training_is_lost_not_waited_for(tmp_path, monkeypatch):
    from experiments import curve

    protocol = load_protocol(efl.PROTOCOL)
    monkeypatch.setattr(curve, "CURVE", tmp_path / "curve")
    (tmp_path / "curve").mkdir()
    (tmp_path / "curve" / "full-yarn@25.ppl.32768.json").write_text("{}")
    kept = tmp_path / "work" / "snapshots" / "full-yarn"
    kept.mkdir(parents=True)
    (kept / "weights-50.safetensors").write_bytes(b"")
    assert curve.lost(protocol, "full-yarn", tmp_path / "work", trained=False) == []  # still training: it may come
    assert curve.lost(protocol, "full-yarn", tmp_path / "work", trained=True) == [75, 100, 125, 150, 175]


def test_a_curve_points_model_is_the_model_its_run_exports(tmp_path, text_dir):
    """The scaffold a curve point is scored with (the GGUF converted, `finetune --sampler none`'s extension, the
    LoRA's adapter config) with a run's final adapters is the model that run exports: the same config files and
    the same perplexity on the same text, on a tiny GGUF."""
    import json
    import subprocess
    import sys

    from experiments import curve
    import _gguf_helpers as H

    tok = H.train_bpe()
    config = H.model_config(tok.get_vocab_size(), tied=True)
    gguf = tmp_path / "m.gguf"
    H.write_gguf(gguf, config, H.random_weights(config), H.bpe_metadata(tok, "gpt-2"))
    work = tmp_path / "work"
    trained = work / "trained" / "run"
    subprocess.run([sys.executable, "-m", "pose_mlx.finetune", "--model", str(gguf), "--target", "4x", "--schedule",
                    "yarn", "--window", "64", "--steps", "2", "--lora-rank", "4", "--lora-layers", "1", "--no-fuse",
                    "--data", str(text_dir), "--cache-dir", str(tmp_path / "cache"), "--output", str(trained),
                    "--no-progress"], check=True, capture_output=True)
    base = curve.scaffold("run", gguf, work)
    for name in ("config.json", "adapter_config.json"):
        assert json.loads((base / name).read_text()) == json.loads((trained / name).read_text()), name
    assert json.loads((base / "pose_mlx.json").read_text())["schedule"] == \
        json.loads((trained / "pose_mlx.json").read_text())["schedule"]
    rebuilt = work / "rebuilt"  # as evidence_runs.ensure_trained rebuilds a committed run
    subprocess.run([sys.executable, "-m", "pose_mlx.convert", str(gguf), str(rebuilt)], check=True, capture_output=True)
    for name in ("config.json", "adapter_config.json", "pose_mlx.json", "adapters.safetensors"):
        (rebuilt / name).write_bytes((trained / name).read_bytes())
    point = curve.snapshot_model(base, trained / "adapters.safetensors", work / "point")

    def ppl(folder):
        out = tmp_path / f"{folder.name}.json"
        subprocess.run([sys.executable, "-m", "pose_mlx.perplexity", "--model", str(folder), "--data", str(text_dir),
                        "--lengths", "128", "--docs", "1", "--output", str(out), "--no-progress"], check=True,
                       capture_output=True)
        return json.loads(out.read_text())["results"][0]["ppl"]

    assert ppl(point) == pytest.approx(ppl(rebuilt), rel=1e-6)


def test_full_length_goals_from_hand_made_numbers():
    protocol = load_protocol(efl.PROTOCOL)
    assert efl.curve_steps(protocol) == [25, 50, 75, 100, 125, 150, 175]
    runs = {"pose-yarn-joined": {"ppl": {"32768": 6.3}}, "full-yarn": {"ppl": {"32768": 6.0}}}
    tests = [{"length": 16384, "verdict": "not distinguishable"}, {"length": 32768, "verdict": "worse"}]
    cost = {"pose-yarn-joined": {"peak_bytes": 3e9}, "full-yarn": {"peak_bytes": 20e9}}
    g = efl.goals(protocol, runs, tests, cost)
    assert g[0]["value"] == pytest.approx(1.05) and g[0]["held"] is True  # at most 1.05x
    assert g[1]["held"] is False  # worse at 32k
    assert g[2]["value"] == pytest.approx(0.15) and g[2]["held"] is False  # more than 1/8
    unmeasured = efl.goals(protocol, {}, tests[:1], {})
    assert [x["held"] for x in unmeasured] == [None, None, None]


def test_cost_curve_runs_what_the_addendum_registers(tmp_path):
    from experiments import bench_cost_curve as cc

    assert cc.parse_configs(cc.DEFAULT_CONFIGS) == [("pose", 1024), ("pose", 2048), ("full", 8192), ("full", 16384),
                                                    ("full", 32768)]
    protocol = load_protocol(efl.PROTOCOL)
    assert {w for m, w in cc.parse_configs(cc.DEFAULT_CONFIGS) if m == "full"} == set(protocol["cost"]["full_windows"])
    with pytest.raises(SystemExit, match="full:WINDOW"):
        cc.parse_configs("half:8192")

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    full8 = cc.finetune_args("full", 8192, tmp_path / "m.gguf", tmp_path, tmp_path, 3, True)
    assert (flag(full8, "--original"), flag(full8, "--target"), flag(full8, "--sampler")) == ("4096", "8192", "full")
    pose2 = cc.finetune_args("pose", 2048, tmp_path / "m.gguf", tmp_path, tmp_path, 3, False)
    assert (flag(pose2, "--window"), flag(pose2, "--target"), flag(pose2, "--lora-rank")) == ("2048", "32768", "16")
    assert "--grad-checkpoint" in full8 and "--grad-checkpoint" not in pose2


def test_pareto_front_ranks_confirmed_runs_only_and_keeps_the_undominated():
    from experiments.evidence_summary import front, points

    runs = {"a": {"stage": "confirmation", "passkey": {"32768": 0.9}, "ppl": {"32768": 6.0}},
            "b": {"stage": "confirmation", "passkey": {"32768": 0.9}, "ppl": {"32768": 7.0}},  # a beats it
            "c": {"stage": "confirmation", "passkey": {"32768": 1.0}, "ppl": {"32768": 8.0}},  # better passkey
            "d": {"passkey": {"32768": 1.0}, "ppl": {"32768": 5.0}},  # exploratory: shown, never ranked
            "e (earlier)": {"passkey": {"32768": 1.0}, "ppl": {"32768": 1.0}},  # another run's stage: left out
            "f": {"stage": "confirmation", "passkey": {"16384": 1.0}, "ppl": {"32768": 1.0}},  # no passkey at 32k
            "g": {"stage": "confirmation", "exploratory": {"passkey": {"32768": 0.1}, "ppl": {"32768": 9.0}}}}
    pts = points(runs, 32768)
    assert set(pts) == {"a", "b", "c", "d", "g"} and pts["d"]["stage"] == pts["g"]["stage"] == "exploratory"
    assert sorted(front(pts)) == ["a", "c"]


def test_8x_best_training_free_run_waits_for_every_number(protocol8):
    runs = {"dynamic": {"passkey": {"65536": 0.5}, "ppl": {"65536": 9.0}},
            "yarn": {"passkey": {"65536": 0.5}, "ppl": {"65536": 8.0}}}
    assert e8.best_training_free(protocol8, runs) == "yarn"  # tied on passkey: the lower perplexity
    runs["dynamic"]["passkey"]["65536"] = 0.6
    assert e8.best_training_free(protocol8, runs) == "dynamic"
    del runs["yarn"]["ppl"]
    assert e8.best_training_free(protocol8, runs) is None


def test_the_registered_prediction_is_the_maps_8x_column(protocol8):
    """The prediction's numbers are the committed factor map's at 8x (means over its two seeds), and its winners
    are the best of this addendum's runs there."""
    import json

    from benchmarks.common import RESULTS_DIR

    prediction = protocol8["prediction"]
    column = json.loads((RESULTS_DIR / "sim_map" / "results.json").read_text())["map"]["8"]
    assert {m: round(c["passkey"], 3) for m, c in column.items()} == {
        m: round(v, 3) for m, v in prediction["passkey_at_target"].items()}
    assert {m: round(c["ppl"], 2) for m, c in column.items()} == prediction["ppl_at_target"]
    runs = [m for m in column if m in {"pose-yarn" if n == "pose-yarn-64k" else n for n in protocol8["runs"]}]
    assert prediction["passkey_winner"] == max(runs, key=lambda m: column[m]["passkey"])
    assert prediction["perplexity_winner"] == min(runs, key=lambda m: column[m]["ppl"])


def test_training_logs_peak_read_in_bytes(tmp_path, monkeypatch):
    """The loop logs MLX's peak in GiB (bytes / 2**30) under `peak_memory_gb`; the cost records compare it with the
    planner's bytes, so 1 GiB is 1,073,741,824 bytes, not 1e9."""
    import json

    from benchmarks.common import log_peak_bytes

    assert log_peak_bytes([{"peak_memory_gb": 0.5}, {"peak_memory_gb": 2.0}, {"peak_memory_gb": 1.0}]) == 2 * 2**30
    train = tmp_path / "train"
    train.mkdir()
    lines = [{"step": i, "loss": 2.0, "seconds": s, "tokens": 100, "peak_memory_gb": 3.0} for i, s in ((1, 9), (2, 4))]
    (train / "run.log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setattr(efl, "OUT", tmp_path)
    assert efl.training_record("run") == {"updates": 2, "tokens": 200, "seconds_per_update": 4, "peak_bytes": 3 * 2**30}


def test_cost_curve_keeps_what_a_budget_stopped_run_measured(tmp_path, monkeypatch):
    """A configuration the budget stops after two or more updates is recorded from its partial log (marked
    `stopped_early`); one stopped before that records nothing and the stop goes on up."""
    import json

    from experiments import bench_cost_curve as cc
    from benchmarks.common import OutOfTime

    monkeypatch.setattr(cc, "predicted", lambda argv: {"predicted_bytes": 10, "fits": True})
    monkeypatch.setattr(cc, "device", lambda: "Device(cpu, 0) test")
    logged = []

    def stopped(cmd, log):
        partial = tmp_path / "cost" / "full-8192.partial"
        partial.mkdir(parents=True, exist_ok=True)
        (partial / "log.jsonl").write_text("".join(json.dumps(
            {"step": i + 1, "loss": 2.0, "tokens": 8191, "seconds": s, "peak_memory_gb": 1.0 + i})
            + "\n" for i, s in enumerate(logged)))
        raise OutOfTime("budget")

    monkeypatch.setattr(cc, "run_logged", stopped)
    logged[:] = [100.0]
    with pytest.raises(OutOfTime):
        cc.measure("full", 8192, tmp_path / "m.gguf", tmp_path, tmp_path, 3, True)
    logged[:] = [100.0, 40.0, 60.0]
    record = cc.measure("full", 8192, tmp_path / "m.gguf", tmp_path, tmp_path, 5, True)
    assert record["peak_bytes"] == 3 * 2**30 and record["seconds_per_update"] == 50.0
    assert record["updates_timed"] == 2 and record["stopped_early"].endswith("after 3 updates")
    assert not (tmp_path / "cost" / "full-8192.partial").exists()
    with pytest.raises(SystemExit):
        cc.main(["--steps", "1"])



def test_cost_curve_on_a_gpu_is_pending_until_each_configuration_is_recorded_whole(tmp_path, monkeypatch):
    """gpu_jobs' `cost` job: pending while a GPU's file lacks a configuration, or holds it only stopped early; a CPU's
    records never count; `--skip-recorded` runs only what is missing, slot after slot."""
    import json

    from experiments import bench_cost_curve as cc

    monkeypatch.setattr(cc, "COST", tmp_path)
    gpu = "Device(gpu, 0) NVIDIA H200"
    whole = [{"method": "pose", "window": 1024, "grad_checkpoint": True, "device": gpu, "peak_bytes": 1},
             {"method": "full", "window": 32768, "grad_checkpoint": True, "device": gpu, "fits": False,
              "not_measured": "the planner predicts it does not fit"}]
    early = {"method": "full", "window": 8192, "grad_checkpoint": True, "device": gpu, "peak_bytes": 1,
             "stopped_early": "the budget ran out after 2 updates"}
    cpu = {**whole[0], "window": 2048, "device": "Device(cpu, 0) AMD EPYC"}
    (tmp_path / "gpu-nvidia-h200.json").write_text(json.dumps({"records": [*whole, early]}))
    (tmp_path / "cpu-amd-epyc.json").write_text(json.dumps({"records": [cpu]}))
    configs = "pose:1024,pose:2048,full:8192,full:32768"
    assert cc.gpu_pending(configs) == "not measured on a GPU: pose:2048, full:8192"
    assert cc.gpu_pending("pose:1024,full:32768") is None
    ran = []
    monkeypatch.setattr(cc, "device_file", lambda: tmp_path / "gpu-nvidia-h200.json")
    monkeypatch.setattr(cc, "model_file", lambda: tmp_path / "m.gguf")
    monkeypatch.setattr(cc, "joined_corpus", lambda *a: tmp_path)
    monkeypatch.setattr(cc, "plot", lambda path: None)
    monkeypatch.setattr(cc, "measure", lambda method, window, *a: ran.append((method, window)) or
                        {"method": method, "window": window, "grad_checkpoint": True, "device": gpu, "peak_bytes": 2})
    assert cc.main(["--configs", configs, "--grad-checkpoint", "--skip-recorded"]) == 0
    assert ran == [("pose", 2048), ("full", 8192)]
    assert cc.gpu_pending(configs) is None


def test_claim_scores_copies_while_training_and_evaluates_each_run_once_trained(tmp_path, monkeypatch):
    """`claim` with the fine-tunings, evaluations and curve points faked: each run trains in turn; the copies it
    saves are scored while it trains; a run's claim evaluations start only after its fine-tuning ended; a run
    trained before is only rebuilt; a failed fine-tuning leaves the other run going."""
    import threading

    protocol = load_protocol(efl.PROTOCOL)
    events, lock, done = [], threading.Lock(), {"pose-yarn-joined"}

    def log(*event):
        with lock:
            events.append(event)

    def train(name, protocol, gguf, work, data, on_saved=None):
        log("train", name)
        if name == "broken":
            raise SystemExit("out of memory")
        for step in (25, 50):
            on_saved(step)
        done.add(name)
        log("trained", name)

    monkeypatch.setattr(efl, "train", train)
    monkeypatch.setattr(efl, "trained", lambda name: name in done)
    monkeypatch.setattr(efl, "ensure_trained", lambda name, *a, **k: log("rebuilt", name))
    monkeypatch.setattr(efl, "curve_point", lambda name, step, *a: log("curve", name, step))
    monkeypatch.setattr(efl, "evaluate", lambda name, kind, length, *a: log("eval", name, kind, length))
    protocol["runs"]["broken"] = protocol["runs"]["full-yarn"]
    failed = efl.claim(["pose-yarn-joined", "full-yarn", "broken"], protocol, tmp_path / "m.gguf", tmp_path,
                       tmp_path / "data", tmp_path / "test", jobs=2)
    assert failed == [("broken",)]
    assert ("train", "pose-yarn-joined") not in events and ("rebuilt", "pose-yarn-joined") in events
    assert {e for e in events if e[0] == "curve"} == {("curve", "full-yarn", 25), ("curve", "full-yarn", 50)}
    for name in ("pose-yarn-joined", "full-yarn"):
        evals = [i for i, e in enumerate(events) if e[:2] == ("eval", name)]
        assert sorted(events[i][2:] for i in evals) == [("passkey", 16384), ("passkey", 32768), ("ppl", 32768)]
        assert min(evals) > events.index(("rebuilt", name))
    assert events.index(("trained", "full-yarn")) < events.index(("rebuilt", "full-yarn"))
    assert not any(e[:2] == ("eval", "broken") for e in events)
