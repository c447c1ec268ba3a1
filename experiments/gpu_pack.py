"""What a GPU session brings back, within what one device call returns, and how it is taken up again here or in the
next session: the archive's pieces, their manifest, the state that resumes a fine-tuning, and the code it ran.

- `Group`: files packed in priority order, each file as far as it fits, or (`whole`) all of them or none;
- `resume_files(run)`: what resumes an unfinished fine-tuning exactly (`pose_mlx.finetune --resume`): its
  run.json, its log and its last checkpoint (the state.json and the two files it names: the LoRA weights and the
  AdamW state, float32), not the checkpoint before it;
- `pack` writes results.tar.gz (or `.partNN` pieces) with its SHA-256 and a manifest of every file's size and
  SHA-256; `unpack` checks both, refuses unsafe members and extracts;
- `keep` puts a call's return aside on the machine and `replay` unpacks those of earlier calls of the same session
  into the fresh checkout of the next call;
- `code_fingerprint` hashes every source file the jobs run (and names the commit when the checkout is a git one),
  so that records made elsewhere can be checked against the commit they claim.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from pose_mlx.errors import UserError

PART_BYTES = 15 * 2**20
ARCHIVE, REMOVED = "results.tar.gz", ".gpu_jobs-removed.json"
LOG_BYTES, LOG_HEAD = 2**20, 64 * 2**10
#: The source the jobs run: fingerprinted into gpu_jobs.json's `code`.
CODE = ("pose_mlx/**/*.py", "benchmarks/*.py", "experiments/*.py", "benchmarks/protocols/*.yaml", "tools/*.py",
        "tools/*.sh", "pyproject.toml")


@dataclass
class Group:
    """Files to pack (paths inside the base folder), and whether they go all together or not at all."""

    files: list[Path]
    whole: bool = False


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(roots: list[Path]) -> dict[Path, tuple[int, int]]:
    """{file: (mtime_ns, size)} of every file under `roots` (those that exist)."""
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for root in roots if root.exists()
            for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file()}


def changes(before: dict, after: dict) -> tuple[list[Path], list[Path]]:
    """(files new or changed, files removed) between two snapshots."""
    return sorted(p for p, stamp in after.items() if before.get(p) != stamp), sorted(set(before) - set(after))


def resume_files(run: Path) -> list[Path]:
    """The files that resume the unfinished fine-tuning in `run` (a `<output>.partial` folder): run.json, log.jsonl,
    checkpoint/state.json and the files it names; [] when it has no checkpoint yet."""
    state = run / "checkpoint" / "state.json"
    try:
        named = json.loads(state.read_text())["files"].values()
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    files = [run / "run.json", run / "log.jsonl", state, *(run / "checkpoint" / n for n in named)]
    return [f for f in files if f.is_file()]


def pack(groups: list[Group], removed: list[Path], out: Path, base: Path, cap: int, part: int = PART_BYTES) -> dict:
    """`groups` (in priority order; paths inside `base`, stored relative to it) and the list of `removed` ones as
    out/results.tar.gz, split into `part`-byte pieces when larger, at most `cap` bytes in all: what would pass the
    cap is left behind (a whole group's files together) and listed. Returns the pieces' names, the SHA-256, the
    manifest ({path: {"bytes", "sha256"}}) and what was left behind."""
    buffer, left_behind, manifest = io.BytesIO(), [], {}
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        names = json.dumps([str(p.relative_to(base)) for p in removed]).encode()
        info = tarfile.TarInfo(REMOVED)
        info.size, info.mtime = len(names), int(time.time())
        tar.addfile(info, io.BytesIO(names))
        for group in groups:
            sizes = [f.stat().st_size for f in group.files]
            units = [list(zip(group.files, sizes))] if group.whole else [[pair] for pair in zip(group.files, sizes)]
            for unit in units:
                need = sum(s + s // 500 for _, s in unit) + 256 * 2**10  # the compressor's pending bytes too
                if buffer.tell() + need > cap:
                    left_behind += [{"path": str(f.relative_to(base)), "bytes": s} for f, s in unit]
                    continue
                for f, size in unit:
                    name = str(f.relative_to(base))
                    manifest[name] = {"bytes": size, "sha256": sha256(f.read_bytes())}
                    tar.add(f, arcname=name, recursive=False)
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    count = max(1, math.ceil(len(data) / part))
    pieces = [ARCHIVE] if count == 1 else [f"{ARCHIVE}.part{i:02d}" for i in range(count)]
    for i, name in enumerate(pieces):
        (out / name).write_bytes(data[i * part:(i + 1) * part])
    return {"packed": pieces, "bytes": len(data), "sha256": sha256(data), "manifest": manifest,
            "left_behind": left_behind}


def _safe(member: tarfile.TarInfo) -> bool:
    path = Path(member.name)
    return (member.isfile() or member.isdir()) and not path.is_absolute() and ".." not in path.parts \
        and member.name not in ("", ".")


def unpack(files: list[Path], into: Path, summary: dict | None = None) -> dict:
    """Join `files` (results.tar.gz, or all its pieces), check them (none missing; the archive's SHA-256 and every
    file's against `summary`, the gpu_jobs.json of the run, or the one beside them), refuse unsafe members, extract
    into `into` and remove the files the jobs removed."""
    files = sorted((Path(f) for f in files), key=lambda p: p.name)
    names = [f.name for f in files]
    expected = [ARCHIVE] if names == [ARCHIVE] else [f"{ARCHIVE}.part{i:02d}" for i in range(len(files))]
    if names != expected:
        raise UserError(f"--unpack: expected {', '.join(expected)} (all the pieces, once each); got {', '.join(names)}")
    data = b"".join(f.read_bytes() for f in files)
    beside = files[0].parent / "gpu_jobs.json"
    summary = summary if summary is not None else json.loads(beside.read_text()) if beside.is_file() else {}
    if summary.get("sha256") and sha256(data) != summary["sha256"]:
        raise UserError("--unpack: the pieces do not make the archive gpu_jobs.json describes (SHA-256 differs)")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as error:
        raise UserError(f"--unpack: not a whole results archive ({error})") from None
    bad = [m.name for m in members if not _safe(m)]
    if bad:
        raise UserError(f"--unpack: refusing links, devices and paths outside the folder: {', '.join(bad[:3])}")
    manifest = summary.get("manifest") or {}
    wrong = [m.name for m in members if m.isfile() and m.name in manifest
             and sha256(tar.extractfile(m).read()) != manifest[m.name]["sha256"]]
    if wrong:
        raise UserError(f"--unpack: files differ from their manifest: {', '.join(wrong[:3])}")
    removed = json.loads(tar.extractfile(REMOVED).read()) if REMOVED in tar.getnames() else []
    extracted = [m for m in members if m.name != REMOVED]
    tar.extractall(into, members=extracted, filter="data")
    gone = []
    for name in removed:
        target = into / name
        if ".." not in Path(name).parts and not Path(name).is_absolute() and target.is_file():
            target.unlink()
            gone.append(name)
    return {"files": [m.name for m in extracted if m.isfile()], "removed": gone}


def replay(returns: Path, into: Path) -> list[str]:
    """Unpack into `into`, in order, what earlier calls of this session returned and `keep` put in `returns` (one
    folder per call, 00, 01, ...): a call's checkout is copied afresh, so their records would be gone. The names of
    the folders replayed."""
    done = []
    for folder in sorted(returns.iterdir()) if returns.is_dir() else []:
        pieces = sorted(folder.glob(f"{ARCHIVE}*"))
        if pieces:
            unpack(pieces, into)
            done.append(folder.name)
    return done


def keep(out: Path, returns: Path) -> Path:
    """Copy this call's return (gpu_jobs.json and the archive's pieces in `out`) into the next folder of `returns`,
    for the session's next call to `replay`."""
    returns.mkdir(parents=True, exist_ok=True)
    folder = returns / f"{len(list(returns.iterdir())):02d}"
    folder.mkdir()
    for f in sorted(out.iterdir()):
        if f.name == "gpu_jobs.json" or f.name.startswith(ARCHIVE):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def write_log(full: Path, out: Path) -> None:
    """out/gpu_jobs.log: the jobs' whole output, or its first LOG_HEAD bytes and last part when over LOG_BYTES."""
    data = full.read_bytes()
    if len(data) > LOG_BYTES:
        cut = f"\n[... {len(data) - LOG_BYTES + 100} bytes cut ...]\n".encode()
        data = data[:LOG_HEAD] + cut + data[-(LOG_BYTES - LOG_HEAD - 100):]
    (out / "gpu_jobs.log").write_bytes(data)


def code_fingerprint(root: Path) -> dict:
    """{"commit": the checkout's HEAD (None outside git), "files": {path: SHA-256} of every file `CODE` names}."""
    files = sorted({p for pattern in CODE for p in root.glob(pattern) if p.is_file()})
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:  # no git on the machine
        head = None
    return {"commit": head.stdout.strip() if head is not None and head.returncode == 0 else None,
            "files": {str(p.relative_to(root)): sha256(p.read_bytes()) for p in files}}
