"""A training prediction against the memory a run may use (`plan_memory`), the changes that make it fit, and the
refusal of a run that does not (`check_fits`, `check_run`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import UserError
from ..training.data import row_multiple
from .architecture import Architecture, architecture, loaded_architecture
from . import device
from .device import compute_backend, cudnn_capable, format_size, parse_size
from .training import Estimate, TrainSettings, training_memory


@dataclass
class Plan:
    """The prediction for a run against the memory it may use, and what to change when it does not fit."""

    estimate: Estimate
    settings: TrainSettings
    available: int
    largest_batch: int  # 0: not even one row fits
    largest_window: int  # 0: not even a 2-token window fits (PoSE only; full-length sampling trains at the target)
    suggestions: list  # {"change", "run_changes", "peak_bytes", "fits"}: `run_changes` the run's settings that
    # make the change ({"grad_checkpoint": True}; None for a change of the model, a 4-bit base)

    @property
    def fits(self) -> bool:
        return self.estimate.peak <= self.available

    def advice(self, command: Callable[[dict], str] | None = None) -> str:
        """What to change, in one clause: every change that fits with its peak (those of the changes `python -m
        pose_mlx.plan` lists: "gradient checkpointing (--grad-checkpoint): about 5 GiB"), and with `command` (the
        run's settings changes -> the whole command line) the command of the first that changes the run's flags;
        else the change with the smallest predicted peak."""
        fitting = [s for s in self.suggestions if s["fits"]]
        if fitting:
            said = ", ".join(f"{s['change']}: about {format_size(s['peak_bytes'])}" for s in fitting)
            runs = [s for s in fitting if s["run_changes"] is not None]
            first = f"; the first as a whole command: {command(runs[0]['run_changes'])}" if command and runs else ""
            return f"changes that fit: {said}{first}"
        if self.suggestions:
            best = min(self.suggestions, key=lambda s: s["peak_bytes"])
            return f"even with {best['change']} it needs about {format_size(best['peak_bytes'])}"
        return "no change the planner knows of makes it fit"

    def as_dict(self) -> dict:
        return {**self.estimate.as_dict(), "available_bytes": self.available, "fits": self.fits,
                "largest_batch": self.largest_batch, "largest_window": self.largest_window,
                "suggestions": list(self.suggestions)}


def _largest(fits, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n) (fits is monotone), or low - 1 when none."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def plan_memory(config: dict | Architecture, settings: TrainSettings, available: int) -> Plan:
    """Predict `settings` on `config` and search what fits into `available` bytes."""
    arch = config if isinstance(config, Architecture) else architecture(config)
    estimate = training_memory(arch, settings)

    def peak(arch_=arch, **changes) -> int:
        return training_memory(arch_, replace(settings, **changes)).peak

    largest_batch = _largest(lambda b: peak(batch_size=b) <= available, 1, 1 << 16)
    largest_window = 0
    if settings.sampler != "full":
        high = max(settings.target or settings.window, settings.window)
        largest_window = _largest(lambda w: peak(window=w) <= available, 2, high)
    # in order of preference: the cheapest change to the run first
    options = []  # (what, the architecture, the memory settings' changes, the run settings' changes)
    if not settings.grad_checkpoint:
        options.append(("gradient checkpointing (--grad-checkpoint)", arch, {"grad_checkpoint": True},
                        {"grad_checkpoint": True}))
    if settings.batch_size > 1 and 1 <= largest_batch < settings.batch_size:
        accum = math.ceil(settings.batch_size * settings.grad_accum / largest_batch)
        changes = {"batch_size": largest_batch, "grad_accum": accum}
        options.append((f"--batch-size {largest_batch} --grad-accum {accum} (the same tokens per update)", arch,
                        changes, changes))
    if not settings.lora:
        options.append(("LoRA adapters instead of all weights (--lora)", arch, {"lora": True}, {"full": False}))
    quantize = not arch.quant_bits and not arch.prequantized  # never advise quantizing quantized weights
    q4 = replace(arch, quant_bits=4, quant_group=64, loaded_bytes=None) if quantize else arch
    if quantize:
        options.append(("a 4-bit quantized base with LoRA (mlx_lm.convert -q)", q4, {"lora": True}, None))
    if settings.sampler != "full" and 2 <= largest_window < settings.window:
        options.append((f"a shorter training window (--window {largest_window})", arch, {"window": largest_window},
                        {"window": largest_window}))
    if sum(1 for text, *_ in options if "window" not in text and "batch" not in text) > 1:
        options.append((("a 4-bit base, " if quantize else "") + "LoRA and gradient checkpointing together", q4,
                        {"lora": True, "grad_checkpoint": True},
                        None if quantize else {"full": False, "grad_checkpoint": True}))
    suggestions = []
    for text, arch_, changes, run_changes in options:
        value = peak(arch_, **changes)
        suggestions.append({"change": text, "run_changes": run_changes, "peak_bytes": value,
                            "fits": value <= available})
    return Plan(estimate, settings, available, largest_batch, largest_window, suggestions)


def run_settings(run, window: int, target: int | None, backend: str | None = None) -> TrainSettings:
    """The memory model's view of a fine-tuning run's settings (`pose_mlx.settings.RunSettings`) at the resolved
    training window and target, on `backend` (default: where MLX computes), with the rows it really trains
    (--align-rows)."""
    backend = backend or compute_backend()
    return TrainSettings(window=window, batch_size=run.batch_size, lora=not run.full, lora_rank=run.lora_rank,
                         lora_layers=run.lora_layers, grad_checkpoint=run.grad_checkpoint, compile=run.compile,
                         grad_accum=run.grad_accum, sampler=run.sampler, target=target, backend=backend,
                         row_multiple=row_multiple(run.align_rows, backend),
                         cudnn=backend != "cuda" or cudnn_capable(), kernels=run.kernels)


def limit(run) -> tuple[int, str]:
    """(bytes, where from) a run may use: its --max-memory, else what this machine offers."""
    return (parse_size(run.max_memory), "--max-memory") if run.max_memory else device.available_memory()


def check_run(config: dict, run, window: int, target: int | None, ref=None,
              command: Callable[[dict], str] | None = None) -> Plan | None:
    """The memory plan of a fine-tuning run (None when it trains nothing); refuses (UserError, one line with the
    changes that fit, and with `command` the first as a whole command: `Plan.advice`) a run whose predicted peak
    exceeds its limit, unless it asks to be forced (`run.force`). `ref` (a `pose_mlx.model.source.ModelRef`): the
    model as loaded on this backend (`loaded_architecture`)."""
    if run.sampler == "none":
        return None
    settings, available = run_settings(run, window, target), limit(run)[0]
    arch = loaded_architecture(config, ref, settings.backend)
    return plan_memory(arch, settings, available) if run.force else check_fits(arch, settings, available, command)


def check_fits(config: dict | Architecture, settings: TrainSettings, max_memory: int,
               command: Callable[[dict], str] | None = None) -> Plan:
    """The plan of the run; raises UserError (one line: `Plan.advice(command)`) when the predicted peak exceeds
    `max_memory` bytes (finetune's --max-memory; --force skips this check)."""
    plan = plan_memory(config, settings, max_memory)
    if not plan.fits:
        raise UserError(f"this run needs about {format_size(plan.estimate.peak)} at its peak, more than "
                        f"{format_size(max_memory)}; {plan.advice(command)}; or --force to try anyway")
    return plan
