"""Helpers shared by the benchmarks: run metadata, writing a results JSON, a synthetic corpus. Imports no MLX."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata as _metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _version(package: str) -> str | None:
    try:
        return _metadata.version(package)
    except _metadata.PackageNotFoundError:
        return None


def run_metadata() -> dict:
    """When and where a benchmark ran: UTC date, package versions, Python, OS, CPU architecture and count,
    and the 1-minute load average at the end (other processes on the machine slow a benchmark down)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mlx_version": _version("mlx"),
        "mlx_lm_version": _version("mlx-lm"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def write_results(name: str, results: dict, path: str | Path | None = None) -> Path:
    """Write `results` plus `run_metadata()` (results win on clashes) as indented JSON.

    The default path is ``benchmarks/results/<name>.json``. Returns the path written.
    """
    path = Path(path) if path is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, **run_metadata(), **results}, indent=2) + "\n")
    return path


def sim_pretrained(sim: str | Path, prog: str) -> Path:
    """<sim>/pretrained, the simulator's base model; exits 2 with one line when the simulator has not made it."""
    model = Path(sim) / "pretrained"
    if not (model / "pretrain.json").is_file():
        print(f"{prog}: error: {model} has no pretrained model; run python -m pose_mlx.sim first", file=sys.stderr)
        sys.exit(2)
    return model


def synthetic_corpus(vocab: int, docs: int, length: int, seed: int = 0):
    """A `pose_mlx.training.data.TokenizedCorpus` of `docs` documents of `length` random token ids in [3, vocab)
    (the content does not change the cost of a training step)."""
    import numpy as np

    from pose_mlx.training.data import TokenizedCorpus

    tokens = np.random.default_rng(seed).integers(3, vocab, size=docs * length).astype(np.int32)
    offsets = np.arange(docs + 1, dtype=np.int64) * length
    return TokenizedCorpus(tokens, offsets, np.arange(docs), f"synthetic-{docs}x{length}", {})
