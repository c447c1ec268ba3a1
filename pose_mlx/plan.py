"""The plan of a fine-tuning run, before a single weight is read: `python -m pose_mlx.plan` prints it, and
`python -m pose_mlx.finetune` refuses a run whose plan does not hold.

The run's settings are resolved against the model's configuration (config.json, a GGUF file's metadata, or only
the config.json of a hub model) and every check that can be made before loading anything is made:

- lengths: `original` (settings, alias, or the config), `target` (the length grammar, `8x` = 8 * original),
  the training `window` (default: original); target > original >= 2, 2 <= window <= target, chunks <= window;
- the model: enough transformer blocks for `--lora-layers` (for a hub model or an alias only config.json is
  fetched: `RunPlan.fetch_weights` downloads the weights once every check below has passed);
- memory: the predicted peak of a training step (`pose_mlx.memory`, from shapes and dtypes) must fit in
  `--max-memory` (default: the memory this machine offers), else a one-line refusal with the change that fits
  (`--force` runs anyway);
- the data: `--data` exists and holds a readable document (`training.reading.check_readable`);
- the output: `<output>` and its run folder `<output>.partial` may be written without destroying anything that
  pose_mlx did not write: never the model or data folder, a parent of them, or a folder inside the data (it would
  be read as training data); `--overwrite` only replaces folders that hold pose_mlx's own metadata;
- with `--export-gguf`: the model family and the schedule can be written to GGUF, and `<output>.gguf` is absent
  or a GGUF file that `--overwrite` may replace;
- one run at a time per output: an exclusive flock on `.<output>.lock` (which names the holder's pid and host)
  is held for the whole run; the file a process that died left behind is taken over with a message; temporary
  files a killed run left are removed;
- the run folder is claimed: a new run starts it afresh with the settings in run.json; a resumed one must have
  as many ranks (`mlx.launch -n`) as the run it continues.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import memory
from .errors import UserError, command
from .evidence import pointer
from .files import sibling
from .lengths import parse_length
from .model import source
from .places import check_output
from .settings import (RUN_FILE, Invocation, RunSettings, build_parser, command_line, parse_invocation, run_folder,
                       save_run_file, saved_world_size)
from .training.distributed import World, init as init_world
from .training.lora import LoraSpec
from .training.reading import check_readable
from .words import counted

FINISHED_MARK = source.SCHEDULE_FILE  # a finished output holds pose_mlx.json
UNFINISHED_MARK = RUN_FILE  # a run folder holds run.json


@dataclass
class RunPlan:
    settings: RunSettings
    model: source.ModelRef
    config: dict
    original: int
    target: int
    window: int
    output: Path
    partial: Path
    resume: bool
    overwrite: bool
    world: World
    lora: LoraSpec | None
    memory_plan: memory.Plan | None = None  # the predicted peak of a training step (None: --sampler none)
    lock: OutputLock | None = None
    finished: bool = False  # a finished output trained longer: its run folder is made again from the output

    @property
    def example_length(self) -> int:
        """Tokens per training sequence: the target for full-length fine-tuning, else the window."""
        return self.target if self.settings.sampler == "full" else self.window

    @property
    def resume_command(self) -> str:
        """The command line that continues this run once interrupted: its settings are in the run folder, so only
        the output is named (and, for several ranks, how many to start again)."""
        command = f"python -m pose_mlx.finetune --resume --output {shlex.quote(str(self.output))}"
        if self.world.size == 1:
            return command
        return (f"python -m pose_mlx.launch -n {self.world.size} -- {command} (or this command under your mlx.launch "
                f"line, as {self.world.size} ranks)")

    def fetch_weights(self) -> None:
        """The whole model (weights and tokenizer) in place of the config the plan was made from: a hub model or
        an alias is downloaded now (a local folder or GGUF file is already whole)."""
        self.model = source.resolve(self.settings.model)

    def release(self, failed: bool = False) -> None:
        """Give up the output's lock (a no-op for ranks other than 0 and after a release). After a failure, a run
        folder this run created that holds no checkpoint yet is removed: bad data leaves nothing behind."""
        if self.lock is None:
            return
        if failed and not self.resume and not (self.partial / "checkpoint" / "state.json").exists():
            shutil.rmtree(self.partial, ignore_errors=True)
        self.lock.release()
        self.lock = None


def make_plan(invocation: Invocation) -> RunPlan:
    """Resolve and check everything about the run that needs no weights (a hub model's or an alias's config.json
    is all that is downloaded; `RunPlan.fetch_weights` gets the rest once the plan holds), including that --data
    has a readable document; takes the output's lock."""
    s = invocation.settings
    if not s.target:
        raise UserError("--target is required (e.g. 32k or 8x)")
    ref = source.resolve(s.model, weights=False)
    config = source.read_config(ref)
    original, window, target = _lengths(s, config, ref)
    if s.sampler != "none" and not s.data:
        raise UserError("--data is required unless --sampler none")
    _warn_about_scaling(s, config, original, target)
    if s.sampler in ("pose", "pose-ref") and s.chunks > window:
        raise UserError(f"--chunks {s.chunks} must be at most the window {window} (each chunk holds a token)")
    if s.sampler == "pose-middle" and window < 3:
        raise UserError(f"--sampler pose-middle needs a window of at least 3 tokens (head, middle, tail), got {window}")
    lora = None if s.full or s.sampler == "none" else _lora_spec(s, config)
    memory_plan = memory.check_run(config, s, window, target, ref, command=lambda changes: command_line(s, changes))
    if s.sampler != "none":
        check_readable(s.data)
    label = Path(s.model.rstrip("/")).name.removesuffix(".gguf")  # the alias, the repo's or the folder's name
    output = Path(s.output).expanduser() if s.output else Path(f"{label}-{s.sampler}-{target}")
    plan = RunPlan(s, ref, config, original, target, window, output, run_folder(output), invocation.resume,
                   invocation.overwrite, init_world(), lora, memory_plan, finished=invocation.finished)
    _check_places(plan)
    _check_existing(plan)
    _check_gguf(plan)
    plan.world.barrier()  # every rank has checked the folders before rank 0 changes them
    if plan.world.is_main:
        plan.lock = take_lock(output)
        _remove_leftovers(plan)
        if s.sampler != "none":
            _claim_run_folder(plan)
    plan.world.barrier()  # no rank goes on before rank 0 has claimed the folders
    return plan


def _claim_run_folder(plan: RunPlan) -> None:
    """A fresh run folder holding run.json, or (on --resume) the interrupted one if its rank count matches."""
    if plan.resume:
        if plan.finished:
            _reopen_run_folder(plan)
        ranks = saved_world_size(plan.partial)
        if ranks != plan.world.size:
            raise UserError(f"--resume: the interrupted run had {counted(ranks, 'rank')} (mlx.launch -n), this one has "
                            f"{plan.world.size}; its batches cannot be continued with another count")
    else:
        shutil.rmtree(plan.partial, ignore_errors=True)
        plan.partial.mkdir(parents=True)
    save_run_file(plan.settings, plan.partial, plan.world.size)


def _reopen_run_folder(plan: RunPlan) -> None:
    """The run folder of a finished output, made again from what the output kept: run.json, the training log and
    the last checkpoint (copies: the output stays whole until the longer run's export replaces it)."""
    temporary = sibling(plan.partial, "reopen")
    try:
        shutil.copytree(plan.output / "checkpoint", temporary / "checkpoint")
        shutil.copyfile(plan.output / RUN_FILE, temporary / RUN_FILE)
        shutil.copyfile(plan.output / "train_log.jsonl", temporary / "log.jsonl")
        temporary.rename(plan.partial)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _lengths(s: RunSettings, config: dict, ref: source.ModelRef) -> tuple[int, int, int | None]:
    """(original, window, target) of the settings against the model's config: `original` from the settings, the
    alias or the config; `window` default original; `target` by the length grammar (`8x` = 8 * original), None
    when not given (the planner plans PoSE without it: its memory does not depend on it); target > original and
    window <= target."""
    original = s.original or source.original_window(config, ref)
    if original is None:
        raise UserError("the model config has neither rope_scaling.original_max_position_embeddings nor "
                        "max_position_embeddings; pass --original")
    window = s.window or original
    if not s.target:
        return original, window, None
    target = parse_length(s.target, original, "--target")
    if target <= original:
        raise UserError(f"--target {target} must be larger than the original window {original}")
    if window > target:
        raise UserError(f"--window {window} must be at most the target {target}")
    return original, window, target


def _warn_about_scaling(s: RunSettings, config: dict, original: int, target: int) -> None:
    """Double scaling (the model already scales its RoPE) and a factor that is not target / original."""
    if config.get("rope_scaling"):
        print(f"warning: the model already applies rope_scaling {config['rope_scaling']}; it is replaced by "
              f"'{s.schedule}' computed from the raw base, not compounded", file=sys.stderr)
    factor = s.schedule_params.get("factor")
    if factor is not None and abs(float(factor) - target / original) > 1e-9 * target / original:
        print(f"warning: scaling factor {factor} differs from target/original = {target}/{original} = "
              f"{target / original:g}", file=sys.stderr)


def _lora_spec(s: RunSettings, config: dict) -> LoraSpec:
    """The adapters of the run, checked against the model's blocks and hidden size (`memory.architecture`'s shapes,
    which the memory prediction reads too)."""
    arch = memory.architecture(config)
    if s.lora_layers > arch.layers:
        raise UserError(f"--lora-layers {s.lora_layers} must be between 1 and the model's {arch.layers} blocks "
                        "(or -1 for all)")
    if s.lora_rank > arch.hidden:
        raise UserError(f"--lora-rank {s.lora_rank} must be at most the model's hidden size {arch.hidden}")
    layers = arch.layers if s.lora_layers < 0 else s.lora_layers
    return LoraSpec(rank=s.lora_rank, scale=s.lora_scale, num_layers=layers)


def _resolved(path) -> Path:
    return Path(path).expanduser().resolve()


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_places(plan: RunPlan) -> None:
    """The output, its run folder and the token cache can be created (no part of them is a file), and the output
    and its run folder never replace, contain or sit inside what the user gave us to read."""
    check_output("--output", plan.output)
    if plan.settings.sampler != "none":
        check_output("--cache-dir", plan.settings.cache_dir, folder=True)
    model = _resolved(plan.model.path)
    data = _resolved(plan.settings.data) if plan.settings.data and Path(plan.settings.data).expanduser().exists() \
        else None
    for place in (plan.output, plan.partial):
        where = _resolved(place)
        if _inside(model, where):
            raise UserError(f"--output {plan.output}: {place} is or contains the model {plan.model.path}; "
                            "choose another output folder")
        if data is not None and (_inside(data, where) or _inside(where, data)):
            raise UserError(f"--output {plan.output}: {place} is, contains or lies inside the data "
                            f"{plan.settings.data} (it would be read as training data); choose another folder")


def _ours(folder: Path, mark: str) -> bool:
    """An empty folder, or one holding pose_mlx's own metadata file `mark`."""
    return folder.is_dir() and (not any(folder.iterdir()) or (folder / mark).is_file())


def _check_existing(plan: RunPlan) -> None:
    """Refuse to touch finished or unfinished results unless asked to, and anything not ours even then."""
    output, partial = plan.output, plan.partial
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file; choose a folder name")
    if plan.resume:
        if not partial.is_dir() and not plan.finished:
            raise UserError(f"--resume: no unfinished run at {partial}")
        return
    if partial.exists() and not plan.overwrite:
        raise UserError(f"{partial} holds an unfinished run; pass --resume to continue it or --overwrite "
                        "to start over")
    if output.exists() and not plan.overwrite:
        raise UserError(f"output folder {output} exists; pass --overwrite to replace it or another --output")
    for folder, mark in ((output, FINISHED_MARK), (partial, UNFINISHED_MARK)):
        if folder.exists() and not _ours(folder, mark):
            raise UserError(f"--overwrite: {folder} was not written by pose_mlx (no {mark}); it is left alone - "
                            "choose another --output or remove it yourself")


def _check_gguf(plan: RunPlan) -> None:
    """With --export-gguf: the model family and the schedule can be written to GGUF (`check_exportable`), and
    `<output>.gguf` may be written: absent, or (with --overwrite or --resume) a GGUF file that is replaced."""
    s = plan.settings
    if not s.export_gguf:
        return
    from .model.gguf.write import check_exportable, gguf_path

    params = dict(s.schedule_params)
    factor = float(params.pop("factor", plan.target / plan.original))
    check_exportable(plan.config, s.schedule, params, factor, plan.original)
    path = gguf_path(plan.output)
    check_output("--export-gguf", path)
    if not path.exists():
        return
    if not (path.is_file() and source.is_gguf_file(path)):
        raise UserError(f"--export-gguf: {path} exists and is not a GGUF file; it is left alone - choose another "
                        "--output or remove it yourself")
    if not (plan.overwrite or plan.resume):
        raise UserError(f"--export-gguf: {path} exists; pass --overwrite to replace it or another --output")


# ----------------------------------------------------------------------------------------------- the lock


class OutputLock:
    """An exclusive `flock` on `.<output>.lock`, which also names the holder (pid, host) for the message of a run
    that is refused. The kernel drops the flock when the holder's process ends, however it ends (SIGKILL, a
    zombie never reaped): a lock file left behind is stale exactly when nobody holds its flock."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the file while still holding the flock, then drop it (a run waiting on the old file retries)."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


def _holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode()
        holder = json.loads(text) if text.strip() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def take_lock(output: Path) -> OutputLock:
    """Hold the flock of `.<output>.lock` and write this process's pid and host in it; refuse while another run
    holds it. A file left by a run that is gone is taken over with a message."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(f"another run (pid {holder.get('pid')} on {holder.get('host')}) is writing {output}; "
                            f"wait for it to finish, or delete {path} if that run is gone") from None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # its holder released (removed) it between our open and our flock: open the new one
            os.close(fd)
            continue
        if (pid := _holder(fd).get("pid")) is not None:
            print(f"warning: taking over the lock {path} left by process {pid}, which is no longer running",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        return OutputLock(path, fd)
    raise UserError(f"cannot take the lock {path}; another run keeps taking it")


def _remove_leftovers(plan: RunPlan) -> None:
    """Temporary folders and files that a killed run on this output left behind (we hold the lock)."""
    parent = plan.output.parent
    for pattern in (f".{plan.output.name}.export-*", f".{plan.output.name}.old-*", f".{plan.partial.name}.reopen-*"):
        for leftover in parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if plan.partial.is_dir():
        for leftover in list(plan.partial.glob(".*.tmp*")) + list((plan.partial / "checkpoint").glob(".*.tmp*")):
            leftover.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- python -m pose_mlx.plan


_ROWS = (
    ("weights", "weights"),
    ("lora_adapters", "LoRA adapters"),
    ("optimizer_state", "AdamW state (m, v)"),
    ("gradients", "gradients"),
    ("activations", "activations"),
    ("attention_scores", "attention scores"),
    ("logits", "logits + loss"),
    ("backward_temporaries", "backward temporaries"),
    ("update_temporaries", "update temporaries"),
)


def _describe_run(s: memory.TrainSettings, plan: memory.Plan) -> str:
    d = plan.estimate.details
    mode = (f"LoRA rank {s.lora_rank} on {counted(d['trained_blocks'], 'block')}" if s.lora else "full fine-tuning")
    sampler = (f"full-length rows of {s.target} tokens" if s.sampler == "full"
               else f"{s.sampler} window {s.window}" + (f" (target {s.target})" if s.target else ""))
    extras = [f"batch {s.batch_size}" + (f" x {s.grad_accum} accumulated" if s.grad_accum > 1 else ""),
              "compiled" if s.compile else "eager", "gradient checkpointing" if s.grad_checkpoint else "no checkpointing",
              f"{d['tokens_per_row']} inputs per row" + (f" (padded to a multiple of {s.row_multiple})"
                                                         if s.row_multiple > 1 else ""),
              f"{s.backend} ({d['attention']} attention)"]
    return f"{mode}, {sampler}, {', '.join(extras)}"


def render(plan: memory.Plan, arch: memory.Architecture, model: str, source: str, evidence: str | None = None,
           command: Callable[[dict], str] | None = None) -> str:
    """The human-readable report; `evidence`: what the project measured nearest the run's extension factor
    (`pose_mlx.evidence.pointer`), said once, after the model line; `command`: the whole command line of a
    change of the run's settings (`settings.command_line`), given for the first change that fits."""
    est, d = plan.estimate, plan.estimate.details
    lines = [f"model: {model} ({arch.describe()})", *([evidence] if evidence else []),
             f"run:   {_describe_run(plan.settings, plan)}", ""]
    notes = {
        "weights": f"{memory.format_count(d['parameters'])} parameters, {d['dtype']}"
                   + (f" ({arch.quant_bits}-bit)" if arch.quant_bits else ""),
        "lora_adapters": f"{memory.format_count(d['trainable_parameters'])} trainable (float32)" if plan.settings.lora else "",
        "optimizer_state": "two moments per trainable parameter",
        "activations": f"{memory.format_size(d['activation_bytes_per_block'])} per block at {d['tokens_per_row']} "
                       f"tokens x {plan.settings.batch_size}",
        "attention_scores": f"{memory.format_size(d['score_matrix_bytes'])} per score matrix (batch x heads x L x L)",
        "logits": f"{memory.format_size(d['logits_bytes'])} per copy (batch x L x vocabulary, float32)",
    }
    for key, label in _ROWS:
        value = est.breakdown.get(key, 0)
        if value or key in ("weights", "activations"):
            lines.append(f"  {label:<22} {memory.format_size(value):>11}   {notes.get(key, '')}".rstrip())
    lines.append(f"  {'peak':<22} {memory.format_size(est.peak):>11}   during the {est.phase} phase")
    lines.append("")
    lines.append(f"available: {memory.format_size(plan.available)} ({source})")
    if plan.fits:
        lines.append(f"verdict: fits ({memory.format_size(plan.available - est.peak)} to spare)")
    else:
        lines.append(f"verdict: does NOT fit ({memory.format_size(est.peak - plan.available)} more than available)")
    batch = str(plan.largest_batch) if plan.largest_batch else "none"
    window = "" if plan.settings.sampler == "full" else f"; largest window: {plan.largest_window or 'none'}"
    lines.append(f"largest batch that fits: {batch}{window}")
    if plan.suggestions:
        lines.append("changes and their predicted peaks:")
        for s in plan.suggestions:
            mark = "fits" if s["fits"] else "does not fit"
            lines.append(f"  {s['change']:<62} {memory.format_size(s['peak_bytes']):>11}   {mark}")
        first = next((s for s in plan.suggestions if s["fits"] and s["run_changes"] is not None), None)
        if first is not None and command is not None and not plan.fits:
            lines.append(f"the first that fits, as a whole command: {command(first['run_changes'])}")
    for warning in d["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


#: The settings a plan depends on (`_lengths`, `memory.run_settings`, `memory.limit`): `plan --help` lists their flags.
PLANNED = ("model", "target", "original", "window", "sampler", "full", "lora_rank", "lora_layers", "batch_size",
           "grad_accum", "grad_checkpoint", "compile", "kernels", "align_rows", "max_memory")


def _parser():
    parser = build_parser(shown=PLANNED)
    parser.prog = "python -m pose_mlx.plan"
    parser.usage = "%(prog)s --model MODEL [--target LENGTH] [options] [--json]"
    parser.description = ("Predict the peak memory of `python -m pose_mlx.finetune` with the same flags, from the\n"
                          "model's configuration alone (nothing is loaded or trained; --data is not needed). Every\n"
                          "flag of finetune is accepted, so a finetune command line plans as it is; the flags below\n"
                          "are those that change the plan. Reference: docs/memory.md.")
    parser.epilog = f"model aliases (--model NAME):\n{source.describe_aliases()}"
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def planned_run(argv) -> tuple[RunSettings, source.ModelRef, dict, memory.TrainSettings]:
    """What `python -m pose_mlx.plan` plans for finetune's flags `argv` (flags it does not use are left out with a
    note): the settings, the model reference, its configuration (no weights are read) and the memory model's view
    of the run."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"note: ignoring flags the planner does not use: {' '.join(unknown)}", file=sys.stderr)
    known = [a for a in argv if a not in unknown and a != "--json"]
    s = parse_invocation(known).settings
    if s.sampler == "none":
        raise UserError("--sampler none trains nothing: there is no training step to plan")
    ref = source.resolve(s.model, weights=False)
    config = source.read_config(ref)
    _, window, target = _lengths(s, config, ref)
    if target is None and s.sampler == "full":
        raise UserError("--target is required with --sampler full (its rows have the target's length)")
    if not s.full:
        _lora_spec(s, config)
    return s, ref, config, memory.run_settings(s, window, target)


@command("pose_mlx.plan")
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    s, ref, config, settings = planned_run(argv)
    original, _, target = _lengths(s, config, ref)
    evidence = pointer(target / original) if target else None  # what was measured nearest this factor
    arch = memory.loaded_architecture(config, ref, settings.backend)
    available, where = memory.limit(s)
    plan = memory.plan_memory(arch, settings, available)
    if "--json" in argv:
        record = {**plan.as_dict(), "available_source": where, "model": s.model, "backend": settings.backend,
                  "row_tokens": settings.row_tokens, "attention": plan.estimate.details["attention"],
                  "architecture": {k: v for k, v in asdict(arch).items() if k not in ("spec", "warnings")},
                  "settings": asdict(settings), "warnings": list(arch.warnings), "evidence": evidence}
        print(json.dumps(record, indent=1))
    else:
        for warning in arch.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(render(plan, arch, s.model, where, evidence, lambda changes: command_line(s, changes)))
    return 0


__all__ = ["RunPlan", "lock_path", "main", "make_plan", "planned_run", "render", "take_lock"]


if __name__ == "__main__":
    sys.exit(main())
