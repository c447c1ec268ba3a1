"""experiments.gpu_ingest on synthetic run folders in a throw-away git repository: a good run is checked,
unpacked and kept with its provenance (and committed); a run whose commit is not on main, whose code differs from
its commit's, whose piece was damaged, whose RUN.md does not name it, or that was taken in before, is refused
with nothing written."""

import json
import subprocess

import pytest

from experiments import gpu_ingest, gpu_pack
from experiments.gpu_pack import Group
from pose_mlx.errors import UserError


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository with one commit on main: source files the fingerprint covers, a results folder."""
    root = tmp_path / "repo"
    for name, text in {"pose_mlx/core.py": "x = 1\n", "pose_mlx/sub/deep.py": "y = 2\n",
                       "experiments/job.py": "print('job')\n", "benchmarks/protocols/p.yaml": "name: p\n",
                       "pyproject.toml": "[project]\n", "benchmarks/results/old.json": "{}\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root.parent, "init", "-q", "-b", "main", str(root))
    git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "start")
    return root


def run_folder(tmp_path, repo, commit=None, code=None, name=None, run_md=None):
    """What gpu_jobs leaves on a GPU that ran `repo`'s HEAD: a new record and a changed one, packed, plus RUN.md."""
    gpu = tmp_path / "gpu-checkout"
    (gpu / "benchmarks" / "results" / "real_model").mkdir(parents=True)
    (gpu / "benchmarks" / "results" / "real_model" / "new.json").write_text('{"ppl": 6.0}\n')
    (gpu / "benchmarks" / "results" / "old.json").write_text('{"changed": true}\n')
    commit = commit or git(repo, "rev-parse", "HEAD")
    folder = tmp_path / "runs" / (name or f"2026-11-30T10:00Z-{commit[:10]}")
    files = sorted((gpu / "benchmarks" / "results").rglob("*.json"))
    packed = gpu_pack.pack([Group(files)], [], folder, gpu, 60 * 2**20)
    summary = {"sha256": packed["sha256"], "manifest": packed["manifest"], "packed": packed["packed"],
               "code": code or gpu_pack.code_fingerprint(repo)}
    (folder / "gpu_jobs.json").write_text(json.dumps(summary))
    (folder / "gpu_jobs.log").write_text("log\n")
    (folder / "RUN.md").write_text(run_md or f"commit: {commit}\ncommand: python -m experiments.gpu_jobs\n")
    return folder


def test_a_good_run_is_taken_in_with_its_provenance_and_committed(tmp_path, repo):
    folder = run_folder(tmp_path, repo)
    taken = gpu_ingest.ingest(folder, repo)
    assert sorted(taken["files"]) == ["benchmarks/results/old.json", "benchmarks/results/real_model/new.json"]
    assert json.loads((repo / "benchmarks/results/old.json").read_text()) == {"changed": True}
    kept = repo / "benchmarks" / "results" / "gpu_runs" / folder.name
    assert sorted(p.name for p in kept.iterdir()) == ["RUN.md", "gpu_jobs.json"]
    head = gpu_ingest.commit_records(repo, folder, taken)
    message = git(repo, "log", "-1", "--format=%B")
    assert folder.name in message and "command: python -m experiments.gpu_jobs" in message
    assert git(repo, "show", "--name-only", "--format=", head).splitlines() == [
        f"benchmarks/results/gpu_runs/{folder.name}/RUN.md", f"benchmarks/results/gpu_runs/{folder.name}/gpu_jobs.json",
        "benchmarks/results/old.json", "benchmarks/results/real_model/new.json"]
    with pytest.raises(UserError, match="taken in before"):
        gpu_ingest.ingest(folder, repo)


def refused(folder, repo, message):
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    with pytest.raises(UserError, match=message):
        gpu_ingest.ingest(folder, repo)
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts} == before


def test_a_commit_off_main_is_refused(tmp_path, repo):
    git(repo, "checkout", "-q", "-b", "side")
    (repo / "pose_mlx" / "core.py").write_text("x = 2\n")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "side")
    folder = run_folder(tmp_path, repo)
    git(repo, "checkout", "-q", "main")
    refused(folder, repo, "is not an ancestor of main")


def test_code_that_is_not_the_commits_is_refused(tmp_path, repo):
    code = gpu_pack.code_fingerprint(repo)
    code["files"]["pose_mlx/sub/deep.py"] = "0" * 64  # edited on the GPU machine after the checkout
    refused(run_folder(tmp_path, repo, code=code), repo, "is not commit .*'s: pose_mlx/sub/deep.py")
    code = gpu_pack.code_fingerprint(repo)
    del code["files"]["experiments/job.py"]  # a file the run did not have
    refused(run_folder(tmp_path / "b", repo, code=code), repo, "experiments/job.py")


def test_damage_and_wrong_names_are_refused(tmp_path, repo):
    folder = run_folder(tmp_path, repo)
    archive = folder / "results.tar.gz"
    archive.write_bytes(archive.read_bytes()[:-10] + b"0123456789")
    refused(folder, repo, "SHA-256 differs")
    refused(run_folder(tmp_path / "b", repo, run_md="commit: unknown\n"), repo, "does not name the commit")
    refused(run_folder(tmp_path / "c", repo, name="yesterday"), repo, "not a run folder's name")
    refused(run_folder(tmp_path / "d", repo, commit="0123456789abcdef"), repo, "not in this repository")
