"""Build and load the vectorized CPU kernels (`cpu_kernels.cpp`) on this machine, once, with a fallback.

The kernels are an MLX extension: C++ primitives linked against the installed MLX (`mlx/lib/libmlx.so`, headers in
`mlx/include`) and bound with nanobind in MLX's own nanobind domain, so they take and return `mx.array`s and run
inside MLX's graph (lazily, under `mx.compile`, `mx.checkpoint` and `nn.value_and_grad`). They are compiled at first
use rather than at install: the build must match the MLX that is installed (its C++ ABI changes between versions),
and a compiler may be missing. The result is cached per environment under
`$XDG_CACHE_HOME/pose_mlx/kernels/<key>/` (key: a hash of the source, MLX's and nanobind's versions and files, the
Python ABI and the compiler), built under a file lock so processes starting together build once, and checked
against NumPy on small inputs before use. A failed build is remembered under the same key (no retry until
something in the key changes) and everything falls back to MLX's own kernels: slower, same results.

Where: Linux only (MLX's CPU kernels on macOS and on Arm are already vectorized; on Apple silicon training runs on
Metal). `POSE_MLX_KERNELS`: unset or ``auto`` (build if possible), ``off`` (never), ``require`` (a failure raises).
`status` says what happened: {"available": bool, "reason": str, ...}.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ENV_VAR = "POSE_MLX_KERNELS"
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_layers.cpp"))
HEADERS = (Path(__file__).with_name("cpu_common.h"),)
MODULE = "_cpu_kernels"

#: What `load` did: {"available": bool, "reason": str, "path": str, "built_seconds": float, "threads": int}.
status: dict = {}
_module = None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pose_mlx" / "kernels"


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++, g++ or clang++ on the PATH."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(shlex.split(named)[0]) and named
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


def _cpu() -> str:
    """The CPU's model and feature flags (the build is for this CPU: -march=native), from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "; ".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _inputs(cxx: str) -> dict:
    """Everything the build depends on (paths and versions), or a "missing" entry naming what is not there."""
    import mlx.core as mx

    try:
        import nanobind
    except ImportError:
        return {"missing": "nanobind is not installed (pip install 'pose-mlx[cpu]')"}
    mlx_dir = Path(mx.__file__).resolve().parent
    library = mlx_dir / "lib" / "libmlx.so"
    if not (mlx_dir / "include" / "mlx" / "primitives.h").is_file() or not library.is_file():
        return {"missing": f"MLX's headers or libmlx.so are not in {mlx_dir}"}
    nb_dir = Path(nanobind.__file__).resolve().parent
    version = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True).stdout
    return {
        "source": hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest(),
        "mlx": mx.__version__, "mlx_dir": str(mlx_dir), "libmlx": [library.stat().st_size, library.stat().st_mtime],
        "nanobind": nanobind.__version__, "nanobind_dir": str(nb_dir),
        "python": sys.version, "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "python_include": sysconfig.get_paths()["include"], "machine": platform.machine(), "cpu": _cpu(),
        "compiler": [cxx, version.splitlines()[0] if version else ""],
    }


def _command(cxx: str, inputs: dict, output: Path) -> list[str]:
    mlx_dir, nb_dir = Path(inputs["mlx_dir"]), Path(inputs["nanobind_dir"])
    return [
        *shlex.split(cxx), "-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno", "-fopenmp-simd",
        "-DNDEBUG", "-DNB_DOMAIN=mlx", f"-I{inputs['python_include']}", f"-I{nb_dir / 'include'}",
        f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{mlx_dir / 'include'}",
        *map(str, SOURCES), str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(output),
    ]


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(cxx: str, inputs: dict, folder: Path) -> dict:
    """Compile into `folder` (atomically: a temporary file renamed into place); returns the build record."""
    target = folder / (MODULE + inputs["ext_suffix"])
    print("pose_mlx: building the vectorized CPU training kernels for this machine (once, about 10-60 s)",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / target.name
        done = subprocess.run(_command(cxx, inputs, partial), capture_output=True, text=True)
        if done.returncode != 0:
            return {"ok": False, "reason": "the compiler failed", "log": (done.stdout + done.stderr)[-4000:]}
        os.replace(partial, target)
    return {"ok": True, "path": str(target), "built_seconds": round(time.perf_counter() - started, 1)}


def _checked(path: str):
    """Import the built module and compare each kernel with NumPy on small inputs; raises on any disagreement."""
    import mlx.core as mx
    import numpy as np

    spec = importlib.util.spec_from_file_location(f"pose_mlx.kernels.{MODULE}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = np.linspace(-30, 30, 3 * 37, dtype=np.float32).reshape(3, 37)
    p, lse = module.softmax_rows(mx.array(x), True, 2, 3)
    visible = [3, 4, 5]
    for row, n in enumerate(visible):
        ref = np.exp(x[row, :n].astype(np.float64) - np.log(np.exp(x[row, :n].astype(np.float64)).sum()))
        if not (np.allclose(np.array(p)[row, :n], ref, rtol=1e-5, atol=1e-30) and not np.array(p)[row, n:].any()):
            raise RuntimeError("softmax_rows disagrees with NumPy")
    y = np.array(module.swiglu(mx.array(x), mx.array(x)))
    if not np.allclose(y, x * x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-6):
        raise RuntimeError("swiglu disagrees with NumPy")
    return module


def _prepare() -> tuple[object | None, dict]:
    cxx = compiler()
    if cxx is None:
        return None, {"reason": "no C++ compiler found (install g++ or set CXX)"}
    inputs = _inputs(cxx)
    if "missing" in inputs:
        return None, {"reason": inputs["missing"]}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache_root() / key
    record_path = folder / "build.json"
    with _locked(cache_root() / f"{key}.lock"):
        folder.mkdir(parents=True, exist_ok=True)
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
        if record is None or (record["ok"] and not Path(record["path"]).is_file()):
            record = _build(cxx, inputs, folder)
            if record["ok"]:
                try:
                    _checked(record["path"])
                except Exception as error:  # a wrong build must not be used: remembered, then the fallback
                    record = {"ok": False, "reason": f"the built kernels failed their check ({error})"}
            record_path.write_text(json.dumps(record, indent=1))
    if not record["ok"]:
        return None, {"reason": f"{record['reason']} (cached in {folder}; delete it to retry)", "log": record.get("log")}
    module = _checked(record["path"])
    return module, {"reason": "built", "path": record["path"], "built_seconds": record["built_seconds"],
                    "threads": module.threads()}


def load():
    """The kernels module, or None where they are unavailable (see `status`); builds on first call."""
    global _module
    if status:
        return _module
    choice = os.environ.get(ENV_VAR, "auto").strip().lower()
    if choice not in {"auto", "off", "require"}:
        raise ValueError(f"{ENV_VAR}={choice!r}: use auto, off or require")
    if choice == "off":
        status.update(available=False, reason=f"turned off by {ENV_VAR}=off")
    elif not sys.platform.startswith("linux"):
        status.update(available=False, reason="not needed: MLX's own CPU kernels are vectorized on this platform")
    else:
        _module, found = _prepare()
        status.update(available=_module is not None, **found)
        if _module is None:
            if choice == "require":
                raise RuntimeError(f"{ENV_VAR}=require: the CPU kernels are unavailable: {found['reason']}")
            print(f"pose_mlx: the vectorized CPU kernels are unavailable ({found['reason']}); training uses MLX's "
                  "own kernels, which give the same results more slowly", file=sys.stderr)
    return _module


__all__ = ["ENV_VAR", "cache_root", "compiler", "load", "status"]
