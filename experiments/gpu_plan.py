"""The GPU queue's plan, made before any run (`python -m experiments.gpu_jobs --plan`): which jobs each lent session
runs, how many sessions the whole queue needs, and after how many claim (b) is decided.

What is pending is read where the runner reads it (each evidence script's `--stage status`, the cost curve's and
bench_gpu's records, the test shards' records) and costed task by task: from a committed record of the same work
on a GPU where one exists (`recorded`: the median seconds per trial, sample or evaluation of the evidence records
that name a GPU as their device; bench_gpu's timed stages; its test suite's seconds per test), else estimated
(`estimated`, with the reason). A lent session gives one call of at most `CALL` seconds (less `CALL_MARGIN`, so the
command ends inside it), of which the set-up takes `SETUP` and the packing `RESERVE`: the jobs get
min(session - overhead, CALL - CALL_MARGIN) - SETUP - RESERVE seconds. `simulate` then runs the queue on a fake
clock, session after session, as the runner does: jobs in order, none started with less than `MIN_START` seconds
left, a session over once a job is stopped; inside a job one training lane (fine-tunings one after the other) and
`lanes` evaluation lanes, each taking the first ready task (curve points before evaluations, an evaluation only
once its run is trained, a curve point once its copy is saved); a task cut by the session's end keeps its progress
when it resumes (a fine-tuning from its checkpoint, `RESTART` seconds to take it up again; a passkey or RULER
evaluation from its partial record) and starts over otherwise.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REAL_MODEL, RESULTS_DIR, ROOT, child_env

CALL, CALL_MARGIN = 600.0, 20.0
SETUP = 60.0  # estimated: join and check the carried pieces, install the wheels, check the device, put the texts
RESERVE = 45.0  # gpu_jobs.RESERVE: packing and the last job's own stop
MIN_START = 30.0  # gpu_jobs.MIN_START
RESTART = 60.0  # estimated: a fine-tuning taken up again from its checkpoint (load, compile, the data)
JOB_START = 30.0  # estimated: a job's first minute (processes, the models rebuilt from their adapters)
RECORDS = [REAL_MODEL / "protocol" / "eval", REAL_MODEL / "protocol" / "screen", REAL_MODEL / "protocol_8x" / "eval",
           REAL_MODEL / "protocol_full" / "eval", REAL_MODEL / "protocol_full" / "curve"]


@dataclass
class Task:
    """One piece of a job: its seconds, where they come from, its lane ("train" or "eval"), the training it waits
    for (`after`, at `at` of that training's time: 1.0 its end), whether a cut keeps its progress, and its rank
    among ready tasks (lower first)."""

    label: str
    seconds: float
    source: str
    lane: str = "eval"
    after: str | None = None
    at: float = 1.0
    splittable: bool = True
    rank: int = 1


@dataclass
class PlanJob:
    name: str
    what: str
    tasks: list[Task] = field(default_factory=list)
    lanes: int = 3
    claim: bool = False


# ------------------------------------------------------------------------------------------ costs from the records


def gpu_rates(folders: list[Path] = RECORDS) -> dict[tuple[str, int], list[float]]:
    """{(kind, length): seconds per unit} of every finished evidence record made on a GPU: per trial (passkey),
    per sample (RULER), per window of `length` tokens (target perplexity: its `documents`; the curve's points are
    32k perplexities), per evaluation (the unseen-domain perplexity)."""
    rates: dict[tuple[str, int], list[float]] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            found = re.fullmatch(r".+?\.(passkey|ppl_unseen|ppl|ruler)\.(\d+)\.json", path.name)
            if not found or ".partial" in path.name:
                continue
            record = json.loads(path.read_text())
            cost = record.get("cost") or {}
            if "gpu" not in str(record.get("device", "")) or "seconds" not in cost:
                continue
            kind = found.group(1)
            units = (len(record.get("trials") or record.get("records") or []) if kind in ("passkey", "ruler") else
                     record.get("documents", 1) if kind == "ppl" else 1)
            units -= cost.get("taken_up", 0)
            if units > 0:
                rates.setdefault((kind, int(found.group(2))), []).append(cost["seconds"] / units)
    return rates


def rate(rates: dict, kind: str, length: int) -> tuple[float, str]:
    """(seconds per unit, source) of `kind` at `length`: the recorded median, else estimated from the longest
    recorded length below it, times the growth per doubling of the length that the records show from half that
    length to it (for a perplexity window, the passkey's: both are one prefill of the window), else 2."""
    if rates.get((kind, length)):
        found = rates[(kind, length)]
        return statistics.median(found), f"recorded: median of {len(found)} GPU records"
    below = max((n for k, n in rates if k == kind and n < length), default=None)
    if below is None:
        raise ValueError(f"no GPU record of {kind} at or below {length} to estimate from")
    base = statistics.median(rates[(kind, below)])
    like = "passkey" if kind == "ppl" else kind
    top, half = rates.get((like, below)), rates.get((like, below // 2))
    growth = statistics.median(top) / statistics.median(half) if top and half else 2.0
    steps = math.log2(length / below)
    return base * growth ** steps, (f"estimated: the recorded {below // 1024}k rate x {growth:.2f} per doubling "
                                    f"(no GPU record at {length // 1024}k)")


def seven_b_rate(record: Path = RESULTS_DIR / "gpu" / "gpu.json") -> tuple[float, str]:
    """Model FLOP/s of the fastest LoRA update bench_gpu measured on a GPU (its FLOP convention,
    `gpu_checks.lora_flops`), from its record."""
    from benchmarks.gpu_checks import lora_flops

    data = json.loads(record.read_text())
    runs = [r for r in data["runs"] if r.get("s_per_update")]
    if not runs:
        raise ValueError(f"{record} times no LoRA update")
    best = min(runs, key=lambda r: r["s_per_update"])
    m = data["model"]
    # rank r on the seven projections of every block (mlx-lm's): r (in + out) each; 7B's key/value heads are its heads
    lora = data["config"]["lora_rank"] * m["layers"] * (4 * 2 * m["hidden"] + 3 * (m["hidden"] + m["intermediate"]))
    flops = lora_flops(m["parameters"], lora, m["layers"], m["hidden"], best["input_tokens"], best["input_tokens"])
    return flops / best["s_per_update"], (f"recorded: bench_gpu's {best['label']} update, "
                                          f"{best['s_per_update']:.2f} s on the {data['device']}")


def smollm2_parameters(rank: int = 16) -> tuple[int, int]:
    """(SmolLM2-135M's parameters, its LoRA's at rank `rank` on the seven projections of every block: r (in + out)
    each), from its shapes (`benchmarks.common.SMOLLM2_135M`)."""
    from benchmarks.common import SMOLLM2_135M as c

    h, kv, f = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    layers = c["num_hidden_layers"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + c["vocab_size"] * h + h
    return params, layers * rank * (2 * (h + h) + 2 * (h + kv) + 3 * (h + f))


def smollm2_update_flops(window: int, rank: int = 16) -> float:
    """Model FLOPs of one LoRA update of SmolLM2-135M on one row of `window` tokens, by `gpu_checks.lora_flops`."""
    from benchmarks.common import SMOLLM2_135M as c
    from benchmarks.gpu_checks import lora_flops

    params, lora = smollm2_parameters(rank)
    return lora_flops(params, lora, c["num_hidden_layers"], c["hidden_size"], window - 1, window - 1)


def training_task(name: str, window: int, steps: int, floor: float = 0.15) -> Task:
    """A fine-tuning of `steps` updates on rows of `window` tokens: each at least `floor` s (estimated: the
    update's fixed cost on a GPU, about 200 PoSE updates in 30 s), else its model FLOPs at the recorded LoRA rate
    of bench_gpu; plus `RESTART` to start."""
    flops_rate, basis = seven_b_rate()
    per = max(floor, smollm2_update_flops(window) / flops_rate)
    return Task(f"{name} fine-tuning", steps * per + RESTART, f"estimated: {steps} updates x {per:.2f} s (its model "
                f"FLOPs at the rate of {basis}, at least {floor} s) + {RESTART:.0f} s to start", lane="train", rank=0)


# ------------------------------------------------------------------------------------------ what is pending


def status_items(module: str) -> list[tuple[str, str]]:
    """(item, state) of each line of an evidence script's `--stage status` ("<run> <what>: <state>")."""
    out = subprocess.run([sys.executable, "-m", module, "--stage", "status"], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, check=True).stdout
    return [tuple(line.split(": ", 1)) for line in out.splitlines() if ": " in line]


def left_share(state: str) -> float:
    """The share of an evaluation still to run: 0 when done, (n - k) / n for "k/n in a partial record", else 1."""
    if state.startswith(("done", "adapters committed")):
        return 0.0
    found = re.match(r"(\d+)/(\d+) in a partial record", state)
    return 1 - int(found.group(1)) / int(found.group(2)) if found else 1.0


def evaluation_task(item: str, share: float, protocol: dict, rates: dict, after: str | None) -> Task:
    """One pending evaluation ("<run> <kind> <length>") of `protocol`, `share` of it left."""
    from experiments.evidence_runs import records

    run, kind, length = item.split(" ")
    length = int(length)
    per, source = rate(rates, kind, length)
    if kind == "ppl":  # windows of the target length: the registered count (documents: at most that many)
        target = protocol["perplexity"]["target"]
        units = target.get("windows", target.get("documents", 1))
    else:
        units = records(run, kind, length, protocol) or 1
    return Task(item, per * units * share, f"{source}; {units} x {per:.2f} s" + ("" if share == 1 else
                f", {share:.0%} left"), after=after, splittable=kind in ("passkey", "ruler"))


def checkpoint_share(work: Path, run: str, steps: int) -> float:
    """The share of run `run`'s fine-tuning left after the checkpoint an earlier session left (1: none)."""
    state = work / "trained" / f"{run}.partial" / "checkpoint" / "state.json"
    return 1 - json.loads(state.read_text())["step"] / steps if state.is_file() else 1.0


def addendum_jobs(module: str, protocol: dict, first: list, rates: dict, work: Path,
                  names: tuple[str, str], whats: tuple[str, str]) -> list[PlanJob]:
    """An addendum's two jobs from its status: the first holds its fine-tunings, their curve and the evaluations
    in `first` (in that order), the second every other pending evaluation."""
    steps = protocol["training"]["steps"]
    head, tail = PlanJob(names[0], whats[0], claim=names[0] == "a-claim"), PlanJob(names[1], whats[1])
    items = dict(status_items(module))
    training = {}
    for run, spec in protocol["runs"].items():
        if items.get(f"{run} fine-tuning", "adapters committed") != "adapters committed":
            task = training_task(run, spec["train"].get("window", protocol["training"]["window"]), steps)
            task.seconds *= checkpoint_share(work, run, steps)
            head.tasks.append(task)
            training[run] = task.label
    for item, state in items.items():
        run, what = item.split(" ", 1)
        if what.startswith("curve @") and left_share(state) and not state.startswith("done"):
            per, source = rate(rates, "ppl", protocol["target"])
            units = protocol["perplexity"]["target"]["documents"]
            head.tasks.append(Task(item, per * units, f"{source}; {units} x {per:.2f} s", after=training.get(run),
                                   at=int(what[7:]) / steps, splittable=False, rank=0))
    wanted = [" ".join(map(str, t)) for t in first]
    for item in wanted + [i for i in items if i not in wanted]:
        run, what = item.split(" ", 1)
        if what == "fine-tuning" or what.startswith("curve @") or not left_share(items.get(item, "done")):
            continue
        job = head if item in wanted else tail
        job.tasks.append(evaluation_task(item, left_share(items[item]), protocol, rates, training.get(run)))
    return [head, tail]


def evidence_jobs(rates: dict, work: Path) -> list[PlanJob]:
    """Addendum A's claim and rest, addendum B's decisive and rest, in the queue's order."""
    from experiments import evidence_8x as e8
    from experiments import evidence_full_length as efl
    from experiments.protocol import load_protocol

    a, b = load_protocol(efl.PROTOCOL), load_protocol(e8.PROTOCOL)
    a_claim, a_rest = addendum_jobs(
        "experiments.evidence_full_length", a, efl.claim_evaluations(a, list(a["runs"])), rates, work,
        ("a-claim", "a-rest"),
        ("addendum A: both fine-tunings in one call, their curve scored as saved, and what decides claim (b): the 32k "
         "perplexity, the passkey at 16k and 32k at the amended counts", "addendum A: every other registered "
         "evaluation (passkey at 4k and 8k, unseen-domain 2k perplexity, RULER at 8k-32k)"))
    b_decisive, b_rest = addendum_jobs(
        "experiments.evidence_8x", b, e8.decisive_evaluations(b), rates, work, ("b-decisive", "b-rest"),
        ("addendum B: what its goal is judged on, the passkey and perplexity at 64k, PoSE + YaRN, dynamic NTK and "
         "YaRN first", "addendum B: every other evaluation (passkey at 16k and 32k, the base at 64k, RULER at 64k)"))
    return [a_claim, b_decisive, a_rest, b_rest]


def measurement_jobs(k: int, counts: dict[str, int] | None = None) -> list[PlanJob]:
    """The cost curve's configurations not yet recorded on a GPU, bench_gpu without its tests, and the test
    suite's `k` shards that no complete GPU record covers."""
    from benchmarks import gpu_tests
    from experiments.bench_cost_curve import gpu_pending as cost_pending
    from experiments.gpu_jobs import gpu_pending

    jobs = []
    why = cost_pending()
    if why:
        cost = PlanJob("cost", "the cost curve on the GPU: each configuration not yet recorded there, 3 updates",
                       lanes=0)
        for config in why.split(": ", 1)[1].split(", "):
            window = int(config.split(":")[1])
            task = training_task(f"cost {config}", window, 3)
            cost.tasks.append(Task(config, task.seconds, task.source, lane="train", splittable=False))
        jobs.append(cost)
    record = json.loads((RESULTS_DIR / "gpu" / "gpu.json").read_text())
    if gpu_pending():
        stages = record["stage_seconds"]
        timed = sum(v for s, v in stages.items() if s != "waiting_for_tests")
        jobs.append(PlanJob("bench_gpu", "bench_gpu without its test suite: plans, throughput, first update, MFU", [
            Task("bench_gpu --skip-tests", timed, f"recorded: its stages but the wait for the tests, "
                 f"{record['date'][:10]} on the {record['device']} (some runs failed early there: a whole run may "
                 "take longer)", lane="train", splittable=False)], lanes=0))
    tests = record["tests"]
    per = tests["seconds"] / (tests["passed"] + tests["failed"] + tests["skipped"])
    workers = tests["command"].split(" -n ")[-1].split()[0] if " -n " in tests["command"] else "no"
    counts = gpu_tests.collect() if counts is None else counts
    for i, files in enumerate(gpu_tests.shards(counts, k), 1):
        if gpu_tests.shard_pending(i, k):
            n = sum(counts[f] for f in files)
            jobs.append(PlanJob(f"tests {i}/{k}", f"the test suite's shard {i} of {k} ({len(files)} files)", [
                Task(f"tests {i}/{k}", n * per, f"recorded: {per:.2f} s per test ({workers} workers, bench_gpu's "
                     f"suite on the {record['device']}) x {n} tests", lane="train",
                     splittable=False)], lanes=0))
    return jobs


# ------------------------------------------------------------------------------------------ sessions, on a fake clock


def train_lane(job: PlanJob, left: dict, begun: set, t0: float, stop: float) -> tuple[float, dict, list[str]]:
    """The job's fine-tunings one after the other from `t0` (each taken up again costs `RESTART` more): (when the
    lane stops, {training: release(at) of the curve points and evaluations that wait for it}, trainings
    finished). A fine-tuning cut at `stop` keeps its progress; any other task on this lane starts over."""
    clock, releases, finished = t0, {}, []
    for task in (t for t in job.tasks if t.lane == "train" and left[t.label] > 0):
        frac0 = 1 - left[task.label] / task.seconds if task.seconds else 0.0
        work = clock + (RESTART if task.label in begun and task.rank == 0 else 0.0)
        begun.add(task.label)
        end = work + left[task.label]
        cut = min(end, stop)

        def release(at, work=work, frac0=frac0, total=task.seconds, end=end, cut=cut):
            when = end if at >= 1 else max(work, work + (at - frac0) * total)
            return when if when <= cut else math.inf

        releases[task.label] = release
        if end <= stop:
            clock, left[task.label] = end, 0.0
            finished.append(task.label)
            continue
        if task.splittable:
            left[task.label] -= max(0.0, stop - work)
        return stop, releases, finished
    return clock, releases, finished


def run_job(job: PlanJob, left: dict, begun: set, start: float, stop: float) -> tuple[float, bool, list[str]]:
    """One job from `start` until it is done or `stop`: (its end, whether it finished, the tasks it finished).
    `left` holds each task's seconds still to run (updated), `begun` the fine-tunings begun. The evaluation lanes
    take the first ready task (lowest rank, then the job's order); one cut at `stop` keeps its progress when it
    can be cut (`splittable`), else starts over."""
    t0 = start + (JOB_START if job.lanes else 0.0)
    clock, releases, finished = train_lane(job, left, begun, t0, stop)

    def release(task: Task) -> float:
        if task.after is None or task.after not in releases:  # no training to wait for, or trained before
            return t0 if task.after is None or left.get(task.after, 0) == 0 else math.inf
        return releases[task.after](task.at)

    lanes = [t0] * job.lanes
    todo = sorted((t for t in job.tasks if t.lane == "eval" and left[t.label] > 0),
                  key=lambda t: (t.rank, job.tasks.index(t)))
    while todo and lanes:
        i = min(range(len(lanes)), key=lambda j: lanes[j])
        ready = [t for t in todo if release(t) <= lanes[i]]
        if not ready:
            lanes[i] = min(min(release(t) for t in todo), stop)
            if lanes[i] >= stop:
                break
            continue
        task = ready[0]
        todo.remove(task)
        if lanes[i] + left[task.label] <= stop:
            lanes[i] += left[task.label]
            left[task.label] = 0.0
            finished.append(task.label)
        else:
            left[task.label] -= (stop - lanes[i]) if task.splittable else 0.0
            lanes[i] = stop
    done = all(left[t.label] == 0 for t in job.tasks)
    return (max([clock, *lanes]) if done else stop), done, finished


def simulate(jobs: list[PlanJob], seconds: float, limit: int = 200) -> list[dict]:
    """The lent sessions, each of `seconds` for the jobs, on a fake clock: per session the jobs it ran (finished or
    not) and the tasks each finished. ValueError when a session would make no progress (a task that cannot be
    cut is longer than a session)."""
    left = {t.label: t.seconds for job in jobs for t in job.tasks}
    begun: set = set()
    sessions = []
    while any(v > 0 for v in left.values()):
        if len(sessions) >= limit:
            raise ValueError(f"the queue does not finish within {limit} sessions")
        before, clock, ran = dict(left), 0.0, []
        for job in jobs:
            if all(left[t.label] == 0 for t in job.tasks):
                continue
            if seconds - clock < MIN_START:
                break
            clock, done, finished = run_job(job, left, begun, clock, seconds)
            ran.append({"job": job.name, "finished": done, "tasks_finished": finished})
            if not done:
                break
        if left == before:
            stuck = next(t for job in jobs for t in job.tasks if left[t.label] > 0)
            raise ValueError(f"{stuck.label} ({stuck.seconds:.0f} s) never fits a session of {seconds:.0f} s")
        sessions.append({"session": len(sessions) + 1, "jobs": ran, "seconds": round(clock, 1)})
    return sessions


# ------------------------------------------------------------------------------------------ the plan


def jobs_seconds(session: float, overhead: float) -> float:
    """What the jobs of one lent session get: min(session - overhead, one call less its margin), less the
    set-up and the packing."""
    return min(session - overhead, CALL - CALL_MARGIN) - SETUP - RESERVE


def plan(jobs: list[PlanJob], session: float, overhead: float) -> dict:
    """The plan of `jobs` (in the queue's order) over lent sessions of `session` seconds with `overhead` of them
    spent starting the machine and carrying files: {"sessions", "claim_sessions", "order", "jobs", "per_session",
    "assumptions"}."""
    seconds = jobs_seconds(session, overhead)
    if seconds < MIN_START:
        raise ValueError(f"a session of {session:.0f} s with {overhead:.0f} s of overhead leaves {seconds:.0f} s for "
                         "the jobs: too little to start one")
    sessions = simulate(jobs, seconds)
    ran = {job.name: [s["session"] for s in sessions for j in s["jobs"] if j["job"] == job.name] for job in jobs}
    finished = {j["job"]: s["session"] for s in sessions for j in s["jobs"] if j["finished"]}
    claim = [finished[job.name] for job in jobs if job.claim and job.tasks]
    described = {}
    for job in jobs:
        recorded = sum(t.seconds for t in job.tasks if t.source.startswith("recorded"))
        described[job.name] = {
            "what": job.what, "seconds": round(sum(t.seconds for t in job.tasks), 1), "lanes": job.lanes,
            "recorded_seconds": round(recorded, 1), "estimated_seconds": round(sum(t.seconds for t in job.tasks)
                                                                               - recorded, 1),
            "sessions": ran[job.name], "claim": job.claim,
            "tasks": [{"task": t.label, "seconds": round(t.seconds, 1), "source": t.source} for t in job.tasks]}
    return {"sessions": len(sessions), "claim_sessions": max(claim, default=0),
            "order": [job.name for job in jobs], "jobs": described, "per_session": sessions,
            "assumptions": {"session_seconds": session, "overhead_seconds": overhead, "call_seconds": CALL,
                            "call_margin_seconds": CALL_MARGIN, "setup_seconds": SETUP, "packing_seconds": RESERVE,
                            "jobs_seconds_per_session": seconds, "restart_seconds": RESTART,
                            "job_start_seconds": JOB_START}}


def queue_plan(session: float, overhead: float, shards: int, work: Path = Path("out/real_model")) -> dict:
    """The plan of what is pending now, in the queue's order (`gpu_jobs.default_jobs`)."""
    rates = gpu_rates()
    jobs = [job for job in evidence_jobs(rates, work) + measurement_jobs(shards) if job.tasks]
    return plan(jobs, session, overhead)


def describe(found: dict) -> str:
    """The plan as text: the sessions, each with its jobs, then each job's seconds and where they come from."""
    a = found["assumptions"]
    lines = [f"{found['sessions']} lent sessions for the whole queue; claim (b) decided after "
             f"{found['claim_sessions']} (sessions of {a['session_seconds']:.0f} s, {a['overhead_seconds']:.0f} s of "
             f"overhead: {a['jobs_seconds_per_session']:.0f} s for the jobs in each)"]
    for s in found["per_session"]:
        lines.append(f"  session {s['session']}: " + ", ".join(
            f"{j['job']}{'' if j['finished'] else ' (goes on)'}" for j in s["jobs"]))
    for name in found["order"]:
        j = found["jobs"][name]
        lines.append(f"{name}: {j['seconds']:.0f} s ({j['recorded_seconds']:.0f} recorded, "
                     f"{j['estimated_seconds']:.0f} estimated), sessions {j['sessions']}: {j['what']}")
    return "\n".join(lines)
