"""`python -m pose_mlx` lists the commands; `python -m pose_mlx COMMAND ...` (or the `pose-mlx COMMAND ...` script
that `pip install` puts on the PATH) runs `python -m pose_mlx.COMMAND ...`.

Listing imports nothing but this module (no MLX); a command's module is imported only when it runs.
"""

from __future__ import annotations

import importlib
import sys

from . import __version__, install_check
from .errors import UserError, command

#: command -> (module, one line). Every `python -m pose_mlx.X` command, in the order a newcomer uses them.
COMMANDS = {
    "demo": ("pose_mlx.demo", "extend the shipped small model 8x and measure it, offline, in minutes"),
    "plan": ("pose_mlx.plan", "predict a fine-tuning run's peak memory from the model's config (nothing loaded)"),
    "finetune": ("pose_mlx.finetune", "extend a model's context window (PoSE and baselines) into an mlx-lm folder"),
    "passkey": ("pose_mlx.passkey", "passkey retrieval accuracy by context length and depth"),
    "perplexity": ("pose_mlx.perplexity", "sliding-window perplexity by evaluation length"),
    "ruler": ("pose_mlx.ruler", "RULER's synthetic tasks and the effective context length"),
    "generate": ("pose_mlx.generate", "answer a prompt or a question about a long file, streaming the text"),
    "convert": ("pose_mlx.convert", "write an mlx-lm model folder from a GGUF file"),
    "launch": ("pose_mlx.launch", "run a command as data-parallel ranks on this machine"),
    "sim": ("pose_mlx.sim.__main__", "the simulator: pre-train a small model and reproduce the paper's grid"),
    "sim-map": ("pose_mlx.sim.map", "the simulator's factor map: the real model's methods at 2x-16x, at each target"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m pose_mlx COMMAND [flags]   (or: pose-mlx COMMAND [flags])", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_module, text) in COMMANDS.items()]
    lines += ["", "`python -m pose_mlx.COMMAND --help` (or `pose-mlx COMMAND --help`) lists a command's flags;",
              "`pose-mlx --version` prints the version."]
    return "\n".join(lines)


@command("pose_mlx")
def main(argv=None) -> int:
    """The list of commands (no argument, -h, --help), else the exit code of the command `argv[0]` run with the
    rest of `argv`; an MLX that cannot be imported is said in one line (`pose_mlx.install_check`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"pose-mlx {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        raise UserError(f"unknown command {argv[0]!r}; the commands are: {', '.join(COMMANDS)}")
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
    except ImportError as error:
        if not install_check.is_mlx_error(error):
            raise
        raise UserError(install_check.message(error)) from None
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
