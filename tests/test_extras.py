"""pyproject.toml's extras: the `mkl` extra (0.9 GB of MKL, Intel OpenMP and TBB) is installed only where
`pose_mlx.backend` can use it, Linux on x86-64, and nothing else pulls it in."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
from packaging.requirements import Requirement  # noqa: E402 (pytest's own dependency)

ROOT = Path(__file__).resolve().parents[1]
MKL = {"mkl", "intel-openmp", "tbb"}
MACHINES = {"linux x86-64": {"sys_platform": "linux", "platform_machine": "x86_64"},
            "linux aarch64": {"sys_platform": "linux", "platform_machine": "aarch64"},
            "macOS arm64": {"sys_platform": "darwin", "platform_machine": "arm64"},
            "macOS x86-64": {"sys_platform": "darwin", "platform_machine": "x86_64"}}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def installed_names(requirements: list[str], machine: str, extra: str) -> set[str]:
    """The distributions `requirements` install on `machine` when `extra` is asked for (markers evaluated)."""
    names = set()
    for line in requirements:
        requirement = Requirement(line)
        env = {**MACHINES[machine], "extra": extra}
        if requirement.marker is None or requirement.marker.evaluate(env):
            names.add(requirement.name.lower())
    return names


@pytest.mark.parametrize("machine", list(MACHINES))
def test_mkl_is_installed_only_by_its_extra_on_linux_x86_64(machine):
    extras = project()["optional-dependencies"]
    for extra, requirements in extras.items():
        names = installed_names(requirements, machine, extra)
        wanted = extra == "mkl" and machine == "linux x86-64"
        assert (names == {"mkl"}) if wanted else not names & MKL, (extra, machine, names)
    assert not installed_names(project()["dependencies"], machine, "") & MKL


def test_no_installed_distribution_but_the_mkl_extra_requires_mkl():
    """Transitively: among the distributions installed here, only pose-mlx's `mkl` extra (and MKL's own
    dependencies) ask for MKL, so `pip install -e ".[cpu]"` does not bring it."""
    import importlib.metadata

    askers = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"].lower()
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.name.lower() in MKL and name not in MKL:
                askers.add((name, str(requirement.marker)))
    assert {name for name, _marker in askers} <= {"pose-mlx"}
    assert all('extra == "mkl"' in marker for _name, marker in askers)


def test_llama_cpp_comes_only_with_its_extra():
    """llama-cpp-python compiles llama.cpp when installed (minutes on two cores): only the opt-in `llamacpp` extra
    asks for it, never the package or its test extra; gguf-py, which the GGUF export writes with, is a dependency."""
    extras = project()["optional-dependencies"]
    for extra, requirements in {"": project()["dependencies"], **extras}.items():
        names = {Requirement(line).name.lower() for line in requirements}
        assert ("llama-cpp-python" in names) == (extra == "llamacpp"), extra
    assert "gguf" in {Requirement(line).name.lower() for line in project()["dependencies"]}
