"""Fast-BLAS loading (pose_mlx.backend); each case runs in a fresh interpreter since loading is process-wide."""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import pose_mlx
from pose_mlx import backend
maps = open('/proc/self/maps').read() if sys.platform.startswith('linux') else ''
print(json.dumps({"status": backend.status, "mlx_imported": "mlx.core" in sys.modules,
                  "openblas_mapped": "openblas" in maps, "mkl_mapped": "mkl_rt" in maps}))
"""


def probe(blas=None, code=PROBE):
    env = {k: v for k, v in os.environ.items() if k != "POSE_MLX_BLAS"}
    if blas is not None:
        env["POSE_MLX_BLAS"] = blas
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS loading is Linux-only")


def test_import_does_not_import_mlx():
    result, _ = probe()
    assert result["mlx_imported"] is False


@linux_only
def test_disabled_loads_nothing_and_stays_quiet():
    result, stderr = probe("off")
    assert result["status"]["library"] is None and "disabled" in result["status"]["reason"]
    assert not result["openblas_mapped"] and not result["mkl_mapped"]
    assert stderr == ""


@linux_only
def test_missing_library_warns_in_one_line():
    result, stderr = probe("/nonexistent/libblas_missing.so")
    assert result["status"]["library"] is None
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "warning" in lines[0] and "POSE_MLX_BLAS" in lines[0]


@linux_only
@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="no OpenBLAS on this machine")
def test_auto_loads_openblas_into_the_process():
    result, stderr = probe()
    assert result["status"]["library"] and result["openblas_mapped"]
    assert stderr == ""


@linux_only
def test_too_late_after_mlx_import_is_reported():
    code = "import mlx.core\n" + PROBE
    result, stderr = probe("auto", code)
    assert "imported before" in result["status"]["reason"] and "warning" in stderr
