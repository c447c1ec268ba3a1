"""RULER's synthetic tasks at several context lengths, and the effective context length: `python -m pose_mlx.ruler`.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654) probes long context with synthetic tasks: needle-in-a-haystack variants, variable tracking,
common and frequent words extraction (`pose_mlx.eval.ruler_tasks` generates them offline, sized in the evaluated
model's tokens). The model answers greedily (at most the task's token budget: 128 for the needle tasks, 30 for
variable tracking, 120 for common words, 50 for frequent words; `--max-new-tokens` sets one budget for all).

Score (RULER's "all references" string match): a sample scores the fraction of its reference strings found,
case-insensitively, in the output; a task at a length scores the mean over its samples, in [0, 1].

Effective length: the paper calls a length effective when the model's average over the tasks exceeds the
average of Llama-2-7B at 4k (85.6%, `--threshold 0.856`). Here: the largest tested length L such that every
tested length <= L averages >= the threshold; none when the shortest tested length already fails. (A length
that passes after a shorter one failed does not count: the claim is "reads its context up to L".)

Prompts run through one KV cache (`pose_mlx.eval.passkey.PrefixCachedGenerator`, chunked prefill): within a length,
samples whose prompts share their start (same template and haystack: the five essay needle tasks, or the
samples of one task) go deepest first needle first, so each prompt recomputes only the part after its first
needle. Prompts fill L tokens; the answer follows them (RULER counts the answer in L; here it extends L by at
most the answer budget).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import longctx
from ..errors import UserError, command
from ..lengths import tokens
from ..files import write_atomic
from ..resumable import RecordLog
from .cost import Compute, WorkBar, shared_prefix
from .haystack import essay_text
from .opening import open_evaluation
from .passkey import PrefixCachedGenerator
from .ruler_tasks import DEPTH_MODES, TASKS, PromptBuilder, PromptTooShort, parse_tasks
from ..words import counted

DEFAULT_THRESHOLD = 0.856  # Llama-2-7B's RULER average at 4k (Hsieh et al., 2024)
DEFAULT_SAMPLES = 10
#: The shortest --lengths each task fits with SmolLM2-135M-Instruct's tokenizer and chat template (to 8 tokens:
#: the template and needles alone); other tokenizers need somewhat more or less, and a run names every length too
#: short for its model at once, before any prompt is scored.
MIN_TOKENS = {"niah_single_1": 112, "niah_single_2": 112, "niah_single_3": 136, "niah_multikey_1": 160,
              "niah_multikey_2": 112, "niah_multikey_3": 216, "niah_multivalue": 168, "niah_multiquery": 192,
              "vt": 264, "cwe": 400, "fwe": 136}
EFFECTIVE_LENGTH = ("the largest tested length L such that the average score over the tasks is >= the threshold "
                    "at every tested length <= L (null: the shortest tested length is below it)")


def match_all(output: str, references: list[str]) -> float:
    """Fraction of `references` that occur in `output`, case-insensitively (RULER's all-references match)."""
    if not references:
        raise ValueError("references: need at least one")
    text = output.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


@dataclass
class Record:
    """One sample: its prompt, where its needles are, what the model answered and its score."""

    task: str
    length: int
    index: int
    prompt_tokens: int
    depths: list[float]  # requested needle depths (empty for cwe / fwe)
    needle_tokens: list[int]  # prompt tokens before each needle
    references: list[str]
    output: str
    score: float


@dataclass
class RulerRun:
    """Every record of a run, in evaluation order, and what the KV cache saved."""

    tasks: list[str]
    lengths: list[int]
    records: list[Record] = field(default_factory=list)
    computed_tokens: int = 0  # prompt tokens fed through the model (the rest came from the cache)
    seconds_prompts: float = 0.0
    seconds_model: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    def score(self, task: str, length: int) -> float:
        scores = [r.score for r in self.records if r.task == task and r.length == length]
        return float(np.mean(scores)) if scores else float("nan")

    def results(self) -> list[dict]:
        """[{task, length, score, samples}] for every task (TASKS order) and length."""
        return [{"task": t, "length": n, "score": self.score(t, n),
                 "samples": sum(1 for r in self.records if r.task == t and r.length == n)}
                for t in self.tasks for n in self.lengths]

    def averages(self) -> dict[int, float]:
        """Mean over the tasks of each task's score, per length."""
        return {n: float(np.mean([self.score(t, n) for t in self.tasks])) for n in self.lengths}

    def effective_length(self, threshold: float = DEFAULT_THRESHOLD) -> int | None:
        return effective_length(self.averages(), threshold)


def effective_length(averages: dict[int, float], threshold: float = DEFAULT_THRESHOLD) -> int | None:
    """The largest length L with averages[n] >= threshold for every n <= L (see EFFECTIVE_LENGTH)."""
    best = None
    for length in sorted(averages):
        if not averages[length] >= threshold:
            break
        best = length
    return best


def _reuse_group(task: str) -> tuple:
    """Tasks whose prompts start alike (same template and haystack) share a group."""
    spec = TASKS[task]
    if spec.kind == "niah" and spec.haystack in ("noise", "essay"):
        return ("niah", spec.haystack)
    return (task,)


def evaluation_order(builder: PromptBuilder, tasks: list[str], lengths: list[int],
                     samples: int) -> list[tuple[str, int, int]]:
    """(task, length, index) of every sample: by length, then reuse group, then first needle deepest first."""
    groups = list(dict.fromkeys(_reuse_group(t) for t in tasks))
    plan = []
    for length in lengths:
        for group in groups:
            members = [(t, i) for t in tasks if _reuse_group(t) == group for i in range(samples)]
            first = {(t, i): (builder.depths(t, length, i) or [0.0])[0] for t, i in members}
            members.sort(key=lambda m: (-first[m], tasks.index(m[0]), m[1]))
            plan.extend((t, length, i) for t, i in members)
    return plan


def stop_tokens(tokenizer) -> set[int]:
    stop = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(int(tokenizer.eos_token_id))
    return stop


def run_ruler(model, tokenizer, lengths: list[int], tasks: list[str] | str = "all", samples: int = DEFAULT_SAMPLES,
              seed: int = 0, *, chunk: int = longctx.DEFAULT_CHUNK, depth_mode: str = "spread",
              haystack: str | Path | None = None, max_new_tokens: int | None = None, chat: bool | None = None,
              show_progress: bool = True, reuse: bool = True, builder: PromptBuilder | None = None,
              done: list[Record] = (), on_record=None, compute: Compute | None = None) -> RulerRun:
    """Generate, answer and score `samples` prompts of every task at every length (lengths in tokens).

    `tasks`: "all", a comma list or a list of names; `depth_mode`: "spread" or "uniform" needle depths;
    `haystack`: a folder of .txt/.md/.rst files for the essay haystack (default: the language reference);
    `max_new_tokens`: one answer budget for all tasks (default: each task's); `chat`: force (True) or refuse
    (False) the tokenizer's chat template (default: use it when there is one); `reuse`: keep the KV cache of
    the prefix shared with the previous prompt; `builder`: a PromptBuilder made with the same settings;
    `done`: records of an interrupted run of the same settings, not run again; `on_record(record)`: called after
    each sample that is run; `compute`: the model's shapes, for the progress bar's ETA (default: tokens).
    """
    tasks = parse_tasks(tasks) if isinstance(tasks, str) else parse_tasks(",".join(tasks))
    lengths = sorted(set(int(n) for n in lengths))
    builder = builder or PromptBuilder(tokenizer, samples, seed, depth_mode, haystack, chat)
    generator = PrefixCachedGenerator(model, chunk, reuse)
    stop = stop_tokens(tokenizer)
    run = RulerRun(tasks, lengths)
    plan = evaluation_order(builder, tasks, lengths, samples)
    compute = compute or Compute.tokens_only()
    works = planned_work(builder, plan, compute, generator.reuse, max_new_tokens)
    finished = {(r.task, r.length, r.index): r for r in done}
    with WorkBar("ruler", works, "sample", show_progress) as bar:
        for i, (task, length, index) in enumerate(plan):
            if (task, length, index) in finished:
                run.records.append(finished[(task, length, index)])
                bar.skip(i)
                continue
            start = time.perf_counter()
            sample = builder.sample(task, length, index)
            middle = time.perf_counter()
            budget = max_new_tokens or TASKS[task].max_new_tokens
            fed = bar.reading(i, compute, len(sample.tokens), f"{task} @ {length}", budget)
            output = tokenizer.decode(generator.generate(sample.tokens, budget, stop, fed))
            run.seconds_prompts += middle - start
            run.seconds_model += time.perf_counter() - middle
            run.records.append(Record(task, length, index, len(sample.tokens), [n.depth for n in sample.needles],
                                      [n.token for n in sample.needles], sample.references, output,
                                      match_all(output, sample.references)))
            bar.done(i, f"{task} @ {length}")
            if on_record is not None:
                on_record(run.records[-1])
    run.computed_tokens = generator.computed
    return run


def planned_work(builder: PromptBuilder, plan: list[tuple[str, int, int]], compute: Compute, reuse: bool,
                 max_new_tokens: int | None) -> list[float]:
    """The predicted work of each sample of `plan` (`evaluation_order`): a prompt of its length, of which the text
    before its first needle comes from the cache after a sample of the same length and reuse group, then its
    answer budget; says on stderr what will run."""
    depths = [(length, (builder.depths(task, length, index) or [0.0])[0]) for task, length, index in plan]
    kept = shared_prefix(depths, lambda i: _reuse_group(plan[i][0])) if reuse else [0] * len(plan)
    works = [compute.generation(length, k, max_new_tokens or TASKS[task].max_new_tokens)
             for (task, length, _), k in zip(plan, kept)]
    tokens = sum(length for _, length, _ in plan)
    print(f"ruler: {counted(len(plan), 'sample')} ({counted(len({t for t, _, _ in plan}), 'task')} at "
          f"{', '.join(map(str, sorted({n for _, n, _ in plan})))} tokens): {tokens:,} prompt tokens, about "
          f"{tokens - sum(kept):,} of them computed (the rest shared with the prompt before)", file=sys.stderr)
    return works


# ------------------------------------------------------------------------------------------------- CLI


def format_table(run: RulerRun, threshold: float) -> str:
    """Markdown: one row per task, one column per length, then the average and the effective length."""
    lines = ["| task | " + " | ".join(str(n) for n in run.lengths) + " |", "|---|" + "---|" * len(run.lengths)]
    for task in run.tasks:
        lines.append(f"| {task} | " + " | ".join(f"{run.score(task, n):.2f}" for n in run.lengths) + " |")
    averages = run.averages()
    lines.append("| **average** | " + " | ".join(f"**{averages[n]:.2f}**" for n in run.lengths) + " |")
    effective = run.effective_length(threshold)
    lines.append("")
    lines.append(f"effective length: {effective if effective is not None else 'none'} (threshold {threshold:g}: "
                 f"{EFFECTIVE_LENGTH})")
    return "\n".join(lines)


def record_json(run: RulerRun, info: longctx.EvalModel, args, threshold: float, chat: bool) -> dict:
    return {
        "model": info.path, "schedule": info.schedule, "original": info.original,
        "maximum": info.maximum, "seed": args.seed, "samples": args.samples, "tasks": run.tasks,
        "lengths": run.lengths, "depths": args.depths, "haystack": args.haystack or "pydoc_data.topics",
        "chat_template": chat, "max_new_tokens": {t: args.max_new_tokens or TASKS[t].max_new_tokens for t in run.tasks},
        "metric": "fraction of the references found in the greedy output (case-insensitive), mean over samples",
        "results": run.results(), "averages": [{"length": n, "score": s} for n, s in run.averages().items()],
        "effective_length": run.effective_length(threshold), "threshold": threshold,
        "effective_length_definition": EFFECTIVE_LENGTH,
        "prompt_tokens": run.prompt_tokens, "computed_tokens": run.computed_tokens,
        "seconds": {"prompts": round(run.seconds_prompts, 3), "model": round(run.seconds_model, 3)},
        "records": [asdict(r) for r in run.records],
    }


def write_outputs(out: Path, record: dict, run: RulerRun) -> Path:
    """The JSON at `out` and the task x length heatmap at <stem>_heatmap.png; returns the PNG's path."""
    from ..plots import heatmap  # matplotlib: loaded once there is something to plot

    out.parent.mkdir(parents=True, exist_ok=True)
    grid = np.array([[run.score(t, n) for n in run.lengths] for t in run.tasks]
                    + [[run.averages()[n] for n in run.lengths]])
    png = out.with_name(out.stem + "_heatmap.png")
    write_atomic(png, lambda p: heatmap(p, grid, run.tasks + ["average"], [str(n) for n in run.lengths],
                                       "context length (tokens)", "task", "RULER score by task and length",
                                       missing="no samples (the task does not fit)"))
    write_atomic(out, json.dumps(record, indent=2) + "\n")
    return png


@dataclass(kw_only=True)
class RulerSettings(longctx.EvalSettings):
    """What `python -m pose_mlx.ruler` is asked (the flags' names and defaults); `run` checks it."""

    lengths: str | None = None  # the length grammar: 4k,8k,16k or 1x,2x of the original window
    tasks: str = "all"  # "all" or a comma list of task names
    samples: int = DEFAULT_SAMPLES
    seed: int = 0
    depths: str = "spread"
    haystack: str | None = None
    threshold: float = DEFAULT_THRESHOLD
    max_new_tokens: int | None = None
    no_chat: bool = False
    output: str | None = None


def build_parser() -> argparse.ArgumentParser:
    tasks = "\n".join(f"  {t.name:<16} {MIN_TOKENS[t.name]:>4}  {t.summary}" for t in TASKS.values())
    parser = longctx.eval_parser("python -m pose_mlx.ruler", __doc__.split("\n")[0])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (f"tasks (--tasks; default: all of them), with the shortest length each fits, in SmolLM2's "
                     f"tokens\n(the template and needles alone; other tokenizers differ somewhat):\n{tasks}\n\n"
                     f"effective length: {EFFECTIVE_LENGTH}.")
    parser.add_argument("--lengths", help="prompt lengths in the model's tokens, e.g. 4k,8k,16k or 1x,2x of the "
                                           "original window (default: doubling from half the original window to "
                                           "the model's maximum)")
    parser.add_argument("--tasks", help="`all` (default: every task below) or a comma list of task names")
    parser.add_argument("--samples", type=int, help=f"samples per task and length (default {DEFAULT_SAMPLES})")
    parser.add_argument("--seed", type=int, help="seed of the generated content (default 0)")
    parser.add_argument("--depths", choices=DEPTH_MODES,
                        help="needle depths: spread evenly over the samples (default) or seeded uniform")
    parser.add_argument("--haystack",
                        help="folder of .txt/.md/.rst files for the essay haystack (default: the Python language "
                             "reference shipped with CPython, pydoc_data.topics)")
    parser.add_argument("--threshold", type=float,
                        help=f"average score a length needs to count as effective (default {DEFAULT_THRESHOLD}: "
                             "Llama-2-7B at 4k in the RULER paper)")
    parser.add_argument("--max-new-tokens", type=tokens,
                        help="answer budget in tokens for every task (default: 128 needles, 30 vt, 120 cwe, 50 fwe)")
    parser.add_argument("--no-chat", action="store_true",
                        help="plain prompts even when the tokenizer has a chat template")
    parser.add_argument("--output",
                        help="JSON results, and <stem>_heatmap.png next to it (default: "
                             "ruler-<lengths>-<N>samples.json in the model's results folder, see docs/evaluation.md)")
    parser.set_defaults(**longctx.settings_defaults(RulerSettings))
    return parser


def _check_arguments(args) -> None:
    parse_tasks(args.tasks)
    if args.samples < 1:
        raise UserError(f"--samples: {args.samples} must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: {args.max_new_tokens} must be >= 1")
    if args.seed < 0:
        raise UserError(f"--seed: {args.seed} must be >= 0")
    if not 0.0 < args.threshold <= 1.0:
        raise UserError(f"--threshold: {args.threshold} must be in (0, 1]")
    if args.haystack:
        essay_text(args.haystack)  # a bad folder is reported before the model is loaded


def _answer_budget(args) -> int:
    """The longest answer of the run's tasks, in tokens."""
    return args.max_new_tokens or max(TASKS[t].max_new_tokens for t in parse_tasks(args.tasks))


def check_lengths(builder: PromptBuilder, tasks: list[str], lengths: list[int]) -> None:
    """Every task fits every length, else one UserError naming each task with each of its too-short lengths.
    A task is tried from the shortest length up, stopping at the first that fits: what does not fit is the fixed
    part of its prompt (template and needles), which a longer length holds as well."""
    short: dict[str, list[PromptTooShort]] = {}
    for task in tasks:
        for length in sorted(lengths):
            try:
                builder.sample(task, length, 0)
                break
            except PromptTooShort as error:
                short.setdefault(task, []).append(error)
    if short:
        named = [f"{task} at {', '.join(str(e.length) for e in errs)} (its template and needles take "
                 f"{errs[-1].tokens})" for task, errs in short.items()]
        raise UserError(f"--lengths: too short for {len(short)} of {counted(len(tasks), 'task')}: "
                        f"{'; '.join(named)}; use "
                        "longer --lengths or drop these from --tasks")


def _tasks_name(tasks: list[str]) -> str:
    """The tasks' part of a default output name: "" for all of them, their names joined by "+" when short."""
    if tasks == list(TASKS):
        return ""
    joined = "+".join(tasks)
    return joined if len(joined) <= 40 else f"{len(tasks)}tasks"


@command("pose_mlx.ruler")
def main(argv=None) -> int:
    run(RulerSettings(**vars(build_parser().parse_args(argv))))
    return 0


def run(args: RulerSettings) -> RulerRun:
    """The command: check `args` (UserError naming the flag), load the model, refuse lengths a task does not
    fit, answer and score every sample (resuming those an interrupted run logged), print the table, write the
    JSON and heatmap; returns the run."""
    opening = open_evaluation("ruler", args, check=_check_arguments, answer=_answer_budget)
    info, lengths = opening.info, opening.lengths
    tasks = parse_tasks(args.tasks)
    builder = PromptBuilder(info.tokenizer, args.samples, args.seed, args.depths, args.haystack,
                            False if args.no_chat else None)
    check_lengths(builder, tasks, lengths)
    header = {"model": str(info.path), "schedule": info.schedule, "lengths": lengths, "tasks": tasks,
              "samples": args.samples, "seed": args.seed, "depths": args.depths, "haystack": args.haystack,
              "chat": builder.fmt.chat, "max_new_tokens": args.max_new_tokens}
    details = (f"{args.samples}samples", _tasks_name(tasks), f"seed{args.seed}" if args.seed else "")
    out = opening.announce("chat template" if builder.fmt.chat else "plain prompts", details=details, header=header)
    log = RecordLog(out, header, Record)
    with log.resumed("ruler", "sample", args.samples * len(tasks) * len(lengths)) as done, opening.held():
        scored = run_ruler(info.model, info.tokenizer, lengths, tasks, args.samples, args.seed, chunk=args.chunk,
                           max_new_tokens=args.max_new_tokens, show_progress=not args.no_progress, builder=builder,
                           done=done, on_record=log.append, compute=opening.compute())
    print(f"RULER synthetic tasks, {counted(args.samples, 'sample')} per task and length, greedy answers; score = "
          f"fraction of the references found in the output (case-insensitive), mean over samples "
          f"({scored.computed_tokens}/"
          f"{scored.prompt_tokens} prompt tokens computed, the rest reused from the KV cache)")
    print(format_table(scored, args.threshold))
    record = record_json(scored, info, args, args.threshold, builder.fmt.chat)
    record["cost"] = longctx.run_cost(opening.started, taken_up=len(done))
    png = write_outputs(out, record, scored)
    log.remove()
    print(f"wrote {out} and {png}", file=sys.stderr)
    return scored


__all__ = ["DEFAULT_THRESHOLD", "EFFECTIVE_LENGTH", "MIN_TOKENS", "Record", "RulerRun", "RulerSettings",
           "check_lengths", "effective_length", "evaluation_order", "format_table", "main", "match_all", "run",
           "run_ruler"]
