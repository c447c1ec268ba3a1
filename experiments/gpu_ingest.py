"""Records of this repository's GPU queue made elsewhere, taken in as our own:
`python -m experiments.gpu_ingest FOLDER [--main REF] [--commit]`.

FOLDER is what a run of `python -m experiments.gpu_jobs --out DIR` left on a lent GPU, named `<UTC date>-<commit>`:
its packed output (gpu_jobs.json, gpu_jobs.log, results.tar.gz or its .partNN pieces) and RUN.md (the commit it
ran at, the command line, the device, the start and end times, what was cut short). Before anything is written:

- the folder's name ends in a commit, RUN.md names it, and gpu_jobs.json's `code.commit`, when recorded, is it;
- the commit is in this repository and an ancestor of `--main` (default main);
- the code it ran is that commit's: every file of gpu_jobs.json's `code.files` has the SHA-256 of the commit's
  copy, and the commit has no such file that the run lacked;
- the pieces make the archive gpu_jobs.json describes, and every file in it matches its manifest entry.

Then the archive is unpacked into the checkout as `gpu_jobs --unpack` does (records under benchmarks/results/,
and the git-ignored state a next session carries), and the provenance is kept beside the records:
benchmarks/results/gpu_runs/<folder name>/ holds RUN.md and gpu_jobs.json. `--commit` then commits the records
and the provenance with the folder's name and RUN.md in the message. A folder already taken in is refused.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pose_mlx.errors import ArgumentParser, UserError, command

from benchmarks.common import ROOT
from experiments.gpu_pack import ARCHIVE, CODE, unpack

PROVENANCE = Path("benchmarks") / "results" / "gpu_runs"
NAME = re.compile(r"(\d{4}-\d{2}-\d{2}[0-9T:.Z-]*)-([0-9a-f]{7,40})")


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def claimed_commit(folder: Path, summary: dict, repo: Path) -> str:
    """The full commit the folder says it ran at, checked against its name, RUN.md and gpu_jobs.json."""
    found = NAME.fullmatch(folder.name)
    if not found:
        raise UserError(f"{folder.name}: not a run folder's name (<UTC date>-<commit>)")
    short = found.group(2)
    run = folder / "RUN.md"
    if not run.is_file() or short not in run.read_text():
        raise UserError(f"{folder}: RUN.md is missing or does not name the commit {short}")
    resolved = git(repo, "rev-parse", "--verify", "--quiet", f"{short}^{{commit}}", check=False)
    if resolved.returncode:
        raise UserError(f"{folder.name}: commit {short} is not in this repository")
    commit = resolved.stdout.strip()
    recorded = (summary.get("code") or {}).get("commit")
    if recorded and recorded != commit:
        raise UserError(f"{folder.name}: gpu_jobs.json says it ran at {recorded[:12]}, not at {short}")
    return commit


def code_differences(repo: Path, commit: str, files: dict[str, str]) -> list[str]:
    """The source files whose SHA-256 in the run's fingerprint differs from the commit's copy, or that only one of
    the two has (`CODE`'s patterns)."""
    listed = git(repo, "ls-tree", "-r", "--name-only", commit).stdout.splitlines()
    at_commit = {p for p in listed if any(covered(p, pattern) for pattern in CODE)}
    differ = sorted(set(files) ^ at_commit)
    for path in sorted(set(files) & at_commit):
        blob = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True, check=True)
        if hashlib.sha256(blob.stdout).hexdigest() != files[path]:
            differ.append(path)
    return differ


def covered(path: str, pattern: str) -> bool:
    """Whether `pattern` (as `Path.glob` reads it from the checkout's root) names `path`: part by part, "**" any
    number of folders."""
    parts, want = Path(path).parts, Path(pattern).parts
    if "**" in want:
        i = want.index("**")
        head, tail = want[:i], want[i + 1:]
        return len(parts) >= len(head) + len(tail) and covered("/".join(parts[:len(head)]), "/".join(head)) \
            and covered("/".join(parts[len(parts) - len(tail):]), "/".join(tail))
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, want))


def ingest(folder: Path, repo: Path = ROOT, main: str = "main") -> dict:
    """Check the run folder (the module's docstring), unpack it into `repo` and keep its provenance. Returns what
    was taken in: the commit, the files, the removed ones, the provenance folder."""
    summary_path = folder / "gpu_jobs.json"
    if not summary_path.is_file():
        raise UserError(f"{folder}: no gpu_jobs.json (not the output of experiments.gpu_jobs)")
    summary = json.loads(summary_path.read_text())
    kept = repo / PROVENANCE / folder.name
    if kept.exists():
        raise UserError(f"{folder.name} was taken in before ({kept.relative_to(repo)})")
    commit = claimed_commit(folder, summary, repo)
    if git(repo, "merge-base", "--is-ancestor", commit, main, check=False).returncode:
        raise UserError(f"{folder.name}: commit {commit[:12]} is not an ancestor of {main}")
    if not (summary.get("code") or {}).get("files"):
        raise UserError(f"{folder.name}: gpu_jobs.json has no fingerprint of the code it ran")
    differ = code_differences(repo, commit, summary["code"]["files"])
    if differ:
        raise UserError(f"{folder.name}: the code it ran is not commit {commit[:12]}'s: {', '.join(differ[:5])}")
    pieces = sorted(folder.glob(f"{ARCHIVE}*"))
    done = unpack(pieces, repo, summary)
    kept.mkdir(parents=True)
    for name in ("RUN.md", "gpu_jobs.json"):
        shutil.copyfile(folder / name, kept / name)
    return {"commit": commit, "files": done["files"], "removed": done["removed"],
            "provenance": str(kept.relative_to(repo))}


def commit_records(repo: Path, folder: Path, taken: dict) -> str:
    """Commit the records under benchmarks/results (git-ignored state stays out) with the provenance."""
    git(repo, "add", "-A", "benchmarks/results")
    message = (f"GPU run {folder.name} taken in (experiments.gpu_ingest): {len(taken['files'])} files at "
               f"{taken['commit'][:12]}\n\n" + (folder / "RUN.md").read_text())
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


@command("gpu_ingest")
def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m experiments.gpu_ingest", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a run folder, <UTC date>-<commit>")
    p.add_argument("--main", default="main", help="the branch the run's commit must be an ancestor of (default main)")
    p.add_argument("--commit", action="store_true", help="commit the records and their provenance")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder")
    taken = ingest(args.folder.resolve(), ROOT, args.main)
    print(f"took in {len(taken['files'])} files from {args.folder.name} (commit {taken['commit'][:12]}), removed "
          f"{len(taken['removed'])}; provenance in {taken['provenance']}")
    if args.commit:
        print(f"committed {commit_records(ROOT, args.folder.resolve(), taken)[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
