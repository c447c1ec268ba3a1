"""tools/gpu_wheels.py and tools/gpu_session.sh, the offline CUDA set-up: pieces laid out into call folders and
joined back byte for byte (a missing or damaged piece named with its call), the pip command of exactly the installed
versions (and a real download of the small wheels, skipped when PyPI is unreachable), the host texts, what a call
carries, and the session script end to end on a CPU with a fake wheel: it stashes, joins, installs and then stops
because MLX's default device is not the GPU."""

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from pose_mlx.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "tools" / "gpu_session.sh"
_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
gw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gw)
MiB = 2**20


def _files(folder: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    contents = {name: os.urandom(size) for name, size in sizes.items()}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    return contents


def test_layout_splits_into_calls_and_join_restores_every_byte(tmp_path):
    dest = tmp_path / ".gpu"
    contents = _files(dest / "fetched", {"big.whl": int(2.5 * MiB), "small.whl": 300_000, "model.gguf": MiB + 7})
    manifest = gw.layout(sorted((dest / "fetched").iterdir()), dest, call_bytes=MiB)
    calls = sorted(p.name for p in dest.glob("call*"))
    assert manifest["calls"] == len(calls) >= 5
    for call in calls:  # each call folder within its size, names as a device call returns them
        files = list((dest / call).iterdir())
        assert sum(f.stat().st_size for f in files if f.name != gw.MANIFEST) <= MiB
        assert json.loads((dest / call / gw.MANIFEST).read_text()) == manifest
        assert all(set(f.name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
                   for f in files)
    big = next(f for f in manifest["files"] if f["name"] == "big.whl")
    assert [p["name"] for p in big["pieces"]] == ["big.whl.part00", "big.whl.part01", "big.whl.part02"]
    each = int(2.5 * MiB) // 3 + 1  # equal pieces, the last one the rest
    assert [p["size"] for p in big["pieces"]] == [each, each, int(2.5 * MiB) - 2 * each]

    stash = tmp_path / "stash"
    first = tmp_path / "carried1"
    (first / calls[0]).mkdir(parents=True)
    for f in (dest / calls[0]).iterdir():
        (first / calls[0] / f.name).write_bytes(f.read_bytes())
    gw.stash(first, stash)
    with pytest.raises(UserError, match="pieces missing") as missing:
        gw.join(stash)
    assert all(call in str(missing.value) for call in calls[1:])
    gw.stash(dest, stash)  # the rest (and call1 again: unchanged, so not copied twice)
    joined = {p.name: p for p in gw.join(stash)}
    assert {name: joined[name].read_bytes() for name in contents} == contents
    assert joined["model.gguf"].parent.name == "models" and joined["big.whl"].parent.name == "files"
    assert gw.join(stash) == list(joined.values())  # again: already joined and checked


def test_a_damaged_piece_is_named(tmp_path):
    dest = tmp_path / ".gpu"
    _files(dest / "fetched", {"w.whl": 3 * MiB // 2})
    gw.layout([dest / "fetched" / "w.whl"], dest, call_bytes=MiB)
    stash = tmp_path / "stash"
    gw.stash(dest, stash)
    piece = stash / "w.whl.part01"
    piece.write_bytes(b"x" * piece.stat().st_size)
    with pytest.raises(UserError, match="do not match the manifest's SHA-256; carry its calls again"):
        gw.join(stash)
    assert not (stash / "files" / "w.whl").exists()


def test_the_download_command_pins_exactly_what_is_installed(tmp_path):
    pins = gw.versions()
    names = ("mlx", "mlx-lm", "gguf")
    assert {k: pins[k] for k in names} == {k: metadata.version(k) for k in names}
    assert f"mlx-cuda-13=={pins['mlx-cuda-13']}" in [r.split(";")[0].replace(" ", "") for r in metadata.requires("mlx")]
    cmd = gw.download_command(pins, tmp_path)
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms[0] == "manylinux_2_35_x86_64" and {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                         "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(platforms)
    assert cmd[-4:] == [f"{k}=={v}" for k, v in pins.items()]


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is unreachable")
def test_the_small_wheels_download_for_the_gpu_machine(tmp_path):
    """The real command on the small wheels (mlx-cuda-13's ~90 MB is left out): cp312 and pure ones are found."""
    pins = {k: v for k, v in gw.versions().items() if k in ("mlx", "gguf")}
    subprocess.run(gw.download_command(pins, tmp_path), check=True, capture_output=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"gguf-{pins['gguf']}-py3-none-any.whl",
                     f"mlx-{pins['mlx']}-cp312-cp312-manylinux_2_35_x86_64.whl"]


def test_host_texts_go_where_the_protocols_read_them(tmp_path):
    source = tmp_path / "usr" / "share" / "texts"
    _files(source, {"a.txt": 100, "b.txt": 50})
    stash = tmp_path / "stash"
    (stash / "files").mkdir(parents=True)
    gw.tar_host([source], stash / "files" / gw.HOST_TAR)
    names = tarfile.open(stash / "files" / gw.HOST_TAR).getnames()
    assert all(not n.startswith("/") for n in names) and str(source.relative_to("/")) in names
    root = tmp_path / "root"
    assert sorted(gw.extract_host(stash, root)) == [str((source / n).relative_to("/")) for n in ("a.txt", "b.txt")]
    assert (root / source.relative_to("/") / "a.txt").read_bytes() == (source / "a.txt").read_bytes()
    assert gw.extract_host(tmp_path / "nothing", root) == []
    paths = gw.host_paths()
    assert all(p.is_absolute() and p.exists() for p in paths)


def test_the_state_to_resume_travels_relative_to_the_checkout(tmp_path, monkeypatch):
    """What an earlier session left to resume from (checkpoint files, a partial record) is tarred relative to the
    checkout, split and joined like any carried file, and lands at the same paths in the GPU machine's copy."""
    checkout = tmp_path / "checkout"
    monkeypatch.setattr(gw, "ROOT", checkout)
    files = {"out/real_model/trained/run.partial/checkpoint/weights-4.safetensors": MiB + 7,
             "benchmarks/results/real_model/protocol_full/eval/x.passkey.32768.partial.json.partial.jsonl": 300}
    for name, size in files.items():
        _files((checkout / name).parent, {Path(name).name: size})
    dest = tmp_path / ".gpu"
    (dest / "fetched").mkdir(parents=True)
    gw.tar_state(sorted(files), dest / "fetched" / gw.STATE_TAR)
    assert sorted(tarfile.open(dest / "fetched" / gw.STATE_TAR).getnames()) == sorted(files)
    gw.layout(sorted((dest / "fetched").iterdir()), dest, call_bytes=MiB)  # split over two calls
    stash = tmp_path / "stash"
    gw.stash(dest, stash)
    gw.join(stash)
    there = tmp_path / "gpu-checkout"
    assert sorted(gw.extract_state(stash, there)) == sorted(files)
    assert all((there / n).read_bytes() == (checkout / n).read_bytes() for n in files)
    assert gw.extract_state(tmp_path / "nothing", there) == []


def test_size_counts_what_a_call_carries():
    git = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout (a copy of the working tree)")
    listed = git.stdout.decode().split("\0")
    expected = sum((ROOT / p).stat().st_size for p in set(listed) if p and (ROOT / p).is_file()
                   and not (ROOT / p).is_symlink())
    shared = ROOT / "shared"
    expected += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file()) if shared.is_dir() else 0
    total, by_folder = gw.travel_size([])
    assert total == expected == sum(by_folder.values())
    with_venv, _ = gw.travel_size([".venv"]) if (ROOT / ".venv").is_dir() else (total, None)
    assert with_venv >= total


def _wheel(folder: Path) -> Path:
    """A real, minimal wheel of a package `fakepkg`."""
    files = {"fakepkg/__init__.py": b"VALUE = 42\n",
             "fakepkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n",
             "fakepkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    record = "".join(f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n" for n, d in files.items())
    path = folder / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("fakepkg-1.0.dist-info/RECORD", record + "fakepkg-1.0.dist-info/RECORD,,\n")
    return path


def test_the_session_script_stashes_joins_installs_and_wants_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0
    dest = tmp_path / ".gpu"
    (dest / "fetched").mkdir(parents=True)
    _wheel(dest / "fetched")
    _files(dest / "fetched", {"blob.bin": 3 * MiB // 2})
    gw.layout(sorted((dest / "fetched").iterdir()), dest, call_bytes=MiB)
    first, rest = tmp_path / "carried1", tmp_path / "carried2"
    for target, calls in ((first, ["call1"]), (rest, [p.name for p in dest.glob("call*") if p.name != "call1"])):
        for call in calls:
            (target / call).mkdir(parents=True)
            for f in (dest / call).iterdir():
                (target / call / f.name).write_bytes(f.read_bytes())
    env = dict(os.environ, POSE_MLX_GPU_STASH=str(tmp_path / "stash"), POSE_MLX_GPU_SITE=str(tmp_path / "site"),
               PYTHON=sys.executable, POSE_MLX_GPU_HOST_ROOT=str(tmp_path / "root"), OUT=str(tmp_path / "out"))
    stashed = subprocess.run(["bash", str(SESSION), "--stash"], env={**env, "POSE_MLX_GPU_CARRIED": str(first)},
                             capture_output=True, text=True)
    assert stashed.returncode == 0, stashed.stderr
    assert "stashed" in stashed.stdout and (tmp_path / "stash" / "manifest.json").is_file()
    bad = subprocess.run(["bash", str(SESSION), "--frobnicate"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu_session: error: unknown argument --frobnicate " \
                                                        "(see --help)"
    import mlx.core as mx

    if mx.default_device() == mx.gpu:  # checked before the run: there it would go on to run the GPU jobs
        pytest.skip("MLX's default device is a GPU here: the script's last call runs the real GPU jobs")
    run = subprocess.run(["bash", str(SESSION), "--budget", "100"], env={**env, "POSE_MLX_GPU_CARRIED": str(rest)},
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "MLX's default device is Device(cpu, 0), not the GPU" in run.stderr
    assert (tmp_path / "site" / "fakepkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (tmp_path / "stash" / "files" / "blob.bin").stat().st_size == 3 * MiB // 2
    assert not (tmp_path / "out").exists()


def test_download_refuses_a_folder_with_pieces_in_it(tmp_path):
    (tmp_path / "call1").mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_wheels.py"), "download", "--dest",
                           str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("gpu_wheels.py: error: --dest") \
        and len(proc.stderr.strip().splitlines()) == 1
