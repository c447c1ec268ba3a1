"""`python -m pose_mlx.finetune`: extend a RoPE model's context window with PoSE (or a baseline) and export it.

A run is a straight line:
settings (`pose_mlx.settings`: flags, YAML or run.json, validated once)
-> plan (`pose_mlx.plan`: lengths, memory, data and output folders checked against the model's config before any
   weight is downloaded or read; the run folder claimed)
-> load (`pose_mlx.model.source`: a hub model's weights are downloaded here)
-> extend (`pose_mlx.model.patch`: the frequency schedule, s = target / original; `--sampler plain` trains with
   the original frequencies and takes the schedule only after training)
-> train (`pose_mlx.training.stage`: LoRA or all weights, position ids from the sampler)
-> export (`pose_mlx.model.export`: a standard mlx-lm folder whose config comes from the extension record; with
   `--export-gguf` also `<output>.gguf` for llama.cpp, `pose_mlx.model.gguf.write`).
The run's state lives in `<output>.partial/` until the export is complete, then `<output>` appears at once.
Started by `mlx.launch`, it trains data-parallel (`pose_mlx.training.distributed`): `--batch-size` rows per rank,
rank 0 tokenizes first, writes every file and prints progress; the other ranks read the same `--output` and cache.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from .errors import command
from .memory import format_size
from .settings import parse_invocation
from .words import counted

# Imported inside functions, on purpose: the package's MLX-backed modules, each where it is used: they are costly to
# import or unneeded on the paths that import this module (`--help`, `plan`, the NumPy-only parts).


def header(plan) -> str:
    """What the run will do, before anything is loaded: the model and its lengths; the schedule, sampler, training
    mode, window and batch; what training costs (`cost`); the predicted peak memory and the output folder (what
    the project measured nearest this extension factor is `python -m pose_mlx.plan`'s to say, once)."""
    s = plan.settings
    model = s.model if s.model == plan.model.name else f"{s.model} ({plan.model.name})"
    lines = [f"model {model}: original {plan.original} -> target {plan.target} tokens "
             f"({plan.target / plan.original:g}x){', resuming' if plan.resume else ''}"]
    if s.sampler == "none":
        lines.append(f"schedule {s.schedule}, sampler none: no training, the extended model is exported")
    else:
        sampler = f"{s.sampler} ({counted(s.chunks, 'chunk')})" if s.sampler in ("pose", "pose-ref") else s.sampler
        blocks = ("all blocks" if plan.lora is None or plan.lora.num_layers < 0
                  else counted(plan.lora.num_layers, "block"))
        mode = "full fine-tuning" if plan.lora is None else f"LoRA rank {plan.lora.rank} on {blocks}"
        batch = f"batch {s.batch_size}" + (f" x {s.grad_accum} accumulated" if s.grad_accum > 1 else "")
        ranks = f" x {plan.world.size} ranks" if plan.world.size > 1 else ""
        schedule = f"{s.schedule} (at export)" if s.sampler == "plain" else s.schedule
        lines.append(f"schedule {schedule}, sampler {sampler}, {mode}, {plan.example_length}-token rows, "
                     f"{batch}{ranks}, {counted(s.steps, 'step')} at lr {s.lr:g}")
        lines.append(cost(plan))
    peak = ""
    if plan.memory_plan is not None:
        m = plan.memory_plan
        peak = (f"predicted peak memory {format_size(m.estimate.peak)} of {format_size(m.available)}"
                f"{'' if m.fits else ' (does NOT fit; --force)'}; ")
    lines.append(f"{peak}output {plan.output}")
    return "\n".join(lines)


#: How the cost line names the device MLX trains on (`pose_mlx.memory.compute_backend`).
DEVICES = {"cpu": "the CPU", "metal": "the GPU (Metal)", "cuda": "the GPU (CUDA)"}


def cost(plan) -> str:
    """One line: the updates to run x the target tokens of each (all ranks' rows, every micro-batch), the device,
    and where the time left will show: no honest estimate exists before an update has been timed, and the
    progress bar gives one from the first update on (that update also traces the compiled step)."""
    s = plan.settings
    from .training.checkpoint import trained_steps

    done = trained_steps(plan.partial) if plan.resume else 0
    per_update = s.batch_size * plan.world.size * s.grad_accum * (plan.example_length - 1)
    updates = counted(s.steps - done, "update") + (f" ({done + 1}-{s.steps})" if done else "")
    device = DEVICES.get(plan.memory_plan.settings.backend, plan.memory_plan.settings.backend)
    when = ("the progress bar shows the time left from the first update on" if s.progress
            else f"each update's time goes to {plan.partial / 'log.jsonl'}")
    return (f"training: {updates} x {per_update:,} tokens = {(s.steps - done) * per_update:,} tokens on {device}; "
            f"{when}")


def run(args) -> Path:
    """Carry out the run whose validated settings are `args` (a `pose_mlx.settings.Invocation`); returns the
    output folder. `extend`'s warning that a schedule replaces the config's is silenced for the run: the plan
    says it in one line."""
    from .model.export import export_run
    from .model.source import load
    from .model.patch import ScalingReplaced, extend, reschedule, use_positions
    from .plan import make_plan
    from .training.lora import weights_writer
    from .training.stage import fine_tune

    plan = make_plan(args)  # every check that needs no weights: nothing but a config has been downloaded yet
    if plan.world.is_main:  # on stdout: stderr keeps its one line for bad input found later (data, disk)
        print(header(plan), flush=True)
    try:
        plan.fetch_weights()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ScalingReplaced)
            model, tokenizer = load(plan.model, apply_schedule=False)
            s = plan.settings
            if s.sampler == "plain":  # ordinary fine-tuning: original RoPE while training, the schedule at export
                extend(model, "none", plan.original, plan.target)
                summary = fine_tune(model, tokenizer, plan, use_positions)
                extension = reschedule(model, s.schedule, plan.original, plan.target, **s.schedule_params)
            else:
                extension = extend(model, s.schedule, plan.original, plan.target, **s.schedule_params)
                summary = fine_tune(model, tokenizer, plan, use_positions)
            output = export_run(model, extension, plan, summary, weights_writer(plan.lora, s.fuse))
        del model
        if s.export_gguf and plan.world.is_main:
            write_gguf(plan)
    except BaseException:
        plan.release(failed=True)
        raise
    plan.release()
    return output


def write_gguf(plan) -> Path:
    """`--export-gguf`: the exported folder as `<output>.gguf` (`pose_mlx.model.gguf.write`), the tokenizer keys
    copied from the source model when it is a GGUF file. The folder is complete before this starts: a failure
    here says how to make the file from it."""
    from .errors import UserError
    from .model.gguf.write import export_gguf, gguf_path

    path, s = gguf_path(plan.output), plan.settings
    try:
        info = export_gguf(plan.output, path, s.export_gguf, overwrite=True, progress=s.progress,
                           source_gguf=plan.model.path if plan.model.is_gguf else None)
    except UserError as error:
        raise UserError(f"{error} (the folder {plan.output} is complete; `python -m pose_mlx.convert {plan.output} "
                        f"{path}` writes the GGUF file from it)") from None
    print(f"wrote {path} ({info['architecture']}, {info['outtype']}, llama.cpp context {plan.target})", file=sys.stderr)
    return path


@command("pose_mlx.finetune")
def main(argv=None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 bad input, 128 + the signal's number when Ctrl-C or
    SIGTERM stopped training after a checkpoint: `pose_mlx.training.loop.Interrupted`, an `errors.Stopped`)."""
    run(parse_invocation(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
