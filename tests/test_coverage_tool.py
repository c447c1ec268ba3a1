"""tools/coverage.py writes every file; PNGs are valid and non-empty; bad flags are one-line errors. ~6 s."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED = ["coverage.png", "coverage.csv", "angle_histograms.png", "dprope_kl.png", "dprope.json", "helices.png",
            "granularity.png", "granularity.csv", "bounds.png", "bounds.csv", "summary.json"]


def test_tool_writes_every_file(tmp_path):
    out = tmp_path / "cov"
    args = ["--out", str(out), "--window", "64", "--target", "512", "--head-dim", "32", "--dims", "0", "15",
            "--samples", "200", "--bound-range", "500", "--bins", "60"]
    subprocess.run([sys.executable, str(ROOT / "tools" / "coverage.py"), *args], check=True, cwd=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPECTED)
    for name in EXPECTED:
        data = (out / name).read_bytes()
        assert len(data) > 100, name
        if name.endswith(".png"):
            assert data[:8] == PNG_SIGNATURE, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["target"] == 512
    factors = json.loads((out / "dprope.json").read_text())["factors"]
    assert len(factors) == 16 and set(factors) <= {1.0, 8.0}
    rows = (out / "coverage.csv").read_text().splitlines()
    assert len(rows) == 1 + 512


def test_help_documents_every_flag():
    text = subprocess.run([sys.executable, str(ROOT / "tools" / "coverage.py"), "--help"], check=True,
                          capture_output=True, text=True).stdout
    for flag in ["--out", "--window", "--target", "--head-dim", "--base", "--bins", "--dims", "--samples", "--alpha",
                 "--bound-range", "--seed"]:
        assert flag in text
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "coverage.py"), "--dims", "99"], capture_output=True)
    assert bad.returncode != 0


def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coverage_tool", ROOT / "tools" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



@pytest.mark.parametrize("args, flag", [
    (["--head-dim", "7"], "--head-dim"), (["--base", "1"], "--base"), (["--bins", "0"], "--bins"),
    (["--samples", "1"], "--samples"), (["--alpha", "0"], "--alpha"), (["--alpha", "1.5"], "--alpha"),
    (["--bound-range", "0"], "--bound-range"), (["--window", "2"], "--window"), (["--base", "inf"], "--base"),
    (["--seed", "-1"], "--seed"), (["--target", "1000000000000"], "--target"), (["--bins", "x"], "--bins"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, flag):
    """Each bad value is refused before any work: exit 2 and one stderr line naming the flag, no traceback."""
    code = _load_tool().main(["--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("coverage.py: error: ") and flag in err[0], err
    assert not (tmp_path / "out").exists()


def test_unwritable_out_is_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _load_tool().main(["--out", str(blocker / "sub")]) == 2
    assert "error: --out: cannot create" in capsys.readouterr().err


def _legend_hides_data(fig) -> list[str]:
    """Labels of lines with a data point drawn under an axes' legend box (display coordinates)."""
    fig.canvas.draw()
    hidden = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent()
        for line in ax.get_lines():
            xy = ax.transData.transform(line.get_xydata())
            inside = ((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1))
            if inside.any():
                hidden.append(line.get_label())
    return hidden


@pytest.mark.parametrize("plot", ["plot_coverage", "plot_bounds", "plot_granularity", "plot_angles"])
def test_legends_do_not_cover_curves_at_default_settings(tmp_path, monkeypatch, plot):
    """The README's figures (default settings): no legend box sits on top of a plotted curve."""
    tool = _load_tool()
    covered = {}
    save = tool._save

    def check_then_save(fig, path):
        covered[Path(path).name] = _legend_hides_data(fig)
        return save(fig, path)

    monkeypatch.setattr(tool, "_save", check_then_save)
    getattr(tool, plot)(tool.parse_args(["--out", str(tmp_path)]), tmp_path)
    assert covered and all(not labels for labels in covered.values()), covered


def test_coverage_plot_writes_the_original_window_on_its_axis(tmp_path, monkeypatch):
    tool = _load_tool()
    figures = []
    save = tool._save
    monkeypatch.setattr(tool, "_save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    tool.plot_coverage(tool.parse_args(["--out", str(tmp_path), "--window", "300", "--target", "2400",
                                        "--samples", "200"]), tmp_path)
    ax = figures[0].axes[0]
    ticks = dict(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels())))
    assert ticks[300] == "300" and "tokens" in ax.get_xlabel()
    assert "original window Lc = 300" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_helices_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    """Neighbouring tick labels of every axis of the three 3D panels are further apart than half their widths
    (or heights) added: the labels are centred on their tick marks, whose drawn positions give the spacing (the
    labels' own extents are not reliable on 3D axes)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    tool = _load_tool()
    spacings, save = [], Figure.savefig

    def measure(self, *args, **kwargs):
        self.canvas.draw()
        renderer = self.canvas.get_renderer()
        for ax in self.axes:
            for axis, limits in ((ax.xaxis, ax.get_xlim3d()), (ax.yaxis, ax.get_ylim3d()),
                                 (ax.zaxis, ax.get_zlim3d())):
                shown = [t for t in axis.get_major_ticks() if limits[0] <= t.get_loc() <= limits[1]]
                marks = [t.tick1line.get_transform().transform(t.tick1line.get_xydata())[0] for t in shown]
                boxes = [t.label1.get_window_extent(renderer) for t in shown]
                spacings.append((ax.get_title(), axis.axis_name, marks, boxes))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", measure)
    tool.plot_helices(tool.parse_args(["--out", str(tmp_path)]), tmp_path)
    assert len(spacings) == 9
    for title, name, marks, boxes in spacings:
        assert len(marks) >= 2, (title, name)
        for (p, a), (q, b) in zip(zip(marks, boxes), list(zip(marks, boxes))[1:]):
            apart_x = abs(q[0] - p[0]) >= (a.width + b.width) / 2
            apart_y = abs(q[1] - p[1]) >= (a.height + b.height) / 2
            assert apart_x or apart_y, (title, name, p, q, a.width, b.width)
