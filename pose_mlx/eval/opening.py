"""The opening the evaluators share (`passkey`, `perplexity`, `ruler`): from the command line to a loaded model,
the lengths to run, a memory check and the output path.

`open_evaluation(kind, args, check=, fit=, answer=)`, with `args` the command's settings (`longctx.EvalSettings`
plus the command's, `lengths` and `output` among them, filled by its `main` from the command line or built by a
caller), does, in this order (its start is the run's `started`, for `longctx.run_cost`):

1. check `--chunk`, then `--output` (a place the command may write, holding no result unless `--overwrite`:
   `results.check_free`), then `check(args)`: the command's flags;
2. check the `--lengths` grammar (a length in `x` needs the model's window, so only the grammar here);
3. load `--model` (`longctx.load_eval_model`, with `--schedule/--target/--original`) and resolve `--lengths`
   (default: doubling from half the original window to the model's maximum);
4. `fit(args, info, lengths)`: the lengths the command runs, or a refusal (default: all of them); then
   `check_window`: a length beyond the window the model declares (`EvalModel.maximum`) is refused, with what an
   `x` length meant, unless `--allow-beyond-window` (then the model line says it is measured past the window);
5. the memory check of the longest length (`longctx.check_memory`, refused above this machine's memory unless
   `--force`): a prompt of that length and `answer` generated tokens with the last position's logits, or with
   `answer` None every position's logits (scoring). `answer` is a number or a function of the arguments.

Each refusal is a `UserError` (one line on stderr, exit code 2) raised before anything is written; nothing is
loaded before step 3. The command then makes its own checks of the loaded model and calls `announce(*notes)`,
which says on stderr "model PATH: schedule S; original window O, max M; [BEYOND; ][NOTES; ]memory estimate E"
(BEYOND: the lengths measured past the window with --allow-beyond-window) and returns
the output path: `--output`, or a free name in the model's results folder that says what is measured
(`results.output_path`; also said on stderr).
It runs the evaluation itself under `held()`, MLX's buffer cache held to the predicted peak
(`longctx.cache_held_to`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import longctx, results
from .. import memory
from ..errors import UserError
from ..lengths import check_lengths, parse_length
from ..places import check_output
from .cost import Compute


@dataclass
class Opening:
    """What an evaluator starts from: its arguments, model, lengths and memory estimate."""

    kind: str  # "passkey", "perplexity", "ruler": the default output's name starts with it
    args: longctx.EvalSettings  # the command's settings
    started: float  # time.perf_counter() when the opening began
    info: longctx.EvalModel
    lengths: list[int]
    estimate: str  # the predicted peak memory in words
    peak: int  # the predicted peak of MLX's allocator, bytes
    beyond: str = ""  # the lengths measured beyond the model's window (--allow-beyond-window), in words

    def held(self):
        """A context in which MLX's buffer cache is held to the predicted peak (`longctx.cache_held_to`): the
        evaluation itself runs in it."""
        return longctx.cache_held_to(self.peak)

    def compute(self) -> Compute:
        """What a forward pass of the model computes (`cost.Compute`), for the progress bar's ETA."""
        return Compute.of(memory.architecture(self.info.config))

    def announce(self, *notes: str, details: tuple = (), header: dict | None = None) -> Path:
        """The model line on stderr (with the command's `notes`), then the output path (see the module;
        `details` and `header` as `results.output_path` takes them)."""
        info = self.info
        print("; ".join([f"model {info.path}: schedule {info.schedule}", f"original window {info.original}, "
                         f"max {info.maximum}", *filter(None, [self.beyond]), *notes,
                         f"memory estimate {self.estimate}"]), file=sys.stderr)
        return results.output_path(self.kind, self.args, info, self.lengths, details, header)


def open_evaluation(kind: str, args: longctx.EvalSettings, *,
                    check: Callable[[longctx.EvalSettings], None] | None = None,
                    fit: Callable[[longctx.EvalSettings, longctx.EvalModel, list[int]], list[int]] | None = None,
                    answer: int | Callable[[longctx.EvalSettings], int] | None = None) -> Opening:
    """Steps 1-5 of the module's docstring."""
    started = time.perf_counter()
    longctx.check_chunk(args.chunk)
    if args.output:
        check_output("--output", args.output)
        results.check_free(args.output, args.overwrite)
    if check is not None:
        check(args)
    if args.lengths:
        check_lengths(args.lengths)
    info = longctx.load_eval_model(args.model, args.schedule, args.target, args.original)
    lengths = longctx.resolve_lengths(args.lengths, info)
    if fit is not None:
        lengths = fit(args, info, lengths)
    beyond = check_window(args, info, lengths)
    if answer is None:
        estimate, peak = longctx.check_memory(info, lengths, args.chunk, args.force)
    else:
        tokens = answer(args) if callable(answer) else answer
        estimate, peak = longctx.check_memory(info, [max(lengths) + tokens], args.chunk, args.force,
                                              all_logits=False)
    return Opening(kind, args, started, info, lengths, estimate, peak, beyond)


def check_window(args: longctx.EvalSettings, info: longctx.EvalModel, lengths: list[int]) -> str:
    """Step 4's window check (module docstring): UserError naming --allow-beyond-window; with it, what is measured
    beyond the window, for the model line ("" when nothing is)."""
    beyond = [n for n in lengths if n > info.maximum]
    if not beyond:
        return ""
    window = f"the window this model declares, {info.maximum} tokens ({info.declared_by})"
    listed = ", ".join(map(str, beyond))
    if args.allow_beyond_window:
        return f"{listed} beyond it on purpose (--allow-beyond-window)"
    relative = [item.strip() for item in (args.lengths or "").split(",") if item.strip().lower().endswith("x")
                and parse_length(item, info.original) > info.maximum]
    meant = (f"; {relative[0]} means {relative[0][:-1]} x the model's pre-training window {info.original} = "
             f"{parse_length(relative[0], info.original)}" if relative else "")
    raise UserError(f"--lengths: {listed} {'is' if len(beyond) == 1 else 'are'} beyond {window}{meant}; measure up "
                    f"to {info.maximum} ({info.maximum / info.original:g}x), or pass --allow-beyond-window to "
                    "measure past it on purpose")


__all__ = ["Opening", "check_window", "open_evaluation"]
