"""pose-mlx: context-window extension for RoPE language models on MLX, built around PoSE.

Importing the package loads an optimized BLAS for MLX on Linux (`pose_mlx.backend`, the one place that does
it) and does not import MLX itself, so NumPy-only parts (`pose_mlx.training.positions`, `pose_mlx.rope`,
`pose_mlx.analysis`) stay light. The MLX-facing API (`extend`, `use_positions`, `load`, ...) is imported on
first use. Imported to run a command (`python -m pose_mlx.COMMAND`), it checks that MLX imports and otherwise
ends with one line naming what to install (`pose_mlx.install_check`).
"""

import importlib

from . import backend as _backend
from . import install_check as _install_check

_backend.load_fast_blas()
_COMMAND = _install_check.running_command()
if _COMMAND and _COMMAND.startswith("pose_mlx.") and _COMMAND != "pose_mlx.__main__":
    _install_check.require_mlx(_COMMAND)

__version__ = "0.1.0"

_LAZY = {
    "extend": "pose_mlx.model.patch",
    "use_positions": "pose_mlx.model.patch",
    "use_length": "pose_mlx.model.patch",
    "PositionRoPE": "pose_mlx.model.patch",
    "find_rope_modules": "pose_mlx.model.patch",
    "load": "pose_mlx.model.source",
    "load_gguf": "pose_mlx.model.gguf",
    "UserError": "pose_mlx.errors",
    "pose_position_ids": "pose_mlx.training.positions",
    "randpos_position_ids": "pose_mlx.training.positions",
    "sample_example": "pose_mlx.training.positions",
    "Example": "pose_mlx.training.positions",
    "scaled_inv_freq": "pose_mlx.rope",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pose_mlx' has no attribute {name!r}")
