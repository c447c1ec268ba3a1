"""The README's first command: the offline demo extends the shipped pre-trained model through finetune and
perplexity."""

import json

from pose_mlx import demo


def test_shipped_model_is_the_simulators_pretrained_llama():
    config = json.loads((demo.PRETRAINED / "config.json").read_text())
    record = json.loads((demo.PRETRAINED / "pretrain.json").read_text())
    assert config["max_position_embeddings"] == record["window"] == 128
    assert config["rope_theta"] == record["rope_base"]
    assert (demo.PRETRAINED / "model.safetensors").stat().st_size > 1_000_000
    assert record["retrieval_blocks"] > 0  # the second protocol's base: retrieval documents in pre-training


def test_demo_extends_and_evaluates(tmp_path, capsys):
    code = demo.main(["--out", str(tmp_path), "--steps", "4", "--batch-size", "4", "--train-docs", "40",
                      "--test-docs", "2"])
    assert code == 0
    exported = json.loads((tmp_path / "pose" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 8 * 128
    schedule = json.loads((tmp_path / "pose" / "pose_mlx.json").read_text())["schedule"]
    assert schedule["schedule"] == "yarn" and schedule["target"] == 1024
    ppl = {}
    for name in ("original", "yarn", "pose"):
        results = json.loads((tmp_path / f"ppl-{name}.json").read_text())["results"]
        assert [r["length"] for r in results] == [128, 256, 512, 1024]
        ppl[name] = [r["ppl"] for r in results]
    # the shipped model is pre-trained: far below the ~2048 of a uniform guess over its vocabulary at Lc
    assert ppl["original"][0] < 50
    out = capsys.readouterr().out
    assert "perplexity by evaluation length" in out and "passkey accuracy by length" in out
    assert (tmp_path / "corpus" / "finetune" / "retrieval.jsonl").stat().st_size > 0
    base = json.loads((tmp_path / "passkey-original.json").read_text())["accuracy"]
    assert [a["length"] for a in base] == [128, 256, 512, 1024]
    assert base[0]["accuracy"] >= 0.9  # the shipped base retrieves inside its window (1.00 over 50 trials)
    assert (tmp_path / "passkey-pose.json").is_file()
