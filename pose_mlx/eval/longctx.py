"""Shared machinery of the long-context evaluators (`pose_mlx.perplexity`, `pose_mlx.passkey`, ...).

- `load_eval_model`: any model reference finetune accepts (folder, .gguf file, hub id, alias); a folder written
  by `finetune` gets its `pose_mlx.json` schedule re-applied, a raw model can be extended on the fly with
  `--schedule/--target` (e.g. PI-only: linear interpolation, no training), and so can a folder fine-tuned with
  the original frequencies (`finetune --sampler plain --schedule none`: ordinary fine-tuning, extended at load).
- `chunked_nll` / `chunked_logits` / `prefill`: feed a long sequence through mlx-lm's KV cache C tokens at a
  time ("chunked prefill"). Causal attention makes this exact: token t attends to the cached keys 0..t, so
  the logits equal those of one full forward, while the attention scores held at once are C x L instead of
  L x L and memory grows with the cache (linear in L). A dynamic-NTK model sets its base from the whole
  sequence's length (`pose_mlx.model.patch.use_length`), so the chunk size changes nothing.
- `check_memory`: the planner's prediction of the longest length (`pose_mlx.memory.eval_memory`) against the
  memory this machine offers, before any token is evaluated; `cache_held_to`: MLX's buffer cache held to that
  prediction while the evaluation runs; `run_cost`: what the evaluation took, for its JSON.
"""

from __future__ import annotations

import contextlib
import resource
import shlex
import sys
import time
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .. import memory
from ..errors import ArgumentParser, UserError
from ..lengths import default_lengths, parse_length, parse_lengths, tokens
from ..model import source
from ..model.patch import extend, reschedule, use_length
from .forward import eval_logits

DEFAULT_CHUNK = 512


# ----------------------------------------------------------------------------------------------- loading


@dataclass
class EvalModel:
    """A model ready for evaluation and what is known about its context windows."""

    model: nn.Module
    tokenizer: object
    path: str
    original: int  # the pre-training window
    maximum: int  # the window the model declares (the target of an extension, or its config's:
    # `source.declared_window`)
    schedule: str  # e.g. "none", "linear x8 (from pose_mlx.json)", "yarn x4 (--schedule, no training)"
    config: dict  # the model's configuration (what the memory model reads)
    ref: source.ModelRef | None = None  # where it was loaded from (the memory model reads a GGUF file's or a
    # folder's stored dtype there)

    @property
    def name(self) -> str:
        return Path(self.path).stem if self.path.endswith(".gguf") else Path(self.path).name

    @property
    def label(self) -> str:
        """What the plots' legends call it: the name and what its positions are, e.g. "pretrained" (also with
        `--schedule none`), "pretrained + yarn x8, no training" (a schedule applied here), "pose (yarn x8)" (a
        saved extension)."""
        schedule, _, how = self.schedule.partition(" (")
        if schedule.split()[0] == "none":
            return self.name
        if how.startswith("--schedule"):
            return f"{self.name} + {schedule}, no training"
        return f"{self.name} ({schedule})" if how else self.name

    @property
    def declared_by(self) -> str:
        """Where `maximum` comes from, in words: "the target of its extension, pose_mlx.json", "--target", "its
        config"."""
        how = self.schedule.partition(" (")[2]
        return ("the target of its extension, pose_mlx.json" if how.startswith("from pose_mlx.json")
                else "--target" if how.startswith("--schedule") else "its config")


def load_eval_model(reference: str, schedule: str | None = None, target: str | None = None,
                    original: int | None = None) -> EvalModel:
    """Load `reference` (folder, .gguf file, hub id or alias) with its saved schedule re-applied; optionally
    extend a raw model here with `schedule` (default "yarn", as finetune's) from `original` (default:
    the config's window) to `target` tokens (the length grammar: 32768, 32k, 8x), without training."""
    ref = source.resolve(reference)
    model, tokenizer, config = source.load(ref, return_config=True)
    cfg_original = source.original_window(config, ref)
    extension = getattr(model, "pose_extension", None)
    if extension is not None and not (schedule or target):
        return EvalModel(model, tokenizer, str(ref.path), extension.original, extension.target,
                         f"{extension.schedule} x{extension.factor:g} (from pose_mlx.json)", config, ref)
    if extension is not None and extension.schedule != "none":
        raise UserError(f"--schedule/--target: {reference} is already extended ({extension.schedule}); drop them")
    base = int(original or (extension.original if extension is not None else cfg_original) or 0)
    if schedule or target:
        if not target:
            raise UserError("--target: required with --schedule (the length to extend to)")
        if not base:
            raise UserError("--original: the model config does not say its window; pass --original")
        length = _target_length(target, base)
        name = schedule or "yarn"
        if extension is not None:  # fine-tuned with the original frequencies (--sampler plain): extend it now
            reschedule(model, name, base, length)
        else:
            extend(model, name, base, length)
        how = "after plain fine-tuning" if extension is not None else "no training"
        return EvalModel(model, tokenizer, str(ref.path), base, length,
                         f"{name} x{length / base:g} (--schedule, {how})", config, ref)
    maximum = source.declared_window(config, base) or base
    if not base or not maximum:
        raise UserError("--model: the config does not say the model's window; pass --original (and --lengths)")
    return EvalModel(model, tokenizer, str(ref.path), base, int(maximum), "as configured", config, ref)


def _target_length(text: str, original: int) -> int:
    length = parse_length(text, original, "--target")
    if length < original:
        raise UserError(f"--target: {length} is shorter than the original window {original}")
    return length


def bos_id(tokenizer) -> int:
    """The id that starts every window: BOS, else EOS (GPT-2 style), else an error."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise UserError("--model: the tokenizer has neither a BOS nor an EOS token to start windows with")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens (windows add their own BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------------- chunked prefill


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


@contextlib.contextmanager
def reserved(cache: list, length: int) -> Iterator[None]:
    """While the block runs, an empty growable KV cache (mlx-lm's `KVCache`, which grows by `step` positions
    with a copy of what it holds) allocates room for `length` tokens at once: a prefill then allocates each
    layer's cache once instead of copying it at every growth. `step` is restored on exit."""
    grown = [(c, c.step) for c in cache if isinstance(getattr(c, "step", None), int) and getattr(c, "keys", 0) is None]
    for c, step in grown:
        c.step = max(step, -(-length // step) * step)
    try:
        yield
    finally:
        for c, step in grown:
            c.step = step


def prefill(
    model: nn.Module,
    tokens,
    cache: list,
    chunk: int = DEFAULT_CHUNK,
    on_chunk: Callable[[int, mx.array], None] | None = None,
    room: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> mx.array:
    """Feed `tokens` (1-D) into `cache` C tokens at a time; returns the logits of the last token (vocab,).

    `on_chunk(start, logits)` receives each chunk's logits (C, vocab), float32, positions start..start+C-1;
    `progress(fed, total)` is told after each chunk how many of the `total` tokens are in the cache (a bar's
    `WorkBar.reading`). An empty cache is allocated once for the prompt and `room` more tokens (what a generation
    will add).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    ids = mx.array(np.asarray(tokens, dtype=np.int32))
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    last = None
    total = _cache_offset(cache) + ids.size
    with use_length(model, total), reserved(cache, total + room):
        for start in range(0, ids.size, chunk):
            logits = eval_logits(model, ids[None, start : start + chunk], cache, on_chunk is None)[0]
            logits = logits.astype(mx.float32)
            if on_chunk is not None:
                on_chunk(start, logits)
            last = np.array(logits[-1])  # a copy: a view would keep the chunk's logits alive
            del logits  # freed before the next chunk runs
            _eval_cache(cache)
            if progress is not None:
                progress(min(start + chunk, ids.size), ids.size)
    return mx.array(last)


def _cache_offset(cache: list) -> int:
    """Tokens already in the KV cache (0 for an empty one)."""
    offset = getattr(cache[0], "offset", 0) if cache else 0
    return int(offset if isinstance(offset, int) else mx.max(offset).item())


def chunked_nll(model: nn.Module, tokens, chunk: int = DEFAULT_CHUNK,
                progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """-log p(tokens[t+1] | tokens[:t+1]) for t = 0..L-2, via chunked prefill; float64 array (L-1,).

    NLL = logsumexp(logits_t) - logits_t[target]; only the NLLs (not the logits) are kept per chunk. `progress`:
    as `prefill`'s.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.size < 2:
        raise ValueError("tokens: need at least 2 tokens to score")
    out = np.empty(tokens.size - 1, dtype=np.float64)

    def score(start: int, logits: mx.array) -> None:
        stop = min(start + logits.shape[0], tokens.size - 1)
        if stop <= start:
            return
        targets = mx.array(tokens[start + 1 : stop + 1])
        logits = logits[: stop - start]
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        nll = mx.logsumexp(logits, axis=-1) - picked
        out[start:stop] = np.array(nll, dtype=np.float64)

    prefill(model, tokens, make_prompt_cache(model), chunk, score, progress=progress)
    return out


def chunked_logits(model: nn.Module, tokens, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """All logits (L, vocab) of `tokens` computed by chunked prefill (for checking it against a full forward)."""
    parts: list[np.ndarray] = []
    prefill(model, tokens, make_prompt_cache(model), chunk, lambda _s, lg: parts.append(np.array(lg)))
    return np.concatenate(parts, axis=0)


# ------------------------------------------------------------------------------------------------ memory


def check_memory(info: "EvalModel", lengths: list[int], chunk: int, force: bool = False,
                 all_logits: bool = True) -> tuple[str, int]:
    """The predicted peak of evaluating the longest length (`pose_mlx.memory.eval_memory`: weights, KV cache,
    one chunk's scores, logits - every position's, or the last one's when not `all_logits` - and activations)
    against the memory this machine offers: UserError above it, or only a warning with `force`. Returns the
    prediction in words and the predicted peak of MLX's allocator in bytes (what `cache_held_to` takes)."""
    arch = memory.loaded_architecture(info.config, info.ref)  # the dtype as loaded, not only as configured
    estimate = memory.eval_memory(arch, max(lengths), chunk, all_logits=all_logits)
    parts = {k.replace("_", " "): v for k, v in estimate.breakdown.items() if v}
    if estimate.details["numpy_bytes"]:
        parts["attention tiles (NumPy)"] = estimate.details["numpy_bytes"]
    total = estimate.peak + estimate.details["numpy_bytes"]
    described = (f"{memory.format_size(total)} at {max(lengths)} tokens ("
                 + ", ".join(f"{k} {memory.format_size(v)}" for k, v in parts.items()) + ")")
    available, where = memory.device.available_memory()
    if total > available:
        message = (f"--lengths: evaluation needs about {described}, more than the {memory.format_size(available)} this "
                   f"machine offers ({where}); use shorter --lengths or a smaller --chunk (or --force)")
        if not force:
            raise UserError(message)
        print(f"warning: {message}", file=sys.stderr)
    return described, estimate.peak


@contextlib.contextmanager
def cache_held_to(limit: int) -> Iterator[None]:
    """MLX's buffer cache held to `limit` bytes while the block runs (`mx.set_cache_limit`; the previous limit
    is restored on exit), so an evaluation keeps at most about its peak plus `limit`. Unbounded (MLX's default
    allows up to the device's memory limit), the cache keeps every freed buffer that a later chunk cannot reuse
    (a chunk's scores grow with the KV cache): on an H100, three to six evaluations whose MLX peaks were 1-5 GB
    each held the whole 80 GB between them, and those that needed more failed for want of memory."""
    previous = mx.set_cache_limit(limit)
    try:
        yield
    finally:
        mx.set_cache_limit(previous)


def run_cost(started: float, taken_up: int | None = None) -> dict:
    """What this invocation cost: wall seconds since `started` (a `time.perf_counter()`), the peak of MLX's
    allocator (`mx.get_peak_memory()`, as training records it) and the process's peak resident memory, which also
    holds what lives outside MLX (NumPy's attention tiles, the tokenizer, Python), both in GiB; for a resumable
    evaluation, `taken_up`: the records an interrupted run had finished, whose time is not in `seconds`."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cost = {"seconds": round(time.perf_counter() - started, 3), "peak_memory_gb": mx.get_peak_memory() / 2**30,
            "max_rss_gb": rss / 2**30}
    return cost if taken_up is None else {**cost, "taken_up": taken_up}


# ---------------------------------------------------------------------------------------------------- CLI


@dataclass(kw_only=True)
class EvalSettings:
    """The settings every evaluation command shares; field names are the flags' (`eval_parser`), defaults the
    flags' defaults. Each command's settings extend it and are what its `run(settings)` takes."""

    model: str
    schedule: str | None = None
    target: str | None = None
    original: int | None = None
    chunk: int = DEFAULT_CHUNK
    force: bool = False
    allow_beyond_window: bool = False
    overwrite: bool = False
    no_progress: bool = False


def settings_defaults(settings: type) -> dict:
    """{field: default} of a settings dataclass, for `ArgumentParser.set_defaults`: the flags' defaults are the
    dataclass's, declared once."""
    return {f.name: f.default for f in fields(settings) if f.default is not MISSING}


def command_line(prog: str, settings: EvalSettings, **changes) -> str:
    """The command line (shell-quoted) that runs a command's `settings` with `changes` applied: `prog`, then each
    setting that is not its default as its flag (`--name`; a switch for True), as `eval_parser` reads it back."""
    s, words = replace(settings, **changes), prog.split()
    for f in fields(s):
        value = getattr(s, f.name)
        if f.default is MISSING or value != f.default:
            flag = "--" + f.name.replace("_", "-")
            words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def eval_parser(prog: str, description: str) -> ArgumentParser:
    """The evaluators' shared flags (`EvalSettings`): --model, --schedule (--scaling), --target, --original,
    --chunk, --force, --allow-beyond-window, --overwrite, --no-progress; each command sets the defaults from its
    settings (`settings_defaults`)."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", required=True, help="model folder (e.g. written by pose_mlx.finetune), .gguf "
                                                       "file, Hugging Face hub id, or an alias of pose_mlx.finetune")
    parser.add_argument("--schedule", "--scaling", dest="schedule",
                        help="extend a raw model with this RoPE schedule before evaluating (default with --target: "
                             "yarn, as finetune's; linear is Position Interpolation), no training")
    parser.add_argument("--target", help="target window for --schedule: 32768, 32k or 8x")
    parser.add_argument("--original", type=tokens,
                        help="the model's pre-training window (default: from pose_mlx.json or config.json)")
    parser.add_argument("--chunk", type=tokens,
                        help=f"tokens per prefill chunk (memory ~ chunk x length; default {DEFAULT_CHUNK})")
    parser.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds the RAM")
    parser.add_argument("--allow-beyond-window", action="store_true",
                        help="measure lengths beyond the window the model declares (max_position_embeddings, or the "
                             "target of its extension), on purpose: refused without it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results at --output (refused by default), or at the default name (by "
                             "default a taken name gets -2, -3, ...)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def check_chunk(chunk: int) -> None:
    if not 1 <= chunk <= 1 << 20:
        raise UserError(f"--chunk must be between 1 and {1 << 20}, got {chunk}")


def resolve_lengths(arg: str | None, info: EvalModel) -> list[int]:
    """`--lengths` (the length grammar: 2k,4k,8192 or 1x,2x,4x of the original window), or the default doubling
    from half the original window to the model's maximum."""
    return parse_lengths(arg, info.original) if arg else default_lengths(info.original, info.maximum)


__all__ = [
    "DEFAULT_CHUNK", "EvalModel", "EvalSettings", "bos_id", "cache_held_to", "check_chunk", "check_memory",
    "chunked_logits", "chunked_nll", "command_line", "encode", "eval_parser", "load_eval_model", "prefill",
    "resolve_lengths", "settings_defaults",
]
