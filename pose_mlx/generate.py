"""Generate text from an extended model and a long prompt: `python -m pose_mlx.generate`.

The prompt is `--prompt-file` (a text file, `-` for stdin), then `--prompt` after a blank line (a question about
the file), or either alone; `--chat` wraps it as the user's message in the tokenizer's chat template (with
`--system` as the system message). The model is any reference the evaluators take, with a fine-tuned folder's
schedule re-applied and a raw model extended at load with `--schedule/--target` (`pose_mlx.eval.longctx`).
The answer streams to stdout token by token; stderr carries the model line, a progress bar with ETA over a
prefill longer than one chunk (its predicted work, chunk by chunk), and at the end one line with the prompt's and
the answer's tokens per second.

Generation is mlx-lm's own (`mlx_lm.stream_generate`; greedy by default, `--temp` samples), with the prompt
prefilled through the KV cache `--chunk` tokens at a time into a cache allocated once for prompt and answer.
On MLX's CPU backend the model's attention runs on the project's exact CPU path
(`pose_mlx.eval.cpu_attention.fast_attention`, several times faster on long prompts); on Metal and CUDA it is
MLX's fused kernel. A dynamic-NTK model sets its base from the whole prompt while prefilling
(`pose_mlx.model.patch.use_length`), as one forward pass would.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from . import memory
from .errors import UserError, command
from .eval import longctx
from .eval.cost import Compute, WorkBar
from .eval.cpu_attention import fast_attention
from .lengths import tokens
from .model.patch import use_length
from .settings import RUN_FILE, command_line, load_run_file

DEFAULT_MAX_TOKENS = 256
PROG = "python -m pose_mlx.generate"


@dataclass(kw_only=True)
class GenerateSettings(longctx.EvalSettings):
    """What `python -m pose_mlx.generate` is asked (the flags' names and defaults); `run` checks it."""

    prompt: str | None = None
    prompt_file: str | None = None
    chat: bool = False
    system: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    seed: int | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = longctx.eval_parser(PROG, __doc__.split("\n")[0])
    parser.add_argument("--prompt", help="the prompt; with --prompt-file, appended after the file's text and a "
                                         "blank line (e.g. a question about the file)")
    parser.add_argument("--prompt-file", help="read the prompt from this text file ('-': standard input)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as the user's message in the tokenizer's chat template")
    parser.add_argument("--system", "--system-prompt", dest="system",
                        help="with --chat: the system message (default: the template's own)")
    parser.add_argument("--max-tokens", type=tokens, metavar="N",
                        help=f"most tokens to generate: 512, 2k (default {DEFAULT_MAX_TOKENS}; fewer where the "
                             "model's window ends)")
    parser.add_argument("--temp", type=float, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, help="random seed of the sampling (default: a fresh one each run)")
    parser.set_defaults(**longctx.settings_defaults(GenerateSettings))
    return parser


def check(args: GenerateSettings) -> None:
    """The flags that need no model: UserError naming the flag."""
    longctx.check_chunk(args.chunk)
    if args.prompt is None and args.prompt_file is None:
        raise UserError("no prompt: give --prompt TEXT, --prompt-file FILE ('-' for stdin), or both")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not (math.isfinite(args.temp) and args.temp >= 0):
        raise UserError(f"--temp must be a finite number >= 0 (0 = greedy), got {args.temp}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise UserError(f"--seed must be in [0, 2^64), got {args.seed}")
    if args.system is not None and not args.chat:
        raise UserError("--system: only with --chat (it is the chat template's system message)")


def read_prompt(args: GenerateSettings) -> str:
    """The file's text (or stdin's), then `--prompt` after a blank line; UserError when unreadable or empty."""
    text = args.prompt if args.prompt_file is None else _read_text(args.prompt_file)
    if args.prompt_file is not None and args.prompt is not None:
        text = f"{text.rstrip()}\n\n{args.prompt}"
    if not text.strip():
        raise UserError("the prompt is empty (--prompt and --prompt-file hold no text)")
    return text


def _read_text(name: str) -> str:
    if name == "-":
        if sys.stdin.isatty():
            print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(name).read_bytes()
        except OSError as error:
            raise UserError(f"--prompt-file {name}: cannot read it ({error.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        where = "standard input" if name == "-" else name
        raise UserError(f"--prompt-file {where}: not UTF-8 text (byte {error.start})") from None


def prompt_tokens(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of the prompt: `text` with the tokenizer's special tokens (BOS), or with `chat` the chat
    template's rendering of [system, user] messages with the assistant's turn opened (as `mlx_lm.generate`)."""
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("--chat: the model's tokenizer has no chat template; drop --chat to send the raw text")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def answer_room(prompt: int, args: GenerateSettings, info: longctx.EvalModel) -> int:
    """Tokens the answer may take: `--max-tokens`, fewer where the model's window ends (unless
    `--allow-beyond-window`); UserError when the prompt alone fills the window, with the commands that give the
    model a window for it (`longer_window`)."""
    if args.allow_beyond_window:
        return args.max_tokens
    if prompt >= info.maximum:
        raise UserError(f"the prompt is {prompt} tokens, at least the window this model declares, {info.maximum} "
                        f"({info.declared_by}); shorten it, {longer_window(args, info, prompt)}, or pass "
                        "--allow-beyond-window to read past the window anyway")
    return min(args.max_tokens, info.maximum - prompt)


def longer_window(args: GenerateSettings, info: longctx.EvalModel, prompt: int) -> str:
    """Whole commands (in backquotes) that give the model a window for the prompt and `--max-tokens`: this command
    with a schedule at load (a raw model, one extended at load, one fine-tuned without a schedule); for a folder
    fine-tuned with a schedule, the fine-tuning again to a longer target, from the run.json it kept (else where
    to read about it), and its base extended at load."""
    target = f"{2 ** math.ceil(math.log2((prompt + args.max_tokens) / info.original))}x"
    saved = None if args.schedule or args.target else getattr(info.model, "pose_extension", None)  # pose_mlx.json's
    if saved is None or saved.schedule == "none":
        at_load = longctx.command_line(PROG, args, schedule=args.schedule or "yarn", target=target)
        return f"or extend it at load, no training: `{at_load}`"
    try:
        run = load_run_file(Path(info.path) / RUN_FILE)
    except UserError:
        return (f"or fine-tune its base model for a longer window (--target {target}: docs/finetune.md; this "
                "folder kept no run.json to repeat)")
    again = command_line(run, {"target": target, "output": f"{info.path}-{target}"})
    base = longctx.command_line(PROG, args, model=run.model, schedule=run.schedule, target=target,
                                original=run.original)
    return f"fine-tune it for a longer window: `{again}`, or extend its base at load, no training: `{base}`"


def check_memory(info: longctx.EvalModel, length: int, chunk: int, force: bool) -> tuple[str, int]:
    """The predicted peak of a `length`-token generation (`pose_mlx.memory.eval_memory`, last position's
    logits) against this machine's memory: UserError above it unless `force` (then a warning). Returns the
    prediction in words and MLX's predicted peak in bytes."""
    estimate = memory.eval_memory(info.config, length, chunk, all_logits=False)
    total = estimate.peak + estimate.details["numpy_bytes"]
    available, where = memory.device.available_memory()
    if total > available:
        message = (f"prompt and answer ({length} tokens) need about {memory.format_size(total)}, more than the "
                   f"{memory.format_size(available)} this machine offers ({where}); use a shorter prompt, fewer "
                   "--max-tokens or a smaller --chunk (or --force)")
        if not force:
            raise UserError(message)
        print(f"warning: {message}", file=sys.stderr)
    return memory.format_size(total), estimate.peak


def generate(model, tokenizer, prompt: list[int], max_tokens: int, *, temp: float = 0.0,
             chunk: int = longctx.DEFAULT_CHUNK, progress=None) -> Iterator:
    """mlx-lm's `stream_generate` responses (`.text` the next piece of the answer) for `prompt` (token ids):
    the prompt prefilled `chunk` tokens at a time into a KV cache allocated once for prompt and answer, with
    the CPU attention path on MLX's CPU backend. `progress(done, total)` is told of the prefill's progress."""
    cache = make_prompt_cache(model)
    with fast_attention(model), use_length(model, len(prompt)), longctx.reserved(cache, len(prompt) + max_tokens):
        yield from stream_generate(model, tokenizer, prompt, max_tokens, sampler=make_sampler(temp),
                                   prompt_cache=cache, prefill_step_size=chunk, prompt_progress_callback=progress)


class PrefillBar:
    """The prefill's progress: a `WorkBar` of one item, the prompt, whose ETA follows the prefill's predicted work
    (`compute`: a chunk costs more the more tokens it attends to), with the tokens read; shown only when the prefill
    takes more than one chunk, closed when it ends, before the answer streams."""

    def __init__(self, compute: Compute, total: int, chunk: int, enabled: bool):
        self.work = WorkBar("prefill", [compute.prefill(total, 0, 1)], "prompt", show=enabled and total > chunk)
        self.fed = self.work.reading(0, compute, total, f"{total} tokens")

    def __call__(self, done: int, total: int) -> None:
        if done < total:
            self.fed(done, total)
        elif not self.work.finished:
            self.work.done(0, f"{total} tokens")
            self.work.close()


@command("pose_mlx.generate")
def main(argv=None) -> int:
    run(GenerateSettings(**vars(build_parser().parse_args(argv))))
    return 0


def run(args: GenerateSettings) -> str:
    """The command: check `args`, read the prompt, load the model, stream the answer to stdout, say what it took
    on stderr; returns the answer."""
    check(args)
    text = read_prompt(args)
    info = longctx.load_eval_model(args.model, args.schedule, args.target, args.original)
    prompt = prompt_tokens(info.tokenizer, text, args.chat, args.system)
    room = answer_room(len(prompt), args, info)
    estimate, peak = check_memory(info, len(prompt) + room, args.chunk, args.force)
    capped = f"the model's window of {info.maximum} tokens" if room < args.max_tokens else ""
    print(f"model {info.path}: schedule {info.schedule}; window {info.maximum}; prompt {len(prompt)} tokens, "
          f"answer up to {room}{f' ({capped})' if capped else ''}; memory estimate {estimate}", file=sys.stderr)
    if args.seed is not None:
        mx.random.seed(args.seed)
    pieces, last, started = [], None, time.perf_counter()
    with longctx.cache_held_to(peak):
        bar = PrefillBar(Compute.of(memory.architecture(info.config)), len(prompt), args.chunk, not args.no_progress)
        for last in generate(info.model, info.tokenizer, prompt, room, temp=args.temp, chunk=args.chunk,
                             progress=bar):
            pieces.append(last.text)
            sys.stdout.write(last.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary(last, room, time.perf_counter() - started, capped), file=sys.stderr)
    return "".join(pieces)


def summary(last, room: int, seconds: float, capped: str) -> str:
    """The closing stderr line: prompt and generation speeds, why the answer stopped (`capped`: the window, when
    it cut `--max-tokens` to `room`), the peak memory."""
    prompt_seconds = last.prompt_tokens / last.prompt_tps
    reason = "end of answer" if last.finish_reason == "stop" else capped or f"--max-tokens {room}"
    return (f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s ({prompt_seconds:.1f} s); "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s (stopped: {reason}); "
            f"{seconds:.1f} s in all, peak memory {memory.format_size(mx.get_peak_memory())}")


if __name__ == "__main__":
    sys.exit(main())
