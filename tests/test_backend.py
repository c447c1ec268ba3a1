"""Fast-BLAS loading (pose_mlx.backend); each case runs in a fresh interpreter since loading is process-wide."""

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


def probe(blas=None, code=PROBE, cache=None):
    env = {k: v for k, v in os.environ.items() if k != "POSE_MLX_BLAS"}
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
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


def _libraries():
    from pose_mlx import backend
    return backend._openblas_candidates(), backend._mkl_candidates()


both_present = pytest.mark.skipif(not all(_libraries()), reason="needs both OpenBLAS and MKL on this machine")


@linux_only
@pytest.mark.skipif(not any(_libraries()), reason="no OpenBLAS or MKL on this machine")
def test_auto_loads_a_fast_blas_into_the_process(tmp_path):
    result, stderr = probe(cache=tmp_path)
    assert result["status"]["library"] and (result["openblas_mapped"] or result["mkl_mapped"])
    assert stderr == ""


@linux_only
@both_present
def test_auto_measures_both_once_and_loads_the_faster(tmp_path):
    result, _ = probe(cache=tmp_path)
    gflops = result["status"]["gflops"]
    assert len(gflops) == 2 and all(g and g > 0 for g in gflops.values())
    assert result["status"]["library"] == max(gflops, key=gflops.get)
    (saved,) = json.loads((tmp_path / "pose_mlx" / "blas.json").read_text())["choices"].values()
    assert saved["gflops"] == gflops and saved["order"][0] == result["status"]["library"]
    # only the loaded one is in the process (the measurements ran in children)
    assert result["openblas_mapped"] != result["mkl_mapped"]


@linux_only
@both_present
def test_auto_follows_the_cached_choice_without_measuring_again(tmp_path):
    probe(cache=tmp_path)
    path = tmp_path / "pose_mlx" / "blas.json"
    cache = json.loads(path.read_text())
    (saved,) = cache["choices"].values()
    saved["order"].reverse()  # the slower one first: only a cache that is read can make auto pick it
    saved["gflops"] = {lib: 1.0 for lib in saved["order"]}
    path.write_text(json.dumps(cache))
    result, _ = probe(cache=tmp_path)
    assert result["status"]["library"] == saved["order"][0] and result["status"]["gflops"] == saved["gflops"]
    mkl_first = "mkl" in saved["order"][0]
    assert result["mkl_mapped"] == mkl_first and result["openblas_mapped"] != mkl_first


@linux_only
@both_present
def test_a_cache_from_another_machine_is_measured_again(tmp_path):
    (tmp_path / "pose_mlx").mkdir()
    (tmp_path / "pose_mlx" / "blas.json").write_text(json.dumps({"key": "another CPU", "order": [], "gflops": {}}))
    result, _ = probe(cache=tmp_path)
    assert len(result["status"]["gflops"]) == 2


@linux_only
@both_present
def test_another_environment_keeps_its_own_choice(tmp_path):
    """Two virtual environments on one machine share the cache file: measuring for this one keeps the other's
    entry as it was (one entry per file would make them measure again in turn and flip each other's library)."""
    other = {"order": ["libopenblas.so.0"], "gflops": {"libopenblas.so.0": 1.0}}
    (tmp_path / "pose_mlx").mkdir()
    (tmp_path / "pose_mlx" / "blas.json").write_text(json.dumps({"choices": {"another venv": other}}))
    result, _ = probe(cache=tmp_path)
    choices = json.loads((tmp_path / "pose_mlx" / "blas.json").read_text())["choices"]
    assert choices["another venv"] == other and len(choices) == 2
    assert result["status"]["gflops"] != other["gflops"]  # this environment measured its own


@linux_only
@both_present
def test_processes_starting_together_measure_once_and_agree(tmp_path):
    """Three processes start with no cache: one measures while the others wait for it, so all three report the very
    same measurements (two measurements never give equal floats) and load the same library."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("POSE_MLX_BLAS", None)
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    statuses = [r["status"] for r in results]
    assert all(s["gflops"] == statuses[0]["gflops"] and s["library"] == statuses[0]["library"] for s in statuses)


@linux_only
def test_too_late_after_mlx_import_is_reported():
    code = "import mlx.core\n" + PROBE
    result, stderr = probe("auto", code)
    assert "imported before" in result["status"]["reason"] and "warning" in stderr
