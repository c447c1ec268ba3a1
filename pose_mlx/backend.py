"""Make MLX fast on Linux CPUs by loading an optimized BLAS before `mlx.core` is imported.

The Linux `mlx-cpu` wheel links a reference BLAS (2-7 GFLOP/s on a 2048^2 fp32 matmul). Loading OpenBLAS
or MKL into the process with `RTLD_GLOBAL` *before* the first `import mlx.core` makes MLX's BLAS calls
resolve to it (~30-60x faster matmuls). Loading it after `mlx.core` has been imported has no effect.

Which library is fastest depends on the machine: on one 2-core AMD EPYC OpenBLAS 0.3.21 and MKL were close
(155-171 vs 184-187 GFLOP/s), on a 2-core AVX-512 Xeon OpenBLAS managed 16-30 against MKL's 98-192. So when
both are installed, ``auto`` measures each once per machine (a 1536^2 fp32 matmul in a child process, under
a second each), keeps the choice in a cache file and loads the faster one from then on.

Choice, through the environment variable ``POSE_MLX_BLAS``:
  unset or ``auto``  the fastest of OpenBLAS and MKL (the `mkl` PyPI package) present, measured once and cached
                     (``$XDG_CACHE_HOME/pose_mlx/blas.json``, one choice per Python environment and library
                     files); warn once if neither is found
  ``openblas`` / ``mkl``  only that library (warn if missing)
  ``off``            load nothing
  a file path        load exactly that shared library
Nothing is done on macOS (MLX uses Accelerate and Metal there) or on other non-Linux systems.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

ENV_VAR = "POSE_MLX_BLAS"

#: What `load_fast_blas` did: {"library": path or None, "reason": str, and under auto with both present,
#: "gflops": {path: measured GFLOP/s}}. Filled on first call.
status: dict = {}

#: A child's measurement: fp32 1536^2 @ 1536^2, the fastest of 7 after one warm-up (the least disturbed by
#: other processes), in GFLOP/s.
_PROBE = """
import json, time
import pose_mlx
import mlx.core as mx
n = 1536
a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
mx.eval(a, b); mx.eval(a @ b)
times = []
for _ in range(7):
    t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
print(json.dumps({"library": pose_mlx.backend.status["library"], "gflops": 2 * n**3 / min(times) / 1e9}))
"""


def _openblas_candidates() -> list[str]:
    """OpenBLAS shared libraries known to the dynamic loader (ldconfig), best first."""
    names = []
    for name in ("openblas", "openblasp", "openblas64_"):
        found = ctypes.util.find_library(name)
        if found:
            names.append(found)
    return names


def _mkl_candidates() -> list[str]:
    """`libmkl_rt` from the PyPI `mkl` package (installed under the environment's lib/), or the loader path."""
    prefixes = {sys.prefix, sys.base_prefix, sysconfig.get_config_var("prefix") or sys.prefix}
    paths = []
    for prefix in prefixes:
        paths += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
    found = ctypes.util.find_library("mkl_rt")
    if found:
        paths.append(found)
    return paths


def _try_load(candidates: list[str]) -> str | None:
    for path in candidates:
        if "mkl" in os.path.basename(path):
            # the same results run after run: MKL otherwise picks its thread count by the machine's load and its
            # code path by the CPU, and a resumed training run must repeat an uninterrupted one's losses
            os.environ.setdefault("MKL_DYNAMIC", "FALSE")
            os.environ.setdefault("MKL_CBWR", "AUTO")
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


def cache_path() -> Path:
    """Where `auto` keeps its measured choice: $XDG_CACHE_HOME/pose_mlx/blas.json (default ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pose_mlx" / "blas.json"


def _machine_key(candidates: list[str]) -> str:
    """What the choice depends on: the CPU model, its core count, the Python and each candidate's file."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    files = []
    for path in candidates:
        try:
            st = os.stat(path)
            files.append(f"{path}:{st.st_size}:{int(st.st_mtime)}")
        except OSError:  # a bare soname from ldconfig: its name stands for it
            files.append(path)
    return "|".join([cpu, str(os.cpu_count()), sys.executable, *files])


def measure(path: str, timeout: float = 120.0) -> float | None:
    """GFLOP/s of MLX's fp32 matmul with `path` loaded, measured in a child process (None if it failed)."""
    env = {**os.environ, ENV_VAR: path}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    return float(result["gflops"]) if result.get("library") else None


def _choices(cache: Path) -> dict:
    """The cache's measured choices, {machine key: {"order", "gflops"}} (a file of one choice, as written before
    several environments shared it, reads as that one)."""
    try:
        saved = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    if "key" in saved:
        return {saved["key"]: {"order": saved.get("order"), "gflops": saved.get("gflops")}}
    return saved.get("choices", {}) if isinstance(saved.get("choices"), dict) else {}


def _fastest(candidates: list[str]) -> tuple[list[str], dict]:
    """`candidates` fastest first, by the cached measurement for this machine key or a new one (written back).

    Every environment (interpreter, library files) keeps its own entry, so two virtual environments on one machine
    do not measure again in turn and flip each other's choice; and a lock makes the processes that start together
    measure once: the others wait for it and read the result, so they all load the same library."""
    import fcntl  # POSIX only: this runs on Linux alone

    key, cache = _machine_key(candidates), cache_path()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_name(cache.name + ".lock"), "w")
    except OSError:  # a read-only home: measure, and again next time
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        choices = _choices(cache)
        entry = choices.get(key)
        if isinstance(entry, dict) and entry.get("order") and entry.get("gflops"):
            return entry["order"], entry["gflops"]
        gflops = {path: measure(path) for path in candidates}
        order = sorted(candidates, key=lambda p: -(gflops[p] or 0.0))
        try:
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"choices": {**choices, key: {"order": order, "gflops": gflops}}}, indent=1))
            os.replace(tmp, cache)
        except OSError:  # measured again next time
            pass
        return order, gflops
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def _auto() -> None:
    """One library of each kind that exists; with both, the faster one by measurement."""
    found = [c[0] for c in (_openblas_candidates(), _mkl_candidates()) if c]
    if len(found) > 1:
        found, gflops = _fastest(found)
        status["gflops"] = gflops
    path = _try_load(found)
    status.update(library=path, reason="found" if path else "no OpenBLAS or MKL found")


def load_fast_blas(choice: str | None = None, warn: bool = True) -> dict:
    """Load an optimized BLAS according to `choice` (default: $POSE_MLX_BLAS or "auto"); idempotent.

    Returns the `status` dict: ``library`` (the loaded path, or None) and ``reason`` (a short explanation).
    """
    if status:
        return status
    choice = (choice or os.environ.get(ENV_VAR, "auto")).strip()
    lowered = choice.lower()
    if not sys.platform.startswith("linux"):
        status.update(library=None, reason=f"not needed on {sys.platform}")
        return status
    if lowered in ("off", "none", "0", "false", "stock"):
        status.update(library=None, reason=f"disabled by {ENV_VAR}={choice}")
        return status
    if "mlx.core" in sys.modules:
        status.update(library=None, reason="mlx.core was imported before pose_mlx; import pose_mlx first")
    elif lowered == "auto":
        _auto()
    elif lowered == "openblas":
        path = _try_load(_openblas_candidates())
        status.update(library=path, reason="found" if path else "OpenBLAS not found")
    elif lowered == "mkl":
        path = _try_load(_mkl_candidates())
        status.update(library=path, reason="found" if path else "MKL not found")
    else:
        path = _try_load([choice])
        status.update(library=path, reason="found" if path else f"cannot load {choice}")
    if status["library"] is None and warn:
        print(
            f"pose_mlx: warning: MLX runs with its slow reference BLAS ({status['reason']}); "
            "install the `mkl` extra (pip install 'pose-mlx[cpu,mkl]') or Debian's libopenblas0-pthread, "
            "or set POSE_MLX_BLAS",
            file=sys.stderr,
        )
    return status
