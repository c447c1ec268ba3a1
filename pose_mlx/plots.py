"""Plots of the evaluators (matplotlib, Agg backend: no display needed).

Conventions every figure of the project follows: axes say their units; a log axis carries at least four plainly
written ticks, with a labelled tick at or beyond each end of the data (`plain_log_axis`); a dashed "original
window" line has its value as a tick on the x axis (`mark_tick`); legends sit outside the plotted data; heatmap
cells without data are hatched grey with a legend key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

# Imported inside functions, on purpose: matplotlib, each where it is used: they are costly to import or unneeded on
# the paths that import this module (`--help`, `plan`, the NumPy-only parts).


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: mantissas tried in turn, sparsest first, for the ticks of a log axis.
_LOG_SUBS = ((1.0,), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0), tuple(float(m) for m in range(1, 10)),
             (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0),
             (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0))


def log_ticks(vmin: float, vmax: float, minimum: int = 4) -> list[float]:
    """Tick values for a log axis over [vmin, vmax]: m x 10^k for the sparsest mantissa set in `_LOG_SUBS` that puts
    at least `minimum` ticks in view and leaves no stretch without a tick longer than 45% of the axis (in log
    scale; wide ranges: powers of ten, every n-th decade so that at most 8 remain); ranges narrower than any set
    covers: evenly spaced round values (matplotlib's MaxNLocator, as many bins as it takes)."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = sorted((float(vmin), float(vmax)))
    if not (lo > 0 and math.isfinite(hi)):
        return []
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    span = math.log10(hi / lo)
    for subs in _LOG_SUBS:
        ticks = [t for t in (float(f"{m * 10.0**k:.12g}") for k in decades for m in subs) if lo <= t <= hi]
        ticks = ticks[::max(1, math.ceil(len(ticks) / 8))] if subs == (1.0,) else ticks
        gaps = np.diff(np.log10([lo, *ticks, hi])) if ticks else [span]
        if len(ticks) >= minimum and max(gaps) <= 0.45 * span:
            return ticks
    ticks: list[float] = []
    for bins in range(minimum, 4 * minimum):
        ticks = [float(t) for t in MaxNLocator(nbins=bins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
                 if lo <= t <= hi]
        if len(ticks) >= minimum:
            break
    return ticks


def log_limits(vmin: float, vmax: float, minimum: int = 4) -> tuple[float, float]:
    """[vmin, vmax] widened to the nearest `log_ticks` just outside it, so that a log axis can start and end on a
    labelled tick and no end of the data lies beyond the last label (the demo's perplexities, 10.4-22.3, had
    labels only at 12-20). The range is widened by one tick spacing at each end without a tick beyond it until
    the ticks enclose [vmin, vmax] (a few times at most; unchanged if they never do); the limits are the nearest
    enclosing ticks."""
    lo, hi = sorted((float(vmin), float(vmax)))
    if not (lo > 0 and math.isfinite(hi) and hi > lo):
        return vmin, vmax
    wide_lo, wide_hi = lo, hi
    for _ in range(6):
        ticks = log_ticks(wide_lo, wide_hi, minimum)
        below, above = [t for t in ticks if t <= lo], [t for t in ticks if t >= hi]
        if below and above:
            return below[-1], above[0]
        if len(ticks) < 2:
            break
        wide_lo *= 1.0 if below else ticks[0] / ticks[1]
        wide_hi *= 1.0 if above else ticks[-1] / ticks[-2]
    return lo, hi


def plain_log_axis(axis, minimum: int = 4) -> None:
    """Major ticks of a log-scaled matplotlib `axis` (ax.xaxis / ax.yaxis) from `log_ticks` over the view at draw
    time, labelled as plain numbers (7, 10, 20, 0.5, 1e-06); unlabelled minor ticks at every m x 10^k. An
    autoscaled view is widened to `log_limits`, and both of its ends are labelled."""
    from matplotlib.ticker import FuncFormatter, Locator, LogLocator, NullFormatter

    class _Plain(Locator):
        limits = None  # the last view `view_limits` chose

        def __call__(self):
            return self.tick_values(*self.axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            ticks = log_ticks(vmin, vmax, minimum)
            if self.limits and np.allclose(sorted((vmin, vmax)), self.limits, rtol=1e-9, atol=0):
                ticks = sorted(set(ticks) | set(self.limits))
            return ticks

        def view_limits(self, vmin, vmax):  # called by autoscaling, after the margins
            self.limits = log_limits(vmin, vmax, minimum)
            return self.limits

    axis.set_major_locator(_Plain())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_locator(LogLocator(subs="all"))
    axis.set_minor_formatter(NullFormatter())
    # autoscale again with this locator (set_yscale already did, with the default one); explicit limits stay
    axis.axes.autoscale(enable=None, axis="x" if axis is axis.axes.xaxis else "y")


def trials_note(counts: Sequence[int], per: str = "length") -> str:
    """How many trials each point of an accuracy plot averages, for its title: 'n = 30 trials per length', or
    'n = 10-30 trials per length' when the points differ."""
    low, high = min(counts), max(counts)
    return f"n = {low}{'' if low == high else f'-{high}'} trial{'' if high == 1 else 's'} per {per}"


def mark_tick(ax, mark: float, color: str = "gray") -> None:
    """`mark` (the x of a vertical line) written on the x axis as a tick of its own, in `color`; ticks so close
    that their labels would collide (within 6% of the axis) give way. Call after the limits are final."""
    ax.figure.canvas.draw()  # the locator's ticks for the final limits
    lo, hi = ax.get_xlim()
    to_axes = ax.transAxes.inverted().transform

    def frac(x):
        return to_axes(ax.transData.transform((x, 0)))[0]

    ticks = [t for t in ax.get_xticks() if min(lo, hi) <= t <= max(lo, hi) and abs(frac(t) - frac(mark)) >= 0.06]
    ticks = sorted(ticks + [mark])
    labels = [label.get_text() for label in ax.get_xticklabels()]
    by_value = dict(zip(ax.get_xticks(), labels))
    ax.set_xticks(ticks, [by_value.get(t) or f"{t:g}" for t in ticks])
    ax.set_xlim(lo, hi)
    for tick, label in zip(ticks, ax.get_xticklabels()):
        if tick == mark:
            label.set_color(color)


def line_vs_length(
    path: str | Path,
    lengths: Sequence[int],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
    log_y: bool = False,
    ylim: tuple[float, float] | None = None,
    mark: int | None = None,
    xlabel: str = "context length (tokens)",
) -> Path:
    """One line per entry of `series` (label -> values at `lengths`), log2 x axis; saved as PNG.

    `mark`: a dashed vertical line there, labelled "original window" and written on the x axis. `log_y`: log y
    axis with plain tick labels (`plain_log_axis`). The legend sits right of the axes, never over the data.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    draw_lines(ax, lengths, series, log_y=log_y, ylim=ylim, mark=mark)
    return _finish(plt, fig, ax, path, xlabel, ylabel, title, mark)


def draw_lines(ax, lengths: Sequence[int], series: dict[str, Sequence[float]], log_y: bool = False,
               ylim: tuple[float, float] | None = None, mark: int | None = None) -> None:
    """`line_vs_length`'s drawing on an existing axes `ax` (a panel of a larger figure), without labels."""
    for label, values in series.items():
        ax.plot(lengths, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    ax.minorticks_off()
    if mark:
        ax.axvline(mark, color="gray", linestyle="--", linewidth=1, label="original window")
    if log_y:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    if ylim:
        ax.set_ylim(*ylim)


def panels(
    path: str | Path,
    lengths: Sequence[int],
    content: Sequence[tuple[dict[str, Sequence[float]], str, bool, tuple[float, float] | None]],
    title: str,
    mark: int | None = None,
    xlabel: str = "context length (tokens)",
) -> Path:
    """Side-by-side panels sharing the x axis's meaning, one per (series, ylabel, log_y, ylim) of `content`, each
    drawn as `line_vs_length` draws; one legend for all below the panels (a series keeps its colour in every
    panel where it appears: colours follow the union of labels). Saved as PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(content), figsize=(5.5 * len(content), 4.2), squeeze=False)
    names = list(dict.fromkeys(label for series, *_ in content for label in series))
    for ax, (series, ylabel, log_y, ylim) in zip(axes[0], content):
        for label, values in series.items():
            ax.plot(lengths, values, marker="o", label=label, color=f"C{names.index(label) % 10}")
        draw_lines(ax, lengths, {}, log_y=log_y, ylim=ylim, mark=mark)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    for ax in axes[0]:
        if mark:
            mark_tick(ax, mark)
    fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(4, len(handles)), fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _finish(plt, fig, ax, path, xlabel: str, ylabel: str, title: str, mark: float | None = None) -> Path:
    """Labels, grid, the mark's tick, the legend right of the axes (never over the data); saved as PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    if mark:
        mark_tick(ax, mark)
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
    return _finish(plt, fig, ax, path, xlabel, ylabel, title, mark)


def heatmap(
    path: str | Path, grid: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str],
    xlabel: str, ylabel: str, title: str, missing: str = "no trials", *, text: Sequence[Sequence[str]] | None = None,
    norm=None, cmap: str = "RdYlGn", colorbar: dict | None = None,
) -> Path:
    """`grid` (rows x cols, NaN = no data) as a heatmap with cell values; NaN cells are hatched grey, with a legend
    key `missing` below the axes (the colormap's middle, 0.5, is a pale yellow close to white: grey alone would be
    ambiguous). By default the values are in [0, 1] on a red-to-green scale and each cell shows its value; `norm`
    (a matplotlib Normalize, e.g. LogNorm) and `cmap` choose another scale, `text` each cell's words, `colorbar`
    the keywords of its colour bar (label, ticks, format; given ticks replace the minor ones too).

    At least 5 inches wide (the title fits however few lengths there are); saved with a tight bounding box.
    """
    from matplotlib.colors import Normalize
    from matplotlib.patches import Patch, Rectangle

    plt = _pyplot()
    grid = np.asarray(grid, dtype=float)
    norm = norm if norm is not None else Normalize(0.0, 1.0)
    tall = 0.45 if text is None else 0.3 * (1 + max(str(t).count("\n") for row in text for t in row))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.8 * len(col_labels)), 1.2 + tall * len(row_labels)))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(col_labels)), col_labels)
    ax.set_yticks(range(len(row_labels)), row_labels)
    empty = dict(facecolor="0.8", edgecolor="0.55", hatch="///", linewidth=0)
    for (i, j), value in np.ndenumerate(grid):
        if np.isfinite(value):  # white on the dark ends of the colormap
            shade = float(norm(value))
            ax.text(j, i, f"{value:.2f}" if text is None else text[i][j], ha="center", va="center", fontsize=7,
                    color="white" if shade < 0.2 or shade > 0.85 else "black")
        else:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, **empty))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    bar = fig.colorbar(image, ax=ax, **(colorbar or {}))
    if "ticks" in (colorbar or {}):
        bar.ax.minorticks_off()
    fig.tight_layout()
    if not np.isfinite(grid).all():  # the key, below everything the axes draws (its tick labels and x label)
        fig.canvas.draw()
        below = ax.get_tightbbox().transformed(fig.transFigure.inverted())
        fig.legend(handles=[Patch(label=missing, **empty)], loc="upper left", fontsize="small",
                   bbox_to_anchor=(ax.get_position().x0, below.y0), bbox_transform=fig.transFigure)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
