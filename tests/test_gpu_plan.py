"""experiments.gpu_plan: the lent sessions simulated on a fake clock (hand-counted timelines: lanes, fine-tunings
that resume, curve points released while their run trains, evaluations that wait for their run, tasks that cannot
be cut), costs from the committed GPU records, and `gpu_jobs --plan --json`."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import gpu_plan
from experiments.gpu_plan import PlanJob, Task, plan, rate, simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clock(monkeypatch):
    """Round numbers for the hand-counted timelines: no job start-up, 10 s to take a fine-tuning up again."""
    monkeypatch.setattr(gpu_plan, "JOB_START", 0.0)
    monkeypatch.setattr(gpu_plan, "RESTART", 10.0)


def claim_job() -> PlanJob:
    return PlanJob("claim", "two trainings and what waits for them", [
        Task("T1", 100, "estimated", lane="train", rank=0), Task("T2", 300, "estimated", lane="train", rank=0),
        Task("c1", 20, "recorded", after="T2", at=0.5, splittable=False, rank=0),
        Task("e1", 150, "recorded", after="T1"), Task("e2", 200, "recorded", after="T2")], lanes=2, claim=True)


def test_sessions_on_a_fake_clock_by_hand(clock):
    """Sessions of 250 s. 1: T1 0-100, T2 100-250 (cut, 150 s left); e1 waits for T1, 100-250; c1 is released at
    T2's half, 250 (no lane left before the end); e2 waits for T2. 2: T2 taken up (10 s), 10-160; c1, released
    at once (its half is past), 10-30; e2 160-250, cut with 110 s left. 3: e2 0-110; then B's 100 s, 110-210."""
    other = PlanJob("B", "a measurement", [Task("b", 100, "recorded", lane="train", splittable=False)], lanes=0)
    sessions = simulate([claim_job(), other], 250)
    assert [[(j["job"], j["finished"], j["tasks_finished"]) for j in s["jobs"]] for s in sessions] == [
        [("claim", False, ["T1", "e1"])],
        [("claim", False, ["T2", "c1"])],
        [("claim", True, ["e2"]), ("B", True, ["b"])]]
    assert [s["seconds"] for s in sessions] == [250, 250, 210]


def test_a_task_that_cannot_be_cut_starts_over_and_one_too_long_never_fits(clock):
    first = PlanJob("A", "", [Task("a", 200, "recorded", lane="train", splittable=False)], lanes=0)
    second = PlanJob("B", "", [Task("b", 100, "recorded", lane="train", splittable=False)], lanes=0)
    sessions = simulate([first, second], 250)  # b cannot finish in the 50 s a leaves: it starts over in session 2
    assert [[(j["job"], j["finished"]) for j in s["jobs"]] for s in sessions] == [
        [("A", True), ("B", False)], [("B", True)]]
    short = simulate([first, PlanJob("C", "", [Task("c", 30, "recorded", lane="train")], lanes=0)], 225)
    assert [[j["job"] for j in s["jobs"]] for s in short] == [["A"], ["C"]]  # 25 s left: no job starts
    with pytest.raises(ValueError, match="never fits a session of 250 s"):
        simulate([PlanJob("D", "", [Task("d", 300, "recorded", lane="train", splittable=False)], lanes=0)], 250)


def test_the_plan_counts_sessions_claim_sessions_and_sources(clock):
    """475 s for the jobs: T1 0-100, T2 100-400; e1 100-250, c1 250-270 (released at T2's half), e2 waits for T2's
    end, 400-475, cut with 125 s left; session 2: e2 0-125, then B 125-225."""
    found = plan([claim_job(), PlanJob("B", "x", [Task("b", 100, "recorded: r", lane="train")], lanes=0)], 900, 240)
    assert gpu_plan.jobs_seconds(900, 240) == min(900 - 240, 600 - 20) - 60 - 45 == 475
    assert (found["sessions"], found["claim_sessions"], found["order"]) == (2, 2, ["claim", "B"])
    claim = found["jobs"]["claim"]
    assert claim["sessions"] == [1, 2] and claim["recorded_seconds"] == 370 and claim["estimated_seconds"] == 400
    assert found["jobs"]["B"]["sessions"] == [2] and found["assumptions"]["jobs_seconds_per_session"] == 475
    assert [s["seconds"] for s in found["per_session"]] == [475, 225]
    with pytest.raises(ValueError, match="too little to start one"):
        plan([claim_job()], 300, 240)


def test_rates_are_the_records_median_or_an_estimate_that_says_so():
    rates = {("passkey", 16384): [2.0, 1.0, 3.0], ("passkey", 32768): [5.0, 7.0], ("ppl", 32768): [8.0]}
    assert rate(rates, "passkey", 16384) == (2.0, "recorded: median of 3 GPU records")
    per, source = rate(rates, "passkey", 65536)  # 6.0 at 32k, 3x per doubling from 16k to 32k
    assert per == pytest.approx(18.0) and source.startswith("estimated: the recorded 32k rate x 3.00 per doubling")
    assert rate(rates, "ppl", 65536)[0] == pytest.approx(24.0)  # a window's prefill grows as the passkey's does
    with pytest.raises(ValueError, match="no GPU record"):
        rate(rates, "ruler", 65536)


CURVE_RECORDS = "benchmarks/results/real_model/protocol_full/curve"


def test_the_queue_plan_costs_claim_b_from_the_committed_records():
    """Addendum A's claim job holds the fine-tunings whose adapters are not committed (estimated), the curve points
    not recorded yet (7 a run) and its evaluations at the amended counts, each passkey costed at the median seconds
    per trial of the committed GPU records."""
    rates = gpu_plan.gpu_rates()
    jobs = gpu_plan.evidence_jobs(rates, ROOT / "out" / "nothing-here")
    assert [j.name for j in jobs] == ["a-claim", "b-decisive", "a-rest", "b-rest"]
    claim = {t.label: t for t in jobs[0].tasks}
    runs = ("pose-yarn-joined", "full-yarn")
    adapters, curve = ROOT / "benchmarks/results/real_model/protocol/adapters", ROOT / CURVE_RECORDS
    untrained = {n for n in runs if not (adapters / n).is_dir()}
    assert {n for n, t in claim.items() if t.lane == "train"} == {f"{n} fine-tuning" for n in untrained}
    recorded = {(n, s) for n in runs for s in range(25, 200, 25) if (curve / f"{n}@{s}.ppl.32768.json").is_file()}
    assert {n for n in claim if " curve @" in n} == {f"{n} curve @{s}" for n in runs for s in range(25, 200, 25)
                                                    if (n, s) not in recorded}
    per_trial = statistics.median(rates[("passkey", 32768)])
    whole = [t for n, t in claim.items() if n.endswith(" passkey 32768") and "left" not in t.source]
    assert all(t.seconds == pytest.approx(274 * per_trial) and t.source.startswith("recorded") for t in whole)
    assert all(claim[f"{n} fine-tuning"].source.startswith("estimated") for n in untrained)
    assert [t.label for t in jobs[1].tasks][:2] == ["pose-yarn-64k passkey 65536", "pose-yarn-64k ppl 65536"]


def test_the_plan_command_prints_the_json_it_promises():
    proc = subprocess.run([sys.executable, "-m", "experiments.gpu_jobs", "--plan", "--session-seconds", "900",
                           "--overhead", "240", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert {"sessions", "claim_sessions", "order", "jobs"} <= set(found)
    assert 1 <= found["claim_sessions"] <= found["sessions"] == len(found["per_session"])
    assert found["order"][0] == "a-claim" and set(found["order"]) == set(found["jobs"])
    assert all({"recorded_seconds", "estimated_seconds", "sessions", "tasks"} <= set(j) for j in found["jobs"].values())


def test_the_sizes_docs_gpu_quotes_are_smollm2s_lora_state():
    """docs/gpu.md's sizes of what resumes a 32k fine-tuning (LoRA weights and two AdamW moments in float32) and
    of a curve copy (float16) follow from SmolLM2-135M's shapes at the protocols' rank 16, and the committed
    float16 adapters hold that many numbers."""
    import mlx.core as mx

    params, lora = gpu_plan.smollm2_parameters(16)
    assert params == 134_515_008  # SmolLM2-135M's parameter count
    committed = mx.load(str(ROOT / "benchmarks/results/real_model/protocol/adapters/pose-yarn-64k/adapters.safetensors"))
    assert sum(v.size for v in committed.values()) == lora
    text = " ".join((ROOT / "docs" / "gpu.md").read_text().split())
    assert f"about {round(3 * 4 * lora / 2**20)} MiB for a 32k fine-tuning of SmolLM2-135M" in text
    assert f"float16, about {round(2 * lora / 2**20)} MiB each" in text
