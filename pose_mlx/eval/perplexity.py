"""Sliding-window perplexity at several context lengths: `python -m pose_mlx.perplexity`.

Windows (following the Position Interpolation and PoSE evaluations): a window of length W is
BOS followed by W-1 document tokens; windows start every `stride` tokens (at most W-1, so no token is
skipped); a window scores only the tokens that no earlier window scored, so every document token is scored
exactly once, with at most W-1 tokens of context. The last window is moved back to end at the document's end
(full context). The reported number is token-weighted: PPL = exp(sum of NLLs / number of scored tokens) over
all documents, not a mean of per-document perplexities.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Iterable

import numpy as np

from . import longctx
from ..errors import UserError, command
from ..lengths import tokens
from ..words import counted
from ..training.data import chat_renderer, read_documents  # a text file, a .jsonl file, a folder of them, or a hub dataset
from .cost import Compute, WorkBar
from .opening import open_evaluation

METRIC = "token-weighted perplexity: exp(total NLL / scored tokens), sliding windows of BOS + (W-1) tokens"


@dataclass(frozen=True)
class Window:
    """Document tokens [start, stop) are the window's input after BOS; [score_from, stop) are scored."""

    start: int
    stop: int
    score_from: int


def window_plan(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Sliding windows over a document of `n_tokens` tokens for window length `window` (BOS included).

    Every token 0..n-1 lies in exactly one [score_from, stop); each window holds at most window-1 tokens.
    """
    if window < 2:
        raise ValueError(f"window={window} must be >= 2 (BOS + at least one token)")
    if stride < 1:
        raise ValueError(f"stride={stride} must be >= 1")
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens} must be >= 1")
    span, step = window - 1, min(stride, window - 1)
    plan, start, scored = [], 0, 0
    while scored < n_tokens:
        stop = min(start + span, n_tokens)
        if stop - start < span:
            start = max(0, n_tokens - span)  # last window: end at the document's end, full context
        plan.append(Window(start, stop, scored))
        scored = stop
        start += step
    return plan


def document_nll(model, tokens: Iterable[int], window: int, stride: int, bos: int,
                 chunk: int = longctx.DEFAULT_CHUNK, progress=None) -> tuple[float, int]:
    """(sum of NLLs, number of scored tokens) of one document under `window_plan`; `progress(fed, n)` is told
    after each chunk of a window of n tokens how many are in, n after the last (`longctx.prefill`'s)."""
    tokens = np.asarray(list(tokens), dtype=np.int32)
    total, count = 0.0, 0
    for w in window_plan(tokens.size, window, stride):
        ids = np.concatenate([[bos], tokens[w.start : w.stop]]).astype(np.int32)
        nll = longctx.chunked_nll(model, ids, chunk, progress)  # nll[j] scores tokens[w.start + j]
        scored = nll[w.score_from - w.start :]
        total += float(scored.sum())
        count += scored.size
    return total, count


@dataclass
class LengthResult:
    length: int
    ppl: float
    tokens: int


def perplexity(model, documents: list[list[int]], lengths: list[int], stride: int, bos: int,
               chunk: int = longctx.DEFAULT_CHUNK, show_progress: bool = True,
               compute: Compute | None = None) -> list[LengthResult]:
    """Token-weighted perplexity of the tokenized `documents` at each window length. Says on stderr what will
    run; the progress bar's ETA follows each window's predicted work (`compute`, the model's shapes; default: its
    tokens), within a window too (chunk by chunk)."""
    windows = [w.stop - w.start + 1 for length in lengths for doc in documents
               for w in window_plan(len(doc), length, stride)]
    compute = compute or Compute.tokens_only()
    works = [compute.prefill(n, 0, n) for n in windows]
    print(f"perplexity: {counted(len(windows), 'window')} of {counted(len(documents), 'document')} at "
          f"{', '.join(map(str, lengths))} "
          f"tokens: {sum(windows):,} tokens", file=sys.stderr)
    results = []
    with WorkBar("perplexity", works, "window", show_progress) as bar:
        for length in lengths:
            total, count = 0.0, 0
            for doc in documents:
                t, c = document_nll(model, doc, length, stride, bos, chunk, partial(_window_fed, bar, compute, length))
                total, count = total + t, count + c
            results.append(LengthResult(length, math.exp(total / count), count))
    return results


def _window_fed(bar: WorkBar, compute: Compute, length: int, fed: int, n: int) -> None:
    """A chunk of the window in progress (the bar's next item) is in: the bar moves by its share of the window's
    work, or to the window's end after its last chunk."""
    if fed < n:
        bar.reading(bar.finished, compute, n, f"{length} tokens", all_logits=True)(fed, n)
    else:
        bar.done(bar.finished, f"{length} tokens")


# ------------------------------------------------------------------------------------------------ data


def load_documents(source, tokenizer, min_tokens: int, max_docs: int, truncate: int | None) -> list[list[int]]:
    """The first `max_docs` documents with >= `min_tokens` tokens, each cut to `truncate` tokens if given."""
    kept, longest = [], 0
    for text in read_documents(source, render=chat_renderer(tokenizer)):
        ids = longctx.encode(tokenizer, text)
        longest = max(longest, len(ids))
        if len(ids) >= min_tokens:
            kept.append(ids[:truncate] if truncate else ids)
            if len(kept) >= max_docs:
                break
    if not kept:
        raise UserError(f"--data: no document has at least {min_tokens} tokens (the longest has {longest}); "
                        "lower --min-doc-tokens or the --lengths")
    return kept


# ------------------------------------------------------------------------------------------------- CLI


def format_table(name: str, results: list[LengthResult]) -> str:
    """A Markdown table shaped like the PoSE paper's Table 1 (one row per model, one column per length)."""
    head = "| model | " + " | ".join(str(r.length) for r in results) + " |"
    rule = "|---|" + "---|" * len(results)
    row = f"| {name} | " + " | ".join(f"{r.ppl:.2f}" for r in results) + " |"
    count = "| scored tokens | " + " | ".join(str(r.tokens) for r in results) + " |"
    return "\n".join([head, rule, row, count])


@dataclass(kw_only=True)
class PerplexitySettings(longctx.EvalSettings):
    """What `python -m pose_mlx.perplexity` is asked (the flags' names and defaults); `run` checks it."""

    data: str
    lengths: str | None = None  # the length grammar: 2k,4k,8192 or 1x,2x of the original window
    stride: int = 1024
    docs: int = 50
    min_doc_tokens: int | None = None
    truncate: int | None = None
    no_truncate: bool = False
    output: str | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = longctx.eval_parser("python -m pose_mlx.perplexity", __doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a text file, a .jsonl file (field 'text'), or a folder of .txt/.md/.py/.jsonl files")
    parser.add_argument("--lengths", help="window lengths, e.g. 2k,4k,8192 or 1x,2x,4x of the original window "
                                           "(default: doubling from half the original window to the model's maximum)")
    parser.add_argument("--stride", type=tokens, help="tokens between window starts, capped at W-1 (default 1024)")
    parser.add_argument("--docs", type=int, help="number of documents to evaluate (default 50)")
    parser.add_argument("--min-doc-tokens", type=tokens,
                        help="skip shorter documents (default: the longest length - 1)")
    parser.add_argument("--truncate", type=tokens,
                        help="score the first TRUNCATE tokens of each document (at least the longest length - 1; "
                             "default: the longest length - 1, so every length scores the same tokens; give the "
                             "same value to separate runs of different lengths to score the same tokens)")
    parser.add_argument("--no-truncate", action="store_true", help="score whole documents")
    parser.add_argument("--output", help="write JSON results here (and a PNG next to it; default: "
                                          "perplexity-<lengths>-<data>.json in the model's results folder, see "
                                          "docs/evaluation.md)")
    parser.set_defaults(**longctx.settings_defaults(PerplexitySettings))
    return parser


def _check_flags(args) -> None:
    if args.stride < 1 or args.docs < 1:
        raise UserError("--stride and --docs must be >= 1")
    if args.min_doc_tokens is not None and args.min_doc_tokens < 1:
        raise UserError(f"--min-doc-tokens must be >= 1, got {args.min_doc_tokens}")
    if args.truncate is not None and args.no_truncate:
        raise UserError("--truncate and --no-truncate exclude each other")


@command("pose_mlx.perplexity")
def main(argv=None) -> int:
    run(PerplexitySettings(**vars(build_parser().parse_args(argv))))
    return 0


def run(args: PerplexitySettings) -> list[LengthResult]:
    """The command: check `args` (UserError naming the flag), load the model, score every length, print the
    table, write the JSON and PNG; returns the results by length."""
    opening = open_evaluation("perplexity", args, check=_check_flags)
    info, lengths = opening.info, opening.lengths
    min_tokens = args.min_doc_tokens if args.min_doc_tokens is not None else max(lengths) - 1
    truncate = None if args.no_truncate else max(lengths) - 1 if args.truncate is None else args.truncate
    if truncate is not None and truncate < max(lengths) - 1:
        raise UserError(f"--truncate {truncate} is shorter than a window of {max(lengths)} tokens needs "
                        f"({max(lengths) - 1} after BOS)")
    docs = load_documents(args.data, info.tokenizer, min_tokens, args.docs, truncate)
    if len(docs) < args.docs:
        print(f"note: {counted(len(docs), 'document')} of --data {'has' if len(docs) == 1 else 'have'} at least "
              f"{min_tokens} tokens, fewer than the --docs "
              f"{args.docs} asked for; scoring those", file=sys.stderr)
    bos = longctx.bos_id(info.tokenizer)
    out = opening.announce(details=(Path(str(args.data).rstrip("/")).stem,))
    with opening.held():
        results = perplexity(info.model, docs, lengths, args.stride, bos, args.chunk, not args.no_progress,
                             opening.compute())
    print(f"{METRIC}; stride {args.stride}; {counted(len(docs), 'document')}")
    print(format_table(info.label, results))
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": info.path, "schedule": info.schedule, "metric": METRIC, "stride": args.stride,
              "documents": len(docs), "truncate": truncate, "results": [asdict(r) for r in results],
              "cost": longctx.run_cost(opening.started)}
    out.write_text(json.dumps(record, indent=2) + "\n")
    from ..plots import line_vs_length  # matplotlib: loaded once there is something to plot

    png = line_vs_length(out.with_suffix(".png"), lengths, {info.label: [r.ppl for r in results]},
                         "perplexity (log scale)", "Sliding-window perplexity (token-weighted)", log_y=True,
                         mark=info.original)
    print(f"wrote {out} and {png}", file=sys.stderr)
    return results
