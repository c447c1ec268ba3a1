"""tools/coverage.py writes every file; PNGs are valid and non-empty. Small settings; runtime ~5 s."""

import json
import subprocess
import sys
from pathlib import Path

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
