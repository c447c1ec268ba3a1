"""The README's first command: the offline demo runs end to end through finetune and perplexity."""

import json

from pose_mlx import demo


def test_demo_extends_and_evaluates(tmp_path, capsys):
    code = demo.main(["--out", str(tmp_path), "--steps", "8", "--train-docs", "40", "--test-docs", "2"])
    assert code == 0
    exported = json.loads((tmp_path / "pose" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 8 * 64
    schedule = json.loads((tmp_path / "pose" / "pose_mlx.json").read_text())["schedule"]
    assert schedule["method"] == "linear" and schedule["target_length"] == 512
    for name in ("base", "pose"):
        results = json.loads((tmp_path / f"ppl-{name}.json").read_text())["results"]
        assert [r["length"] for r in results] == [64, 128, 256, 512]
    # training on real text must beat the untrained model (uniform over 512 pieces is ppl ~ 512)
    base = json.loads((tmp_path / "ppl-base.json").read_text())["results"]
    pose = json.loads((tmp_path / "ppl-pose.json").read_text())["results"]
    assert all(p["ppl"] < b["ppl"] for p, b in zip(pose, base))
    assert "perplexity by evaluation length" in capsys.readouterr().out
