"""The simulator's report (`pose_mlx.sim.report`): its tables say the numbers of the results they are made from."""

import re

import numpy as np
import pytest

from pose_mlx.sim import report
from pose_mlx.sim.grid import grid_runs

LENGTHS = [32, 64, 128, 256]


def _results(seed: int = 0) -> dict:
    """A results.json dict as the simulator writes it, with random numbers; `pose-linear` lacks the length 256 and
    `randpos-linear` was not run."""
    rng = np.random.default_rng(seed)
    runs = {}
    for run in grid_runs(8):
        if run.cost_only or run.name == "randpos-linear":
            continue
        lengths = LENGTHS[:-1] if run.name == "pose-linear" else LENGTHS
        runs[run.name] = {"spec": run.spec(), "cost": None,
                          "ppl": {str(n): float(rng.uniform(5, 500)) for n in lengths},
                          "passkey": {str(n): float(rng.uniform(0, 1)) for n in lengths[1:]}}
    cost = {m: {str(32 * f): {"seconds_per_step": float(rng.uniform(0.01, 2)), "tokens_per_step": int(t * f),
                              "peak_memory_gb": float(rng.uniform(0.001, 1))} for f in (8, 2, 4)}
            for m, t in (("pose", 62), ("full", 64))}
    config = {"window": 32, "target": 256, "factor": 8, "lengths": LENGTHS, "hidden": 32, "layers": 2, "heads": 2,
              "ffn": 64, "vocab": 512, "base": 10000.0, "steps": 10, "full_batch": 2, "window_batch": 16,
              "lr": 1e-3, "test_docs": 2, "test_tokens": 512, "eval_stride": 16, "passkey_trials": 4,
              "ruler_samples": 1, "seeds": [0]}
    pretrain = {"parameters": 12345, "train_tokens": 99999, "steps": 20, "retrieval_blocks": 3, "blocks": 30,
                "val_ppl": 20.5}
    return {"config": config, "argv": "--quick", "pretrain": pretrain, "corpus": {"source": "test", "documents": 9},
            "claims": [], "runs": runs, "cost_vs_target": cost, "wall_seconds": 60.0}


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after `heading`, header and rule left out."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _number(cell: str) -> float:
    return float(cell.strip("*"))


def test_each_perplexity_table_has_the_results_numbers(tmp_path):
    results = _results()
    text = report.write_report(results, tmp_path, []).read_text()
    labels = {r["spec"]["label"]: name for name, r in results["runs"].items()}
    tables = 0
    for _, title, names in report.TABLES:
        rows = _table(text, f"### {title}")
        # the table's runs, in its order, those not run (randpos-linear) left out
        assert [labels[row[0]] for row in rows] == [n for n in names if n in results["runs"]]
        for row in rows:
            ppl = results["runs"][labels[row[0]]]["ppl"]
            for n, cell in zip(LENGTHS, row[1:], strict=True):
                if str(n) not in ppl:
                    assert cell == "-"
                else:
                    assert _number(cell) == pytest.approx(ppl[str(n)], abs=0.005)
        tables += 1
    assert tables == len(report.TABLES)
    assert "| PoSE + linear | " in text and "| RandPos + linear |" not in text


def test_the_passkey_table_has_each_evaluated_runs_accuracy(tmp_path):
    results = _results(1)
    rows = _table(report.write_report(results, tmp_path, []).read_text(), "## Passkey retrieval")
    labels = {r["spec"]["label"]: name for name, r in results["runs"].items()}
    assert sorted(labels[row[0]] for row in rows) == sorted(results["runs"])
    for row in rows:
        accuracy = results["runs"][labels[row[0]]]["passkey"]
        assert row[1] == "-"  # no run was tested at Lc = 32 here
        for n, cell in zip(LENGTHS[1:], row[2:], strict=True):
            assert cell == "-" if str(n) not in accuracy else _number(cell) == pytest.approx(accuracy[str(n)],
                                                                                           abs=0.005)


def test_the_cost_table_lists_targets_by_length_with_their_numbers():
    results = _results(2)
    rows = _table(report.cost_table(results), "| method")
    # numerically sorted (64 < 128 < 256, which a string sort would not give), each method's rows together
    assert [(r[0], int(r[1])) for r in rows] == [(m, 32 * f) for m in ("pose", "full") for f in (2, 4, 8)]
    for method, target, seconds, tokens, peak in rows:
        source = results["cost_vs_target"][method][target]
        assert float(seconds) == pytest.approx(source["seconds_per_step"], abs=5e-4)
        assert int(tokens) == source["tokens_per_step"]
        assert float(peak) == pytest.approx(source["peak_memory_gb"], abs=5e-4)


def test_metric_table_formats_with_the_given_format_and_dashes_gaps():
    results = _results(3)
    table = report.metric_table(results, ["pose-linear"], "ppl", ".3f").splitlines()
    assert table[0] == "| model | 32 | 64 | 128 | 256 |"
    cells = table[2].strip("|").split("|")
    ppl = results["runs"]["pose-linear"]["ppl"]
    assert [c.strip() for c in cells] == ["PoSE + linear"] + [f"{ppl[str(n)]:.3f}" for n in LENGTHS[:3]] + ["-"]
    assert re.fullmatch(r"\d+\.\d{3}", cells[1].strip())


def test_the_passkey_plot_says_how_many_trials_each_point_averages(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    titles, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: (
        titles.setdefault(str(path).rsplit("/", 1)[-1], self.axes[0].get_title()), save(self, path, **kw))[1])
    results = _results(1)
    report.plots(results, tmp_path)
    assert titles["passkey.png"] == "Passkey retrieval (cf. paper Figure 2b), n = 4 trials per length"
