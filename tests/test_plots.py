"""pose_mlx.plots: legends never over the data, the original window's tick, plain log-axis ticks, the heatmap's
key for cells without data."""

import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from pose_mlx.plots import curves, heatmap, line_vs_length, log_limits, log_ticks, trials_note  # noqa: E402


@pytest.fixture
def saved(monkeypatch):
    """The figures the plot functions save, drawn (so that extents and tick labels are final)."""
    figures = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    yield figures


def _data_extent(ax):
    """The display-space bounding box of every plotted point (lines' vertices)."""
    points = np.concatenate([ax.transData.transform(line.get_xydata()) for line in ax.get_lines()
                             if line.get_label() != "original window"])
    return points.min(axis=0), points.max(axis=0)


@pytest.mark.parametrize("kind", ["line_vs_length", "curves"])
def test_line_plot_legend_does_not_cover_the_data(tmp_path, saved, kind):
    lengths = [128, 256, 512, 1024]
    # nine lines fanning out over the whole axes, the top-right corner (a default legend's place) included
    series = {f"run {i}": [10.0 + i * (j + 1) for j in range(4)] for i in range(9)}
    if kind == "curves":
        path = curves(tmp_path / "p.png", {k: (lengths, v) for k, v in series.items()}, "position (tokens)", "NLL",
                      "title", mark=128)
    else:
        path = line_vs_length(tmp_path / "p.png", lengths, series, "perplexity", "title", log_y=True, mark=128)
    assert path.stat().st_size > 1000
    fig = saved[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    (x0, y0), (x1, y1) = _data_extent(ax)
    assert x1 > x0 and y1 > y0  # the case collides: the data spans the axes
    assert legend.x0 > x1 or legend.x1 < x0 or legend.y0 > y1 or legend.y1 < y0
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == list(series) + ["original window"]


@pytest.mark.parametrize("kind, mark, lengths", [("line_vs_length", 128, [256, 512, 1024]),
                                                 ("line_vs_length", 2048, [1024, 2048, 4096]),
                                                 ("curves", 128, None), ("curves", 300, None)])
def test_original_window_line_has_its_value_as_a_tick(tmp_path, saved, kind, mark, lengths):
    if kind == "curves":
        x = np.arange(1024)
        curves(tmp_path / "c.png", {"a": (x, np.log1p(x))}, "position (tokens)", "NLL (nats)", "t", mark=mark)
    else:
        line_vs_length(tmp_path / "l.png", lengths, {"a": [1.0, 0.5, 0.0]}, "accuracy", "t", mark=mark)
    fig = saved[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    line = next(line for line in ax.get_lines() if line.get_label() == "original window")
    assert list(line.get_xdata()) == [mark, mark]
    ticks = dict(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels())))
    assert ticks.get(mark) == str(mark)
    # labels do not collide: consecutive tick labels' extents are disjoint
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))


@pytest.mark.parametrize("values", [[6.9, 9.9, 25.0, 40.0], [8.3, 8.5, 8.7, 9.3], [0.09, 0.5, 3.0, 12.0],
                                    [150.0, 450.0, 1100.0, 2900.0], [1e-9, 1e-5, 0.01, 1.0]])
def test_log_axis_has_at_least_four_plain_tick_labels(tmp_path, saved, values):
    line_vs_length(tmp_path / "l.png", [128, 256, 512, 1024], {"a": values}, "perplexity (log scale)", "t",
                   log_y=True, mark=128)
    fig = saved[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    shown = [(v, t.get_text()) for v, t in zip(ax.get_yticks(), ax.get_yticklabels()) if low <= v <= high]
    assert len(shown) >= 4, shown
    for value, text in shown:  # a plain number that reads back as the tick's value (no 10^k mathtext)
        assert "$" not in text and math.isclose(float(text), value, rel_tol=1e-3), (value, text)
    assert all(t.get_text() == "" for t in ax.yaxis.get_minorticklabels())


def test_log_ticks_are_round_and_in_range():
    for lo, hi in [(6.6, 17.5), (6.9, 35.0), (8.0, 9.3), (1e-12, 1.0), (0.09, 10.0), (150.0, 3000.0), (7.0, 10.5)]:
        ticks = log_ticks(lo, hi)
        assert len(ticks) >= 4 and all(lo <= t <= hi for t in ticks) and ticks == sorted(ticks)
        assert len(ticks) <= 12
        # no long stretch of the axis without a label (the sim's ppl_main.png once had 7-10 of 6.6-17.5 labelled)
        assert np.diff(np.log10([lo, *ticks, hi])).max() <= 0.45 * np.log10(hi / lo)
    assert log_ticks(6.6, 17.5) == [7.0, 8.0, 9.0, 10.0, 12.0, 15.0]
    assert log_ticks(10.2, 23.5) == [12.0, 14.0, 16.0, 18.0, 20.0]  # the demo's perplexities
    assert log_ticks(6.9, 35.0) == [7.0, 8.0, 9.0, 10.0, 20.0, 30.0]  # 1..9 x 10^k: the sparsest set with 4
    assert log_ticks(150.0, 3000.0) == [200.0, 500.0, 1000.0, 2000.0]  # 1, 2, 5 x 10^k


def _heatmap_figure(tmp_path, saved, grid, **kwargs):
    heatmap(tmp_path / "h.png", grid, ["0%-50%", "50%-100%"], ["128", "256"], "context length (tokens)",
            "needle depth", "t", **kwargs)
    fig = saved[-1]
    fig.canvas.draw()
    return fig


def test_heatmap_key_for_cells_without_trials(tmp_path, saved):
    fig = _heatmap_figure(tmp_path, saved, np.array([[1.0, np.nan], [0.5, 0.0]]))
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["no trials"]
    (handle,) = legend.legend_handles
    ax = fig.axes[0]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_xy() == (0.5, -0.5)  # exactly the empty cell: column 1, row 0
    assert handle.get_hatch() == hatched[0].get_hatch()
    # below the axes and all its labels, so it covers no cell
    assert legend.get_window_extent().y1 <= ax.get_tightbbox().y0 + 1

    other = _heatmap_figure(tmp_path, saved, np.array([[1.0, np.nan], [0.5, 0.0]]), missing="does not fit")
    assert [t.get_text() for t in other.legends[0].get_texts()] == ["does not fit"]


def test_heatmap_without_empty_cells_has_no_key(tmp_path, saved):
    fig = _heatmap_figure(tmp_path, saved, np.array([[1.0, 0.2], [0.5, 0.0]]))
    assert not fig.legends and not [p for p in fig.axes[0].patches if p.get_hatch()]


def test_heatmap_text_norm_and_colour_bar(tmp_path, saved):
    from matplotlib.colors import LogNorm

    # the factor map's perplexity figure: colour = ratio to the column's best on a log scale, words of our own
    ratio = np.array([[1.0, 1.5], [2.0, np.nan]])
    text = [["8.0\nx1.00", "12.0\nx1.50"], ["16.0\nx2.00", ""]]
    fig = _heatmap_figure(tmp_path, saved, ratio, text=text, norm=LogNorm(1.0, 2.0), cmap="RdYlGn_r",
                          colorbar={"label": "ratio", "ticks": [1.0, 1.5, 2.0], "format": "x{x:g}"})
    ax, bar = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == sorted(t for row in text for t in row if t)
    image = ax.get_images()[0]
    colours = image.to_rgba(np.array([1.0, np.sqrt(2.0), 2.0]))
    assert colours[0][1] > colours[0][0] and colours[2][0] > colours[2][1]  # best green, worst red (reversed)
    assert image.norm(np.sqrt(2.0)) == pytest.approx(0.5)  # the middle of the log scale
    assert [t.get_text() for t in bar.get_yticklabels()] == ["x1", "x1.5", "x2"]  # no minor labels between
    assert bar.get_ylabel() == "ratio"


def _benchmark(name, package="benchmarks"):
    import importlib

    from benchmarks.common import RESULTS_DIR

    return importlib.import_module(f"{package}.{name}"), RESULTS_DIR


def test_finetune_cost_legend_is_below_both_panels(tmp_path, saved):
    import json

    bench, results = _benchmark("bench_finetune_cost")
    record = json.loads((results / "finetune_cost.json").read_text())
    bench.plot(record["records"], tmp_path / "f.png", record["config"]["window"])
    fig = saved[0]
    fig.canvas.draw()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["PoSE (Lc = 128 tokens)", "Full-length (Lt tokens)",
                                                          "Full-length: its attention alone"]
    for ax in fig.axes:  # below every panel and its labels, so over no line (the dashed one included)
        assert legend.get_window_extent().y1 <= ax.get_tightbbox().y0 + 1
        assert ax.get_yscale() == "log" and len([t for t in ax.get_yticklabels() if t.get_text()]) >= 4


def test_real_model_runs_are_named_by_what_they_are():
    bench, _ = _benchmark("bench_real_model", "experiments")
    assert bench.run_label("none") == "original (no scaling)"
    assert bench.run_label("yarn") == "YaRN, no training"
    assert bench.run_label("pose-yarn (lr3e-5)") == "PoSE + YaRN (lr3e-5)"


def test_simulator_report_plots_from_its_committed_results(tmp_path, saved):
    import json
    from pathlib import Path

    from pose_mlx.sim.report import plots

    results = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/sim/results.json").read_text())
    pngs = plots(results, tmp_path)
    figures = dict(zip((p.name for p in pngs), saved))
    for fig in figures.values():
        fig.canvas.draw()
    ppl = figures["ppl_main.png"].axes[0]
    low, high = ppl.get_ylim()
    labelled = [v for v, t in zip(ppl.get_yticks(), ppl.get_yticklabels()) if t.get_text() and low <= v <= high]
    assert len(labelled) >= 4 and labelled[-1] >= 12  # the upper half of the axis is labelled too
    window = results["config"]["window"]
    for name in ("ppl_main.png", "passkey.png", "nll_by_position.png"):
        ax = figures[name].axes[0]
        assert dict(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels())))[window] == str(window)
    cost = figures["cost_seconds.png"].axes[0]
    assert cost.get_xlabel() == "target length Lt (tokens)" and "(s)" in cost.get_ylabel()
    assert [t.get_text() for t in cost.get_legend().get_texts()] == ["PoSE (Lc-token sequences)",
                                                                    "full-length (Lt-token sequences)"]


@pytest.mark.parametrize("values", [[11.56, 10.44, 10.65, 22.27], [6.9, 9.9, 25.0, 40.0], [8.3, 8.5, 8.7, 9.3],
                                    [61078.0, 80000.0, 136302.0, 70000.0], [1e-9, 1e-5, 0.01, 1.0]])
def test_log_axis_labels_enclose_the_data(tmp_path, saved, values):
    """The lowest point and the highest have a labelled tick at or beyond them: the demo's comparison.png once
    labelled only 12-20 of perplexities 10.4-22.3 (a log axis without a label below its lowest line)."""
    from pose_mlx.plots import panels

    panels(tmp_path / "p.png", [128, 256, 512, 1024], [({"a": values}, "perplexity (log scale)", True, None),
                                                       ({"a": [0.5] * 4}, "accuracy", False, (-0.05, 1.05))],
           "t", mark=128)
    fig = saved[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    labelled = sorted(v for v, t in zip(ax.get_yticks(), ax.get_yticklabels()) if t.get_text() and low <= v <= high)
    assert labelled[0] <= min(values) and labelled[-1] >= max(values), labelled
    assert len(labelled) >= 4
    for value, text in ((v, t.get_text()) for v, t in zip(ax.get_yticks(), ax.get_yticklabels()) if t.get_text()):
        assert "$" not in text and math.isclose(float(text), value, rel_tol=1e-3)
    boxes = sorted((t.get_window_extent() for t in ax.get_yticklabels() if t.get_text()), key=lambda b: b.y0)
    assert all(a.y1 <= b.y0 for a, b in zip(boxes, boxes[1:]))  # no two labels overlap


def test_log_limits_widen_to_the_nearest_enclosing_ticks():
    assert log_limits(10.05, 23.1) == (10.0, 25.0)  # the demo's perplexities with matplotlib's margins
    assert log_limits(6.6, 17.5) == (6.0, 20.0)
    assert log_limits(10.0, 20.0) == (10.0, 20.0)  # already on ticks
    assert log_limits(5.0, 5.0) == (5.0, 5.0)  # nothing to widen


def test_trials_note_says_how_many_trials_each_point_averages():
    assert trials_note([30, 30, 30]) == "n = 30 trials per length"
    assert trials_note([10, 30]) == "n = 10-30 trials per length"
    assert trials_note([1]) == "n = 1 trial per length"
    assert trials_note([5], per="cell") == "n = 5 trials per cell"
