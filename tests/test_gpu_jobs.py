"""experiments.gpu_jobs with fake jobs (`python -c` children that sleep, write files, ignore SIGTERM or fail): the
budget each job is given and kept to, the outcomes and what is pending before and after, the packing into at most
15 MiB pieces and 7 files (a random file over 15 MiB split and joined back byte for byte), --unpack's refusals,
and the command line's errors."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from experiments import gpu_jobs, gpu_pack
from experiments.gpu_jobs import Job
from experiments.gpu_pack import Group
from pose_mlx.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def fake(name: str, code: str, marker: Path | None = None, **kw) -> Job:
    """A job running `code` (sys.argv[1:] is ['--budget', S]); pending until `marker` exists, when given."""
    pending = (lambda: None if marker.exists() else f"no {marker.name}") if marker else (lambda: "always")
    return Job(name, [sys.executable, "-c", code], pending, **kw)


def writes(path: Path, sleep: float = 0.0, exit_code: int = 0) -> str:
    return (f"import sys, time; time.sleep({sleep}); open({str(path)!r}, 'w').write(' '.join(sys.argv[1:])); "
            f"sys.exit({exit_code})")


def test_jobs_get_the_time_left_in_order_and_none_starts_short(tmp_path):
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    jobs = [fake("a", writes(a, sleep=2), a), fake("b", writes(b), b), fake("c", writes(c), c)]
    with open(tmp_path / "log", "w") as log:
        ran = gpu_jobs.run_jobs(jobs, budget=36.0, log=log, reserve=5.0, min_start=30.0)
    assert ran[0]["outcome"] == "finished" and ran[1]["outcome"].startswith("no time left (")
    assert int(ran[1]["outcome"].split("(")[1].split()[0]) < 30  # 36 - 5 s, less a's 2 s and more
    flag, seconds = a.read_text().split()
    assert flag == "--budget" and 29 <= int(seconds) <= 31  # 36 s less the 5 s reserve, less the start
    assert ran[0]["budget"] == int(seconds) and 2 <= ran[0]["seconds"] < 10
    assert not b.exists() and not c.exists() and ran[2]["outcome"].startswith("no time left")
    assert (ran[0]["pending_before"], ran[0]["pending_after"]) == ("no a", None)
    assert (ran[1]["pending_before"], ran[1]["pending_after"]) == ("no b", "no b")
    assert "=== a: -c" in (tmp_path / "log").read_text() and "=== a: finished" in (tmp_path / "log").read_text()


def test_outcomes_done_not_ready_failed_and_stopped(tmp_path):
    done = tmp_path / "done"
    done.write_text("")
    jobs = [fake("done", writes(done), done),
            fake("blocked", writes(tmp_path / "x"), ready=lambda: "no prediction"),
            fake("fails", writes(tmp_path / "f", exit_code=1)),
            fake("budget", writes(tmp_path / "s", exit_code=3))]
    with open(tmp_path / "log", "w") as log:
        ran = gpu_jobs.run_jobs(jobs, budget=100.0, log=log, reserve=1.0)
    assert [e["outcome"] for e in ran] == ["done before", "not ready: no prediction", "failed (exit 1)",
                                           "stopped by its budget"]
    assert not (tmp_path / "x").exists() and "exit_code" not in ran[0] and ran[2]["exit_code"] == 1


def test_a_job_past_its_budget_is_stopped_then_killed(tmp_path):
    """SIGTERM to the job's whole group past its budget; SIGKILL when it ignores that. Its children go too."""
    child = tmp_path / "child.pid"
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    ran = []
    with open(tmp_path / "log", "w") as log:
        for job in (fake("sleeper", "import time; time.sleep(60)"), fake("stubborn", stubborn)):
            ran += gpu_jobs.run_jobs([job], budget=3.0, log=log, reserve=0.5, min_start=0.5, stop_after=0.5,
                                     kill_after=1.0)
    assert ran[0]["outcome"] == "stopped by gpu_jobs past its budget (SIGTERM)" and ran[0]["exit_code"] < 0
    assert ran[1]["outcome"] == "killed by gpu_jobs past its budget (SIGKILL)"
    assert time.monotonic() - t0 < 15
    pid = int(child.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def test_run_packs_what_changed_into_pieces_and_unpacks_them_byte_for_byte(tmp_path):
    """A job writes a 16.5 MiB random file (so the archive is split), changes a file, removes one, and writes a
    stray file in its `keep` folder (no run folder's, no log: not brought back); unpacked into a copy of the
    starting tree, the copy equals the end tree's results."""
    base = tmp_path / "repo"
    results = base / "results"
    _tree(base, {"results/kept.json": b"{}", "results/old.partial.json": b"[1]", "results/changed.txt": b"a",
                 "work/ckpt/old.bin": b"x"})
    start_copy = tmp_path / "copy"
    _tree(start_copy, {"results/kept.json": b"{}", "results/old.partial.json": b"[1]", "results/changed.txt": b"a",
                       "work/ckpt/old.bin": b"x"})
    code = (f"import os, pathlib; r = pathlib.Path({str(results)!r}); (r / 'run').mkdir(); "
            "(r / 'run' / 'big.bin').write_bytes(os.urandom(16 * 2**20 + 2**19)); "
            "(r / 'changed.txt').write_text('b'); (r / 'old.partial.json').unlink(); "
            f"pathlib.Path({str(base / 'work' / 'ckpt' / 'state.json')!r}).write_text('{{\"step\": 5}}')")
    time.sleep(0.01)  # distinct mtimes
    out = tmp_path / "out"
    summary = gpu_jobs.run([fake("writer", code, keep=("work/ckpt",))], 60.0, out, [results], base, reserve=1.0)
    assert summary["jobs"][0]["outcome"] == "finished"
    assert summary["packed"] == ["results.tar.gz.part00", "results.tar.gz.part01"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_jobs.json", "gpu_jobs.log", "results.tar.gz.part00", "results.tar.gz.part01"]
    assert all((out / n).stat().st_size <= 15 * 2**20 for n in files) and len(files) <= 7
    assert summary["removed"] == ["results/old.partial.json"] and summary["changed"] == 3
    assert summary["left_behind"] == []
    data = b"".join((out / n).read_bytes() for n in summary["packed"])
    assert hashlib.sha256(data).hexdigest() == summary["sha256"] == json.loads(
        (out / "gpu_jobs.json").read_text())["sha256"]

    assert set(summary["manifest"]) == {"results/changed.txt", "results/run/big.bin"}  # work/ckpt: no run, no log
    assert summary["manifest"]["results/changed.txt"] == {"bytes": 1, "sha256": hashlib.sha256(b"b").hexdigest()}
    done = gpu_pack.unpack([out / "results.tar.gz.part01", out / "results.tar.gz.part00"], start_copy)
    assert sorted(done["files"]) == ["results/changed.txt", "results/run/big.bin"]
    assert done["removed"] == ["results/old.partial.json"]
    tree = {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file() and "ckpt" not in p.parts}
    copy = {p.relative_to(start_copy): p.read_bytes() for p in start_copy.rglob("*") if p.is_file()
            and "ckpt" not in p.parts}
    assert copy == tree


def test_a_second_call_takes_up_the_first_ones_records_from_the_returns_kept_on_the_machine(tmp_path):
    """Two calls of one session, each on a fresh copy of the checkout (as the device service gives): the first's
    return, kept in `returns`, is replayed into the second's checkout before its job runs, so that job finds the
    first one's record and the second return holds only what it changed; replaying both returns in order into a
    third copy gives the second call's final tree."""
    start = {"results/old.json": b"{}"}
    bump = ("import json, pathlib; p = pathlib.Path({!r}) / 'count.json'; "
            "n = json.loads(p.read_text())['n'] if p.is_file() else 0; p.write_text(json.dumps({{'n': n + 1}}))")
    returns = tmp_path / "stash" / "returned"
    trees = []
    for call in range(2):
        base = tmp_path / f"call{call}"
        _tree(base, start)
        assert gpu_pack.replay(returns, base) == [f"{i:02d}" for i in range(call)]
        out = tmp_path / f"out{call}"
        job = fake("bump", bump.format(str(base / "results")))
        summary = gpu_jobs.run([job], 60.0, out, [base / "results"], base, reserve=1.0)
        assert summary["jobs"][0]["outcome"] == "finished" and set(summary["manifest"]) == {"results/count.json"}
        assert gpu_pack.keep(out, returns) == returns / f"{call:02d}"
        trees.append({p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()})
    assert json.loads(trees[1][Path("results/count.json")]) == {"n": 2}  # the second call went on from the first
    assert sorted(f.name for f in (returns / "01").iterdir()) == ["gpu_jobs.json", "results.tar.gz"]
    home = tmp_path / "home"
    _tree(home, start)
    assert gpu_pack.replay(returns, home) == ["00", "01"]
    assert {p.relative_to(home): p.read_bytes() for p in home.rglob("*") if p.is_file()} == trees[1]
    assert gpu_pack.replay(tmp_path / "none", home) == []


def test_results_over_the_cap_are_left_behind_in_priority_order(tmp_path):
    files = []
    for i in range(4):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(os.urandom(2**20))
        files.append(f)
    summary = gpu_pack.pack([Group(files[:2]), Group(files[2:])], [], tmp_path / "out", tmp_path,
                            cap=int(2.8 * 2**20))
    assert [x["path"] for x in summary["left_behind"]] == ["f2.bin", "f3.bin"]
    assert summary["bytes"] <= 2.8 * 2**20
    names = tarfile.open(tmp_path / "out" / "results.tar.gz").getnames()
    assert names == [gpu_pack.REMOVED, "f0.bin", "f1.bin"]
    # a whole group goes together or not at all: the first file fits, the pair does not
    whole = gpu_pack.pack([Group(files[:1]), Group(files[1:3], whole=True), Group(files[3:])], [],
                          tmp_path / "out2", tmp_path, cap=int(2.8 * 2**20))
    assert [x["path"] for x in whole["left_behind"]] == ["f1.bin", "f2.bin"] and set(whole["manifest"]) == {
        "f0.bin", "f3.bin"}


def _archive(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        member.size = len(data) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    path = tmp_path / "results.tar.gz"
    path.write_bytes(buffer.getvalue())
    return path


@pytest.mark.parametrize("name,kind", [("../evil.txt", tarfile.REGTYPE), ("/tmp/evil.txt", tarfile.REGTYPE),
                                       ("a/../../evil.txt", tarfile.REGTYPE), ("link", tarfile.SYMTYPE),
                                       ("dev", tarfile.CHRTYPE)])
def test_unpack_refuses_unsafe_members(tmp_path, name, kind):
    member = tarfile.TarInfo(name)
    member.type = kind
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    archive = _archive(tmp_path, member, b"evil")
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UserError, match="refusing links, devices and paths outside the folder"):
        gpu_pack.unpack([archive], into)
    assert list(into.iterdir()) == [] and not (tmp_path / "evil.txt").exists()


def test_unpack_wants_every_piece_and_the_right_bytes(tmp_path):
    out = tmp_path / "out"
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 2**20))
    summary = gpu_pack.pack([Group([big])], [], out, tmp_path, cap=10 * 2**20, part=2**20)
    assert len(summary["packed"]) == 4  # random bytes do not compress
    pieces = [out / n for n in summary["packed"]]
    with pytest.raises(UserError, match="all the pieces"):
        gpu_pack.unpack(pieces[:2] + pieces[3:], tmp_path / "into")
    (out / "gpu_jobs.json").write_text(json.dumps({"sha256": "0" * 64}))
    with pytest.raises(UserError, match="SHA-256 differs"):
        gpu_pack.unpack(pieces, tmp_path / "into")
    wrong = {"big.bin": {"bytes": 1, "sha256": "0" * 64}}
    (out / "gpu_jobs.json").write_text(json.dumps({"sha256": summary["sha256"], "manifest": wrong}))
    with pytest.raises(UserError, match="differ from their manifest: big.bin"):
        gpu_pack.unpack(pieces, tmp_path / "into")
    (out / "gpu_jobs.json").write_text(json.dumps({"sha256": summary["sha256"], "manifest": summary["manifest"]}))
    assert gpu_pack.unpack(pieces, tmp_path / "into")["files"] == ["big.bin"]
    assert (tmp_path / "into" / "big.bin").read_bytes() == big.read_bytes()


def test_out_must_be_empty_or_this_runners_own(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_jobs.log").write_text("old")
    (out / "results.tar.gz.part03").write_text("old")
    gpu_jobs.prepare(out)
    assert list(out.iterdir()) == []
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        gpu_jobs.prepare(out)
    assert (out / "notes.txt").exists()


def test_the_log_keeps_its_head_and_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_pack, "LOG_BYTES", 1000)
    monkeypatch.setattr(gpu_pack, "LOG_HEAD", 100)
    full = tmp_path / "full.log"
    full.write_bytes(b"H" * 100 + b"m" * 5000 + b"T" * 800)
    gpu_pack.write_log(full, tmp_path)
    kept = (tmp_path / "gpu_jobs.log").read_bytes()
    assert len(kept) <= 1000 + 40 and kept.startswith(b"H" * 100) and kept.endswith(b"T" * 800)
    assert b"bytes cut" in kept


def test_bench_gpu_is_pending_until_alone_and_whole(tmp_path):
    path = tmp_path / "gpu.json"
    assert gpu_jobs.gpu_pending(path) == "no gpu.json"
    record = {"conditions": "alone: no other process held the GPU in 40 samples", "incomplete": [], "dry_run": False}
    path.write_text(json.dumps(record))
    assert gpu_jobs.gpu_pending(path) is None
    path.write_text(json.dumps({**record, "conditions": "shared: other processes held the GPU in 3 of 40 samples"}))
    assert gpu_jobs.gpu_pending(path).startswith("gpu.json was not measured alone on the card: shared:")
    path.write_text(json.dumps({**record, "incomplete": ["mlx_lm: skipped: 12 s left of the budget"]}))
    assert gpu_jobs.gpu_pending(path) == "gpu.json is incomplete: mlx_lm: skipped: 12 s left of the budget"
    path.write_text(json.dumps({"conditions": "alone: ..."}))  # an older format
    assert "predates" in gpu_jobs.gpu_pending(path)
    path.write_text(json.dumps({**record, "dry_run": True}))
    assert gpu_jobs.gpu_pending(path) == "gpu.json is a dry run's"


def test_the_real_jobs_and_the_dry_run_are_the_intended_commands(tmp_path):
    jobs = gpu_jobs.default_jobs(2)
    assert [j.name for j in jobs] == ["a-claim", "b-decisive", "a-rest", "b-rest", "cost", "bench_gpu", "tests 1/2",
                                      "tests 2/2"]
    assert [j.command[2:] for j in jobs] == [
        ["experiments.evidence_full_length", "--stage", "claim", "--jobs", "3"],
        ["experiments.evidence_8x", "--stage", "decisive", "--jobs", "3"],
        ["experiments.evidence_full_length", "--stage", "all", "--jobs", "3"],
        ["experiments.evidence_8x", "--stage", "eval", "--jobs", "3"],
        ["experiments.bench_cost_curve", "--grad-checkpoint", "--skip-recorded"],
        ["benchmarks.bench_gpu", "--skip-tests"], ["benchmarks.gpu_tests", "--shard", "1/2"],
        ["benchmarks.gpu_tests", "--shard", "2/2"]]
    for job in jobs:  # each takes --budget
        help_text = subprocess.run([*job.command[:3], "--help"], capture_output=True, text=True, cwd=ROOT).stdout
        assert "--budget" in help_text
    dry = gpu_jobs.dry_jobs(tmp_path)
    assert dry[0].command[2:] == ["benchmarks.bench_gpu", "--dry-run", "--output", str(tmp_path / "gpu")]
    assert dry[0].pending() == "dry run"


def test_command_line_errors_are_one_line(tmp_path):
    (tmp_path / "x.txt").write_text("")
    for argv, message in ((["--budget", "10"], "--out is required"),
                          (["--budget", "0", "--out", str(tmp_path / "o")], "--budget must be > 0"),
                          (["--out", str(tmp_path)], "holds other files"),
                          (["--unpack", str(tmp_path / "x.txt")], "expected results.tar.gz"),
                          (["--out", str(tmp_path / "o"), "--returns", str(tmp_path / "x.txt")], "is a file")):
        proc = subprocess.run([sys.executable, "-m", "experiments.gpu_jobs", *argv], capture_output=True, text=True,
                              cwd=ROOT)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
