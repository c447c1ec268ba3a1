"""An MLX that cannot be imported ends `python -m pose_mlx...` with one line naming what to install, exit code 2:
checked in subprocesses whose imports of MLX fail (a sitecustomize puts a blocking finder first on the meta path)."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pose_mlx import install_check

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import sys


class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r} or name.startswith({name!r} + "."):
            raise {error}
        return None


sys.meta_path.insert(0, Block())
"""

#: what is blocked -> (the error its import raises, what the line must quote of it)
CASES = {
    "mlx": ("ModuleNotFoundError(\"No module named 'mlx'\", name='mlx')", "No module named 'mlx'"),
    "mlx.core": ("ImportError('libmlx.so: cannot open shared object file: No such file or directory', "
                 "name='mlx.core')", "ImportError: libmlx.so: cannot open shared object file"),
    "mlx_lm": ("ModuleNotFoundError(\"No module named 'mlx_lm'\", name='mlx_lm')", "No module named 'mlx_lm'"),
}


def run_without(blocked: str, tmp_path: Path, *argv: str):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(name=blocked, error=CASES[blocked][0]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "POSE_MLX_BLAS": "off"}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("blocked", list(CASES))
@pytest.mark.parametrize("how", ["module", "dispatch"])
def test_a_command_without_mlx_says_what_to_install(tmp_path, blocked, how):
    argv = ["-m", "pose_mlx.passkey", "--help"] if how == "module" else ["-m", "pose_mlx", "passkey", "--help"]
    code, out, err = run_without(blocked, tmp_path, *argv)
    prog = "pose_mlx.passkey" if how == "module" else "pose_mlx"
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: MLX cannot be imported (")
    assert CASES[blocked][1] in err and install_check.install_hint() in err


def test_the_listing_needs_no_mlx(tmp_path):
    code, out, err = run_without("mlx", tmp_path, "-m", "pose_mlx")
    assert code == 0 and err == "" and "generate" in out


@pytest.mark.parametrize("system, machine, extra", [("Linux", "x86_64", '".[cpu,mkl]"'),
                                                    ("Linux", "aarch64", '".[cpu]"'),
                                                    ("Darwin", "arm64", "pip install -e . ")])
def test_the_hint_names_the_extra_of_the_machine(system, machine, extra):
    hint = install_check.install_hint(system, machine)
    assert extra in hint
    assert ('".[cuda]"' in hint) == (system == "Linux")
    assert "mkl" not in hint or machine == "x86_64"


def test_this_machine_gets_its_own_hint():
    assert install_check.install_hint() == install_check.install_hint(platform.system(), platform.machine())
