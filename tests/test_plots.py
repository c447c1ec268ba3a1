"""pose_mlx.plots: the legend of a line plot sits outside the axes, never over the data."""

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from pose_mlx.plots import curves, line_vs_length  # noqa: E402


@pytest.mark.parametrize("kind", ["line_vs_length", "curves"])
def test_line_plot_legend_is_right_of_the_axes(tmp_path, monkeypatch, kind):
    saved = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), original(self, *a, **k))[1])
    lengths = [128, 256, 512, 1024]
    series = {f"run {i}": [10.0 + i * (j + 1) for j in range(4)] for i in range(9)}  # lines across the whole axes
    if kind == "curves":
        path = curves(tmp_path / "p.png", {k: (lengths, v) for k, v in series.items()}, "position", "NLL", "title",
                      mark=128)
    else:
        path = line_vs_length(tmp_path / "p.png", lengths, series, "perplexity", "title", log_y=True, mark=128)
    assert path.stat().st_size > 1000
    fig = saved[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, area = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= area.x1  # entirely right of the plotting area
    assert len(ax.get_legend().get_texts()) == 10  # every series and the original window
