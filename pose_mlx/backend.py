"""Make MLX fast on Linux CPUs by loading an optimized BLAS before `mlx.core` is imported.

The Linux `mlx-cpu` wheel links a reference BLAS (~7 GFLOP/s on a 2048^2 fp32 matmul). Loading OpenBLAS
or MKL into the process with `RTLD_GLOBAL` *before* the first `import mlx.core` makes MLX's BLAS calls
resolve to it (~30x faster matmuls). Loading it after `mlx.core` has been imported has no effect.

Choice, through the environment variable ``POSE_MLX_BLAS``:
  unset or ``auto``  try OpenBLAS, then MKL (the `mkl` PyPI package), warn once if neither is found
  ``openblas`` / ``mkl``  only that library (warn if missing)
  ``off``            load nothing
  a file path        load exactly that shared library
Nothing is done on macOS (MLX uses Accelerate and Metal there) or on other non-Linux systems.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import sysconfig

ENV_VAR = "POSE_MLX_BLAS"

#: What `load_fast_blas` did: {"library": path or None, "reason": str}. Filled on first call.
status: dict = {}


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
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


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
        path = _try_load(_openblas_candidates()) or _try_load(_mkl_candidates())
        status.update(library=path, reason="found" if path else "no OpenBLAS or MKL found")
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
            "install Debian's libopenblas0-pthread or `pip install mkl`, or set POSE_MLX_BLAS",
            file=sys.stderr,
        )
    return status
