"""The README's first command: the offline demo extends the shipped pre-trained model through finetune and
perplexity."""

import json
from pathlib import Path

from pose_mlx import demo


def test_shipped_model_is_the_simulators_pretrained_llama():
    config = json.loads((demo.PRETRAINED / "config.json").read_text())
    record = json.loads((demo.PRETRAINED / "pretrain.json").read_text())
    assert config["max_position_embeddings"] == record["window"] == 128
    assert config["rope_theta"] == record["rope_base"]
    assert (demo.PRETRAINED / "model.safetensors").stat().st_size > 1_000_000
    assert record["retrieval_blocks"] > 0  # the second protocol's base: retrieval documents in pre-training


def test_demo_extends_and_evaluates(tmp_path, capsys, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figures, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: (figures.setdefault(Path(path).name, self),
                                                                      save(self, path, **kw))[1])
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
    assert "30% of the fine-tuning documents synthetic retrieval documents" in out  # a share ("0.3 retrieval
    assert "replaces" not in out  # documents" it read); nothing earlier to replace
    assert (tmp_path / "corpus" / "finetune" / "retrieval.jsonl").stat().st_size > 0
    base = json.loads((tmp_path / "passkey-original.json").read_text())["accuracy"]
    assert [a["length"] for a in base] == [128, 256, 512, 1024]
    assert base[0]["accuracy"] >= 0.9  # the shipped base retrieves inside its window (1.00 over 50 trials)
    assert (tmp_path / "passkey-pose.json").is_file() and (tmp_path / "passkey-yarn.json").is_file()
    # runs are named by what they are, in the tables, in each run's own plot and in the comparison
    runs = ["original", "YaRN, no training", "PoSE + YaRN"]
    tables = out[out.index("perplexity by evaluation length"):]
    assert [line.split("  ")[0] for line in tables.splitlines()[2:5]] == runs
    assert "pretrained" not in tables.split("extended model:")[0]
    assert "| pretrained + yarn x8, no training | " in out  # pose_mlx.perplexity's own table of that run
    legend = figures["ppl-yarn.png"].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["pretrained + yarn x8, no training", "original window"]
    comparison = figures["comparison.png"]
    assert f"{tmp_path / 'comparison.png'}" in out.splitlines()[-1] and (tmp_path / "comparison.png").is_file()
    ppl_ax, passkey_ax = comparison.axes
    assert ppl_ax.get_yscale() == "log" and "perplexity" in ppl_ax.get_ylabel()
    assert "passkey" in passkey_ax.get_ylabel() and "tokens" in passkey_ax.get_xlabel()
    for ax in (ppl_ax, passkey_ax):  # every run drawn in both panels, at the demo's lengths
        lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
        assert all(lines[name] == [128, 256, 512, 1024] for name in runs)
    assert any(t.get_text().endswith("(passkey: n = 10 trials per length)") for t in comparison.texts)  # suptitle
    (key,) = comparison.legends
    assert [t.get_text() for t in key.get_texts()] == runs + ["original window"]
    comparison.canvas.draw()
    assert all(key.get_window_extent().y1 <= ax.get_tightbbox().y0 for ax in comparison.axes)  # below the panels
    ppl_lines = {line.get_label(): list(line.get_ydata()) for line in ppl_ax.get_lines()}
    assert ppl_lines["original"] == ppl["original"] and ppl_lines["PoSE + YaRN"] == ppl["pose"]
    # run again (fewer passkey trials, the same training settings): the model is reused, the results replaced,
    # which it says first
    assert demo.main(["--out", str(tmp_path), "--steps", "4", "--batch-size", "4", "--train-docs", "40",
                      "--test-docs", "2", "--passkey-trials", "1"]) == 0
    again_out = capsys.readouterr().out
    assert again_out.splitlines()[0] == (f"note: this run replaces the results of an earlier one in {tmp_path} "
                                         "(ppl-*.json, passkey-*.json, comparison.png and their plots); copy them "
                                         "elsewhere now to keep them, or give another --out")
    assert f"[2/4] reusing the fine-tuned model {tmp_path / 'pose'}" in again_out
    again = json.loads((tmp_path / "passkey-original.json").read_text())
    assert {a["trials"] for a in again["accuracy"]} == {1} and not list(tmp_path.glob("*-2.json"))


def test_a_second_run_reuses_the_trained_model_unless_a_setting_changed(tmp_path, capsys, monkeypatch):
    argv = ["--out", str(tmp_path), "--steps", "2", "--batch-size", "2", "--train-docs", "12", "--test-docs", "1"]
    args = demo.build_parser().parse_args(argv)
    model = Path(args.model)
    test = demo.train_or_reuse(args, tmp_path, model, 128)
    assert "[2/4] PoSE fine-tuning" in capsys.readouterr().out and (tmp_path / "pose" / "config.json").is_file()
    assert [p.name for p in test.glob("*.txt")] == ["00000.txt"]
    weights = (tmp_path / "pose" / "model.safetensors").stat().st_mtime_ns

    trained = []
    # a stand-in for fine-tuning from here on: whether it ran, and whether the record of the earlier run was gone
    monkeypatch.setattr(demo.finetune, "run", lambda _plan: trained.append((tmp_path / demo.RECORD).exists()))
    assert demo.train_or_reuse(args, tmp_path, model, 128) == test  # the same settings: nothing is trained
    out = capsys.readouterr().out
    assert trained == [] and f"[2/4] reusing the fine-tuned model {tmp_path / 'pose'}" in out
    assert (tmp_path / "pose" / "model.safetensors").stat().st_mtime_ns == weights

    def why(*changed):
        changed_args = demo.build_parser().parse_args(argv + list(changed))
        settings = demo._finetune_settings(changed_args, model, tmp_path, tmp_path / "corpus" / "finetune").settings
        return demo.why_train(tmp_path, settings, demo.corpus_record(changed_args, model))

    assert why() is None
    assert why("--steps", "3") == "the settings changed (steps 2 -> 3)"
    assert "lr 0.0002 -> 0.001" in why("--lr", "1e-3") and "retrieval 0.3 -> 0.2" in why("--retrieval", "0.2")
    assert "train_docs 12 -> 11" in why("--train-docs", "11")

    fresh = demo.build_parser().parse_args(argv + ["--fresh"])
    demo.train_or_reuse(fresh, tmp_path, model, 128)
    assert trained == [False] and "(--fresh)" in capsys.readouterr().out  # the record goes before training
    (tmp_path / demo.RECORD).unlink()  # as if that run had been stopped during training: its model is not reused
    assert why() == f"{tmp_path / 'pose'} was not finished by a demo run"


def test_fewer_documents_leave_none_of_the_earlier_ones(tmp_path):
    folder = tmp_path / "corpus"
    demo.write_corpus(folder, 2, 6, min_chars=2000)
    (folder / "train" / "mine.txt").write_text("not the demo's")
    demo._clear_corpus(folder)
    train, test = demo.write_corpus(folder, 1, 3, min_chars=2000)
    assert sorted(p.name for p in train.iterdir()) == ["00000.txt", "00001.txt", "00002.txt", "mine.txt"]
    assert [p.name for p in test.iterdir()] == ["00000.txt"]
