"""Shared machinery of the long-context evaluators (`pose_mlx.perplexity`, `pose_mlx.passkey`).

- `load_eval_model`: a folder written by `finetune` (its `pose_mlx.json` schedule is re-applied), or a raw
  model extended on the fly with `--scaling/--target` (e.g. PI-only: linear interpolation, no training).
- `chunked_nll` / `chunked_logits` / `prefill`: feed a long sequence through mlx-lm's KV cache C tokens at a
  time ("chunked prefill"). Causal attention makes this exact: token t attends to the cached keys 0..t, so
  the logits equal those of one full forward, while the attention scores held at once are C x L instead of
  L x L and memory grows with the cache (linear in L).
- `estimate_memory`: weights + KV cache (2 * layers * kv_heads * head_dim * L * bytes) + one chunk's attention
  scores (C * L * heads * 4 bytes) + one chunk's logits (C * vocab * 4 bytes), compared with the RAM.
- `parse_lengths`: "2k,4k,8192" -> [2048, 4096, 8192].
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import backend as _backend  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .eval_forward import eval_logits

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken", "tiktoken.model")
DEFAULT_CHUNK = 512


class EvalError(ValueError):
    """A bad input to an evaluation command; the CLI prints its message as one line and exits non-zero."""


# ----------------------------------------------------------------------------------------------- lengths


def parse_lengths(text: str) -> list[int]:
    """Parse a comma-separated list of lengths: plain integers or a `k` suffix (x1024). Sorted, unique.

    >>> parse_lengths("2k,4k,8192")
    [2048, 4096, 8192]
    """
    lengths = []
    for item in str(text).split(","):
        item = item.strip().lower()
        match = re.fullmatch(r"(\d+)(k?)", item)
        if not match:
            raise EvalError(f"--lengths: cannot parse {item!r} in {text!r} (expected e.g. 2k,4k,8192)")
        value = int(match.group(1)) * (1024 if match.group(2) else 1)
        if value < 2:
            raise EvalError(f"--lengths: {item!r} is too short (a window needs at least 2 tokens)")
        lengths.append(value)
    return sorted(set(lengths))


def default_lengths(original_length: int, max_length: int) -> list[int]:
    """Doubling from half the original window up to `max_length` (which is always included)."""
    lengths, length = [], max(2, original_length // 2)
    while length <= max_length:
        lengths.append(length)
        length *= 2
    if not lengths or lengths[-1] != max_length:
        lengths.append(max_length)
    return lengths


# ----------------------------------------------------------------------------------------------- loading


@dataclass
class EvalModel:
    """A model ready for evaluation and what is known about its context windows."""

    model: nn.Module
    tokenizer: object
    path: str
    original_length: int  # the pre-training window (Lc)
    max_length: int  # the window the model claims (Lt, or max_position_embeddings)
    schedule: str  # e.g. "none", "linear (from pose_mlx.json)", "linear (--scaling)"


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise EvalError(f"--model: {folder} has no config.json (not an mlx-lm model folder)") from None


def _config_windows(config: dict) -> tuple[int, int]:
    """(original window, max window) from a config: rope_scaling's original length when present."""
    max_len = config.get("max_position_embeddings") or config.get("n_positions") or config.get("seq_length")
    scaling = config.get("rope_scaling") or {}
    original = config.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if max_len is None:
        raise EvalError("--model: config.json has no max_position_embeddings; pass --lengths and --original")
    return int(original or max_len), int(max_len)


def load_eval_model(
    path: str | Path, scaling: str | None = None, target: int | None = None, original: int | None = None
) -> EvalModel:
    """Load `path` with `pose_mlx.patch.load` (re-applies a saved schedule); optionally extend it here.

    `scaling`/`target`: extend a raw model with schedule `scaling` (default "linear" = Position Interpolation)
    from `original` (default: the config's window) to `target` tokens, without training.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise EvalError(f"--model: {folder} is not a folder")
    config = _read_config(folder)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise EvalError(
            f"--model: {folder} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
            "copy them from the base model"
        )
    if (folder / "pose_mlx.json").exists() or scaling or target:
        from .patch import load  # re-applies the saved schedule
    else:
        from mlx_lm import load

    model, tokenizer = load(str(folder))
    cfg_original, cfg_max = _config_windows(config)
    extension = getattr(model, "pose_extension", None)
    if extension is not None and (scaling or target):
        raise EvalError(f"--scaling/--target: {folder} is already extended ({extension.method}); drop them")
    if extension is not None:
        return EvalModel(model, tokenizer, str(folder), extension.original_length, extension.target_length,
                         f"{extension.method} x{extension.factor:g} (from pose_mlx.json)")
    if scaling or target:
        if not target:
            raise EvalError("--target: required with --scaling (the length to extend to)")
        base_len = int(original or cfg_original)
        if int(target) < base_len:
            raise EvalError(f"--target: {target} is shorter than the original window {base_len}")
        method = scaling or "linear"
        from .patch import extend

        extend(model, method, base_len, int(target))
        return EvalModel(model, tokenizer, str(folder), base_len, int(target),
                         f"{method} x{target / base_len:g} (--scaling, no training)")
    if original:
        cfg_original = int(original)
    return EvalModel(model, tokenizer, str(folder), cfg_original, cfg_max, "as configured")


def bos_id(tokenizer) -> int:
    """The id that starts every window: BOS, else EOS (GPT-2 style), else an error."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise EvalError("--model: the tokenizer has neither a BOS nor an EOS token to start windows with")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens (windows add their own BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------------- chunked prefill


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


def prefill(
    model: nn.Module,
    tokens,
    cache: list,
    chunk: int = DEFAULT_CHUNK,
    on_chunk: Callable[[int, mx.array], None] | None = None,
) -> mx.array:
    """Feed `tokens` (1-D) into `cache` C tokens at a time; returns the logits of the last token (vocab,).

    `on_chunk(start, logits)` receives each chunk's logits (C, vocab), float32, positions start..start+C-1.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    ids = mx.array(np.asarray(tokens, dtype=np.int32))
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    last = None
    for start in range(0, ids.size, chunk):
        logits = eval_logits(model, ids[None, start : start + chunk], cache, on_chunk is None)[0].astype(mx.float32)
        if on_chunk is not None:
            on_chunk(start, logits)
        last = logits[-1]
        mx.eval(last)
        _eval_cache(cache)
    return last


def chunked_nll(model: nn.Module, tokens, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """-log p(tokens[t+1] | tokens[:t+1]) for t = 0..L-2, via chunked prefill; float64 array (L-1,).

    NLL = logsumexp(logits_t) - logits_t[target]; only the NLLs (not the logits) are kept per chunk.
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

    prefill(model, tokens, make_prompt_cache(model), chunk, score)
    return out


def chunked_logits(model: nn.Module, tokens, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """All logits (L, vocab) of `tokens` computed by chunked prefill (for checking it against a full forward)."""
    parts: list[np.ndarray] = []
    prefill(model, tokens, make_prompt_cache(model), chunk, lambda _s, lg: parts.append(np.array(lg)))
    return np.concatenate(parts, axis=0)


# ------------------------------------------------------------------------------------------------ memory


@dataclass
class MemoryEstimate:
    """Bytes an evaluation at one length needs (an estimate: activations of one chunk are not counted)."""

    length: int
    weights: int
    kv_cache: int
    attention: int
    logits: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.attention + self.logits

    def describe(self) -> str:
        return (f"{_size(self.total)} at {self.length} tokens (weights {_size(self.weights)}, "
                f"KV cache {_size(self.kv_cache)}, chunk attention {_size(self.attention)}, "
                f"logits {_size(self.logits)})")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _arg(model, *names, default=None):
    args = getattr(model, "args", None)
    for name in names:
        value = getattr(args, name, None)
        if value:
            return value
    return default


def estimate_memory(model: nn.Module, length: int, chunk: int = DEFAULT_CHUNK) -> MemoryEstimate:
    """KV cache = 2 * layers * kv_heads * head_dim * length * bytes; attention = C * length * heads * 4."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    weights = sum(p.nbytes for _, p in params)
    itemsize = max((p.dtype.size for _, p in params if mx.issubdtype(p.dtype, mx.floating)), default=4)
    heads = int(_arg(model, "num_attention_heads", "n_head", default=1))
    kv_heads = int(_arg(model, "num_key_value_heads", "n_kv_heads", default=heads))
    hidden = int(_arg(model, "hidden_size", "n_embd", "dim", default=heads))
    head_dim = int(_arg(model, "head_dim", default=hidden // heads))
    layers = len(getattr(model, "layers", [])) or int(_arg(model, "num_hidden_layers", "n_layer", default=1))
    vocab = int(_arg(model, "vocab_size", default=0))
    c = min(chunk, length)
    return MemoryEstimate(
        length=length,
        weights=int(weights),
        kv_cache=2 * layers * kv_heads * head_dim * length * itemsize,
        attention=c * length * heads * 4,
        logits=c * vocab * 4,
    )


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (os.sysconf), or None where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(model: nn.Module, lengths: list[int], chunk: int, force: bool = False) -> MemoryEstimate:
    """Estimate the longest length's memory; raise EvalError (or only warn with `force`) above the RAM."""
    estimate = estimate_memory(model, max(lengths), chunk)
    ram = physical_memory()
    if ram is not None and estimate.total > ram:
        message = (f"--lengths: evaluation needs about {estimate.describe()}, more than this machine's "
                   f"{ram / 2**30:.1f} GiB; use shorter --lengths or a smaller --chunk (or --force)")
        if not force:
            raise EvalError(message)
        print(f"warning: {message}", file=sys.stderr)
    return estimate


# ---------------------------------------------------------------------------------------------------- CLI


def quiet_transformers() -> None:
    """Quiet transformers' notices and warnings (set TRANSFORMERS_VERBOSITY to see them): the variable is read
    at import, and transformers is often imported (by mlx_lm) before this runs, so it is set directly too."""
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # no "PyTorch was not found" notice
        if "transformers" in sys.modules:  # e.g. "Unrecognized keys in `rope_parameters`"
            sys.modules["transformers"].logging.set_verbosity_error()


def cli_main(prog: str) -> Callable:
    """Decorator for a CLI entry point: an EvalError/ValueError/OSError becomes one line on stderr, exit 2;
    transformers' notices are quieted (`quiet_transformers`)."""

    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def run(argv=None) -> int:
            quiet_transformers()
            try:
                return func(argv) or 0
            except (ValueError, OSError) as error:
                print(f"{prog}: error: {error}", file=sys.stderr)
                return 2

        return run

    return wrap


def add_model_arguments(parser) -> None:
    """--model, --scaling, --target, --original, --chunk, --force, --no-progress."""
    parser.add_argument("--model", required=True, help="model folder (e.g. written by pose_mlx.finetune)")
    parser.add_argument("--scaling", default=None,
                        help="extend a raw model with this RoPE schedule before evaluating (default with --target: "
                             "linear = Position Interpolation), no training")
    parser.add_argument("--target", type=int, default=None, help="target window for --scaling")
    parser.add_argument("--original", type=int, default=None,
                        help="the model's pre-training window (default: from pose_mlx.json or config.json)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                        help=f"tokens per prefill chunk (memory ~ chunk x length; default {DEFAULT_CHUNK})")
    parser.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds the RAM")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def resolve_lengths(arg: str | None, info: EvalModel) -> list[int]:
    """`--lengths` parsed, or the default doubling from half the original window to the model's maximum."""
    return parse_lengths(arg) if arg else default_lengths(info.original_length, info.max_length)


__all__ = [
    "DEFAULT_CHUNK", "EvalError", "EvalModel", "MemoryEstimate", "add_model_arguments", "bos_id", "check_memory",
    "chunked_logits", "chunked_nll", "cli_main", "default_lengths", "encode", "estimate_memory", "load_eval_model",
    "parse_lengths", "physical_memory", "prefill", "resolve_lengths",
]
