"""What to install when MLX is missing: one line and exit code 2 instead of an ImportError's traceback.

On Linux the `mlx` wheel alone cannot run (its `libmlx.so` comes with the `cpu` or `cuda` extra), and a
`python -m pose_mlx.COMMAND` started from the repository root outside the virtual environment finds this
package but not MLX. So when the package is imported to run a command (`running_command`), `require_mlx`
imports `mlx.core` (after `pose_mlx.backend` has loaded its BLAS) and looks for `mlx_lm`; `python -m pose_mlx
COMMAND` and the `pose-mlx` script turn the ImportError of a command's import into the same line
(`is_mlx_error`, `message`). The line names what to install on this machine: the `cpu` extra (with `mkl` on
x86-64) or `cuda` on Linux, the plain package on macOS (MLX's Metal build).
"""

from __future__ import annotations

import importlib.util
import platform
import sys

from .errors import EXIT_USER_ERROR, one_line

#: The top-level modules whose import errors mean "MLX is not installed for this machine".
MLX_MODULES = frozenset({"mlx", "mlx_lm"})


def install_hint(system: str | None = None, machine: str | None = None) -> str:
    """The pip command that brings MLX for `system`/`machine` (default: this machine's)."""
    system, machine = system or platform.system(), (machine or platform.machine()).lower()
    if system == "Darwin":
        return "pip install -e . (MLX's Metal build)"
    if system == "Linux":
        cpu = ".[cpu,mkl]" if machine in ("x86_64", "amd64") else ".[cpu]"
        return f'pip install -e "{cpu}" (CPU) or pip install -e ".[cuda]" (NVIDIA GPUs)'
    return f"MLX runs on macOS and Linux, not on {system}"


def is_mlx_error(error: ImportError) -> bool:
    """Whether `error` is MLX or mlx-lm failing to import (missing, or its shared library missing)."""
    return (error.name or "").split(".")[0] in MLX_MODULES or "libmlx" in str(error)


def message(error: ImportError) -> str:
    """The one line: what failed, then what to run in the repository root."""
    return (f"MLX cannot be imported ({type(error).__name__}: {one_line(error)}); activate the virtual "
            f"environment pose-mlx is installed in, or install it there from the repository root: "
            f"{install_hint()}")


def missing_mlx() -> ImportError | None:
    """The ImportError of `mlx.core`, or of an absent `mlx_lm` (looked up, not imported: it is slow to import);
    None when both are there."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as error:
        return error
    try:
        found = importlib.util.find_spec("mlx_lm")
    except ImportError as error:
        return error
    return None if found else ModuleNotFoundError("No module named 'mlx_lm'", name="mlx_lm")


def running_command() -> str | None:
    """The module X of `python -m X` while the interpreter is importing its packages to run it (sys.argv[0] is
    "-m" until then), else None."""
    if sys.argv[:1] != ["-m"]:
        return None
    args = list(getattr(sys, "orig_argv", []))[1:]
    for i, arg in enumerate(args):
        if arg.startswith("-m"):
            return arg[2:] or (args[i + 1] if i + 1 < len(args) else None)
    return None


def require_mlx(prog: str) -> None:
    """One line on stderr and exit code 2 when MLX or mlx-lm cannot be imported; nothing otherwise."""
    error = missing_mlx()
    if error is not None:
        print(f"{prog}: error: {message(error)}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


__all__ = ["MLX_MODULES", "install_hint", "is_mlx_error", "message", "missing_mlx", "require_mlx",
           "running_command"]
