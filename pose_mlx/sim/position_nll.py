"""Per-position NLL curves: how well a model predicts the token at position p from the p tokens before it.

Each test document is cut into non-overlapping windows of BOS + (L - 1) tokens; in a window, the token at
position p (p = 1 .. L - 1, BOS at 0) is scored with -log p(token | BOS and the p - 1 tokens before it). The curve
is the mean over windows, in bins of `bin_width` positions. Context that helps makes it fall; a model whose
context stops helping beyond Lc flattens there, one that breaks rises: the sliding-window perplexity table
summarises it in one number per length, this shows where in the window the change happens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..eval.longctx import bos_id, chunked_nll, load_eval_model


def window_nll(model, docs: list[np.ndarray], length: int, bos: int) -> np.ndarray:
    """(windows, length - 1) NLLs: row w, column p - 1 scores position p of the w-th window (documents in order,
    each cut into floor(n / (length - 1)) windows of length - 1 tokens after BOS)."""
    rows = []
    for doc in docs:
        doc = np.asarray(doc)
        for start in range(0, doc.size - (length - 1) + 1, length - 1):
            rows.append(chunked_nll(model, np.concatenate([[bos], doc[start : start + length - 1]])))
    if not rows:
        raise ValueError(f"no document has {length - 1} tokens")
    return np.stack(rows)


def binned(nll: np.ndarray, bin_width: int) -> dict:
    """{"positions": first position of each bin, "nll": mean NLL over windows and the bin's positions,
    "windows"}: bins [1, 1 + w), [1 + w, 1 + 2w), ...; the last one may be shorter."""
    if bin_width < 1:
        raise ValueError(f"bin_width must be >= 1, got {bin_width}")
    width = nll.shape[1]
    starts = list(range(0, width, bin_width))
    return {"positions": [s + 1 for s in starts], "nll": [float(nll[:, s : s + bin_width].mean()) for s in starts],
            "windows": int(nll.shape[0])}


def measure(model_dir: Path, docs: list[np.ndarray], length: int, bin_width: int, output: Path,
            schedule: str | None = None, target: str | None = None) -> dict:
    """The binned curve of the run in `model_dir` (loaded with its saved schedule, or extended at load with
    `schedule` / `target` as the evaluators' --schedule / --target do) at window `length`, written to `output` as
    JSON and returned. `docs`: tokenized test documents, BOS left out."""
    info = load_eval_model(str(model_dir), schedule, target)
    record = {"length": length, "bin_width": bin_width,
              **binned(window_nll(info.model, docs, length, bos_id(info.tokenizer)), bin_width)}
    Path(output).write_text(json.dumps(record) + "\n")
    return record


__all__ = ["binned", "measure", "window_nll"]
