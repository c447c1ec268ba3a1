"""Plots of the evaluators (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_vs_length(
    path: str | Path,
    lengths: Sequence[int],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    log_y: bool = False,
    ylim: tuple[float, float] | None = None,
    mark: int | None = None,
) -> Path:
    """One line per entry of `series` (label -> values at `lengths`), log2 x axis; saved as PNG.

    `mark`: draw a dashed vertical line there, labelled "original window". The legend sits right of the axes,
    never over the data.
    """
    from matplotlib.ticker import FuncFormatter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, values in series.items():
        ax.plot(lengths, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    if mark:
        ax.axvline(mark, color="gray", linestyle="--", linewidth=1, label="original window")
    if log_y:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    if ylim:
        ax.set_ylim(*ylim)
    return _finish(plt, fig, ax, path, "context length (tokens)", ylabel, title)


def _finish(plt, fig, ax, path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, grid, the legend right of the axes (never over the data); saved as PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def curves(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    mark: int | None = None,
) -> Path:
    """One line per entry of `series` (label -> (x, y)) on linear axes, saved as PNG; `mark` and the legend as in
    `line_vs_length`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label)
    if mark:
        ax.axvline(mark, color="gray", linestyle="--", linewidth=1, label="original window")
    return _finish(plt, fig, ax, path, xlabel, ylabel, title)


def heatmap(
    path: str | Path, grid: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str],
    xlabel: str, ylabel: str, title: str,
) -> Path:
    """`grid` (rows x cols, values in [0, 1], NaN = no trial) as a red-to-green heatmap with cell values;
    cells without trials are grey (the colormap's middle, 0.5, is a pale yellow close to white).

    At least 5 inches wide (the title fits however few lengths there are); saved with a tight bounding box.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.8 * len(col_labels)), 1.2 + 0.45 * len(row_labels)))
    ax.set_facecolor("0.8")  # shows through masked (NaN) cells
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(col_labels)), col_labels)
    ax.set_yticks(range(len(row_labels)), row_labels)
    for (i, j), value in np.ndenumerate(grid):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
