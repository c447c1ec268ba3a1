"""Passkey retrieval (Mohtashami & Jaggi, 2023) at several context lengths: `python -m pose_mlx.passkey`.

A prompt is the task line, filler sentences, the needle line "The pass key is K. Remember it. K is the pass
key." at a relative depth, more filler, and "What is the pass key? The pass key is". The filler is counted in
the model's own tokens, so each prompt (BOS included) has the requested length up to one filler sentence.
The key is a uniform random 5-digit number; the answer is at most 10 greedily decoded tokens and is correct
when its first integer equals the key. Prompts are evaluated through one KV cache: consecutive trials share
their common prefix (the task line and the filler before the shallower needle), which is kept, not recomputed
(for a dynamic-NTK model only between prompts of the same length, whose keys rotate by the same base).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

import numpy as np

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from . import haystack, longctx
from ..errors import UserError, command
from ..resumable import RecordLog
from ..words import counted
from .cost import Compute, WorkBar, shared_prefix
from .opening import open_evaluation

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = haystack.FILLER
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
MAX_NEW_TOKENS = 10
#: Trials per length by default: enough for a first look in minutes to an hour on a laptop's CPU (a 16k-token
#: prompt of a 135M model takes minutes there); an accuracy p over n trials has a standard error of
#: sqrt(p (1 - p) / n): up to 0.16 at 10, 0.07 at 50, so results to report take --trials 30 to 50.
DEFAULT_TRIALS = 10


def prompt_text(n_sentences: int, depth: float, key: int) -> str:
    """The prompt with `n_sentences` filler sentences, round(depth * n) of them before the needle."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    before = int(round(depth * n_sentences))
    filler = [FILLER[i % len(FILLER)] for i in range(n_sentences)]
    parts = [TASK, " ".join(filler[:before]), NEEDLE.format(key=key), " ".join(filler[before:]), QUESTION]
    return "\n".join(p for p in parts if p)


def prompt_tokens(tokenizer, bos: int, n_sentences: int, depth: float, key: int) -> list[int]:
    return [bos] + longctx.encode(tokenizer, prompt_text(n_sentences, depth, key))


def build_prompt(tokenizer, bos: int, length: int, depth: float, key: int) -> list[int]:
    """Token ids (BOS first) of the prompt with the most filler sentences that keeps it <= `length` tokens."""
    def count(n: int) -> int:
        return len(prompt_tokens(tokenizer, bos, n, depth, key))

    empty = count(0)
    if empty > length:
        raise UserError(f"--lengths: {length} tokens is shorter than the passkey template alone ({empty} tokens)")
    per_sentence = max((count(50) - empty) / 50, 1e-3)
    guess = max(0, int((length - empty) / per_sentence))
    # the largest n with count(n) <= length (count grows with n): gallop from the guess, then bisect, so a
    # long prompt is encoded O(log n) times, not once per sentence of the guess's error
    fits = lambda n: count(n) <= length  # noqa: E731
    step = max(1, guess // 100)
    if fits(guess):
        lo, hi = guess, guess + step
        while fits(hi):
            lo, hi, step = hi, hi + 2 * step, 2 * step
    else:
        lo, hi = max(0, guess - step), guess
        while lo > 0 and not fits(lo):
            lo, hi, step = max(0, lo - 2 * step), lo, 2 * step
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return prompt_tokens(tokenizer, bos, lo, depth, key)


def parse_answer(text: str) -> int | None:
    """The first run of digits in `text` as an integer ("1234 5" -> 1234), or None when there is none."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


class PrefixCachedGenerator:
    """Greedy decoding through one KV cache that keeps the longest prefix shared with the previous prompt."""

    def __init__(self, model, chunk: int = longctx.DEFAULT_CHUNK, reuse: bool = True):
        self.model, self.chunk = model, chunk
        self.cache = make_prompt_cache(model)
        self.dynamic = getattr(getattr(model, "pose_extension", None), "dynamic", False)
        self.reuse = reuse and can_trim_prompt_cache(self.cache)
        self.cached: list[int] = []  # the tokens whose keys/values are in the cache
        self.prompt_length = 0  # the length of the prompt they began with
        self.computed = 0  # prompt tokens actually fed through the model (for the reuse statistic)

    def _keep(self, prompt: list[int]) -> int:
        # a dynamic-NTK model rotates every key by a base set by the whole prompt's length: the cached keys are
        # the ones a fresh pass would compute only when the new prompt is exactly as long as the cached one
        if not self.reuse or (self.dynamic and len(prompt) != self.prompt_length):
            return 0
        limit = min(len(self.cached), len(prompt) - 1)  # feed at least one token to get logits
        shared = 0
        while shared < limit and self.cached[shared] == prompt[shared]:
            shared += 1
        return shared

    def generate(self, prompt: list[int], max_new: int, stop: set[int], progress=None) -> list[int]:
        """Greedy tokens after `prompt` (at most `max_new`, ending before a `stop` token); `progress(fed, new)`:
        the prefill's progress over the prompt's tokens that are not in the cache (`longctx.prefill`)."""
        keep = self._keep(prompt)
        if self.reuse:
            trim_prompt_cache(self.cache, len(self.cached) - keep)
        else:
            self.cache = make_prompt_cache(self.model)
        logits = longctx.prefill(self.model, prompt[keep:], self.cache, self.chunk, room=max_new, progress=progress)
        self.computed += len(prompt) - keep
        self.cached, self.prompt_length = list(prompt), len(prompt)
        out: list[int] = []
        while len(out) < max_new:
            token = int(mx.argmax(logits).item())
            if token in stop:
                break
            out.append(token)
            if len(out) == max_new:
                break
            logits = self.model(mx.array([[token]]), cache=self.cache)[0, -1]
            self.cached.append(token)
        return out


@dataclass
class Trial:
    length: int
    prompt_tokens: int
    depth: float
    key: int
    answer: str
    correct: bool


def trial_plan(lengths: list[int], trials: int, depths: int | None, seed: int) -> list[tuple[int, float, int]]:
    """(length, depth, key) for every trial; depths on a grid of `depths` points in [0, 1] or uniform."""
    if trials < 1:
        raise UserError(f"--trials: {trials} must be >= 1")
    if depths is not None and depths < 1:
        raise UserError(f"--depths: {depths} must be >= 1")
    rng = np.random.default_rng(seed)
    grid = np.linspace(0.0, 1.0, depths) if depths and depths > 1 else np.array([0.5]) if depths else None
    plan = []
    for length in lengths:
        for i in range(trials):
            depth = float(grid[i % len(grid)]) if grid is not None else float(rng.uniform())
            plan.append((length, depth, int(rng.integers(10_000, 100_000))))
    return plan


def run_passkey(model, tokenizer, lengths: list[int], trials: int, depths: int | None = None, seed: int = 0,
                chunk: int = longctx.DEFAULT_CHUNK, show_progress: bool = True, reuse: bool = True,
                done: list[Trial] = (), on_trial=None,
                compute: Compute | None = None) -> tuple[list[Trial], PrefixCachedGenerator]:
    """Run every trial; within a length, trials go deepest needle first so prompts share long prefixes.

    Trials in `done` (from an interrupted run of the same plan) are not run again; `on_trial(trial)` is called
    after each one that is. Says on stderr what will run; the progress bar's ETA follows each trial's predicted
    work (`compute`, the model's shapes; default: its tokens), within a trial too (chunk by chunk of its prompt)."""
    bos = longctx.bos_id(tokenizer)
    stop = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(int(tokenizer.eos_token_id))
    plan = sorted(trial_plan(lengths, trials, depths, seed), key=lambda t: (t[0], -t[1]))
    generator = PrefixCachedGenerator(model, chunk, reuse)
    kept = shared_prefix([(n, d) for n, d, _ in plan]) if generator.reuse else [0] * len(plan)
    compute = compute or Compute.tokens_only()
    works = [compute.generation(n, k, MAX_NEW_TOKENS) for (n, _, _), k in zip(plan, kept)]
    print(f"passkey: {counted(len(plan), 'trial')} ({trials} at each of {', '.join(map(str, sorted(set(lengths))))} "
          "tokens): "
          f"{sum(n for n, _, _ in plan):,} prompt tokens, about {sum(n for n, _, _ in plan) - sum(kept):,} of them "
          "computed (the rest shared with the prompt before)", file=sys.stderr)
    finished = {(t.length, t.depth, t.key): t for t in done}
    results = []
    with WorkBar("passkey", works, "trial", show_progress) as bar:
        for i, (length, depth, key) in enumerate(plan):
            if (length, depth, key) in finished:
                results.append(finished[(length, depth, key)])
                bar.skip(i)
                continue
            prompt = build_prompt(tokenizer, bos, length, depth, key)
            fed = bar.reading(i, compute, len(prompt), f"{length} tokens", MAX_NEW_TOKENS)
            answer = tokenizer.decode(generator.generate(prompt, MAX_NEW_TOKENS, stop, fed))
            results.append(Trial(length, len(prompt), depth, key, answer, parse_answer(answer) == key))
            bar.done(i, f"{length} tokens")
            if on_trial is not None:
                on_trial(results[-1])
    return results, generator


def accuracy_by_length(trials: list[Trial]) -> list[dict]:
    lengths = sorted({t.length for t in trials})
    out = []
    for length in lengths:
        hits = [t.correct for t in trials if t.length == length]
        tokens = [t.prompt_tokens for t in trials if t.length == length]
        out.append({"length": length, "accuracy": float(np.mean(hits)), "trials": len(hits),
                    "prompt_tokens_min": min(tokens), "prompt_tokens_max": max(tokens)})
    return out


def depth_grid(trials: list[Trial], bins: int = 10) -> tuple[np.ndarray, list[str], list[int]]:
    """Accuracy per (depth bin, length): rows = depths (grid values, or `bins` equal bins), NaN when empty."""
    lengths = sorted({t.length for t in trials})
    values = sorted({t.depth for t in trials})
    if len(values) <= bins:  # a grid of depths: one row each
        rows = values
        row_of = {v: i for i, v in enumerate(values)}
        labels = [f"{v:.0%}" for v in values]
        index = [row_of[t.depth] for t in trials]
    else:
        rows = list(range(bins))
        labels = [f"{i / bins:.0%}-{(i + 1) / bins:.0%}" for i in rows]
        index = [min(int(t.depth * bins), bins - 1) for t in trials]
    hits = np.zeros((len(rows), len(lengths)))
    counts = np.zeros_like(hits)
    for t, r in zip(trials, index):
        c = lengths.index(t.length)
        hits[r, c] += t.correct
        counts[r, c] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        grid = np.where(counts > 0, hits / np.maximum(counts, 1), np.nan)
    return grid, labels, lengths


def format_table(accuracy: list[dict]) -> str:
    lines = ["| length | prompt tokens | trials | accuracy |", "|---|---|---|---|"]
    for a in accuracy:
        lines.append(f"| {a['length']} | {a['prompt_tokens_min']}-{a['prompt_tokens_max']} | {a['trials']} | "
                     f"{a['accuracy']:.2f} |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class PasskeySettings(longctx.EvalSettings):
    """What `python -m pose_mlx.passkey` is asked (the flags' names and defaults); `run` checks it."""

    lengths: str | None = None  # the length grammar: 2k,4k,8192 or 1x,2x of the original window
    trials: int = DEFAULT_TRIALS
    depths: int | None = None
    seed: int = 0
    output: str | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = longctx.eval_parser("python -m pose_mlx.passkey", __doc__.split("\n")[0])
    parser.add_argument("--lengths", help="prompt lengths, e.g. 2k,4k,8192 or 1x,2x,4x of the original window "
                                           "(default: doubling from half the original window to the model's maximum)")
    parser.add_argument("--trials", type=int,
                        help=f"trials per length (default {DEFAULT_TRIALS}: a first look; an accuracy over n trials "
                             "has a standard error of up to 0.5/sqrt(n), so use 30-50 for results to report)")
    parser.add_argument("--depths", type=int,
                        help="put the needle on a grid of this many depths in [0, 1] (default: uniform random)")
    parser.add_argument("--seed", type=int, help="seed of the keys and random depths (default 0)")
    parser.add_argument("--output",
                        help="write JSON results here (and <stem>_accuracy.png, <stem>_heatmap.png next to it; "
                             "default: passkey-<lengths>-<N>trials.json in the model's results folder, see "
                             "docs/evaluation.md)")
    parser.set_defaults(**longctx.settings_defaults(PasskeySettings))
    return parser


def _check_flags(args) -> None:
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    if args.trials > 100_000:
        raise UserError(f"--trials must be at most 100000, got {args.trials}")
    trial_plan([], args.trials, args.depths, args.seed)  # --trials/--depths checked before loading the model


def _fit_lengths(args, info: longctx.EvalModel, lengths: list[int]) -> list[int]:
    """The default lengths without those too short for the template (given --lengths are kept as they are)."""
    if args.lengths:
        return lengths
    template = len(prompt_tokens(info.tokenizer, longctx.bos_id(info.tokenizer), 0, 0.5, 99_999))
    lengths = [n for n in lengths if n >= template]
    if not lengths:
        raise UserError(f"--lengths: the model's window {info.maximum} is shorter than the passkey "
                        f"template ({template} tokens); pass --lengths {2 ** (template - 1).bit_length()} "
                        "--allow-beyond-window (or longer lengths) to test beyond the window")
    return lengths


@command("pose_mlx.passkey")
def main(argv=None) -> int:
    run(PasskeySettings(**vars(build_parser().parse_args(argv))))
    return 0


def run(args: PasskeySettings) -> list[dict]:
    """The command: check `args` (UserError naming the flag), load the model, run the trials (resuming those
    an interrupted run logged), print the table, write the JSON and PNGs; returns the accuracy by length."""
    opening = open_evaluation("passkey", args, check=_check_flags, fit=_fit_lengths,
                              answer=MAX_NEW_TOKENS)  # the prompt and the answer in the cache
    info, lengths = opening.info, opening.lengths
    build_prompt(info.tokenizer, longctx.bos_id(info.tokenizer), min(lengths), 0.5, 99_999)  # template fits?
    header = {"model": str(info.path), "schedule": info.schedule, "lengths": lengths, "trials": args.trials,
              "depths": args.depths, "seed": args.seed}
    out = opening.announce(details=(f"{args.trials}trials", f"seed{args.seed}" if args.seed else "",
                                    f"depths{args.depths}" if args.depths else ""), header=header)
    log = RecordLog(out, header, Trial)
    with log.resumed("passkey", "trial", args.trials * len(lengths)) as done, opening.held():
        trials, generator = run_passkey(info.model, info.tokenizer, lengths, args.trials, args.depths, args.seed,
                                        args.chunk, not args.no_progress, done=done, on_trial=log.append,
                                        compute=opening.compute())
    accuracy = accuracy_by_length(trials)
    total = sum(t.prompt_tokens for t in trials)
    print(f"passkey retrieval, {counted(args.trials, 'trial')} per length, greedy answer of <= {MAX_NEW_TOKENS} "
          f"tokens, correct = first integer equals the key ({generator.computed}/{total} prompt tokens computed, "
          "the rest reused from the KV cache)")
    print(format_table(accuracy))
    out.parent.mkdir(parents=True, exist_ok=True)
    grid, labels, grid_lengths = depth_grid(trials)
    record = {"model": info.path, "schedule": info.schedule, "seed": args.seed, "lengths": lengths,
              "accuracy": accuracy, "depth_accuracy": {"depths": labels, "lengths": grid_lengths,
                                                       "accuracy": np.where(np.isnan(grid), None, grid).tolist()},
              "trials": [asdict(t) for t in trials], "cost": longctx.run_cost(opening.started, taken_up=len(done))}
    out.write_text(json.dumps(record, indent=2) + "\n")
    log.remove()
    from ..plots import heatmap, line_vs_length, trials_note  # matplotlib: loaded once there is something to plot

    trials_per_length = trials_note([a["trials"] for a in accuracy])
    acc_png = line_vs_length(out.with_name(out.stem + "_accuracy.png"), lengths,
                             {info.label: [a["accuracy"] for a in accuracy]}, "accuracy (share of trials)",
                             f"Passkey retrieval accuracy ({trials_per_length})", ylim=(-0.05, 1.05),
                             mark=info.original)
    heat_png = heatmap(out.with_name(out.stem + "_heatmap.png"), grid, labels, [str(n) for n in grid_lengths],
                       "context length (tokens)", "needle depth (share of the context)",
                       f"Passkey accuracy by depth and length\n({trials_per_length})")
    print(f"wrote {out}, {acc_png} and {heat_png}", file=sys.stderr)
    return accuracy
