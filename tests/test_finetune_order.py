"""A run checks what is cheap before it downloads a model: `finetune --model owner/name` reads the hub model's
config.json alone, plans the memory and checks --data, and only then downloads the weights. The hub is a stub
(huggingface_hub's functions, which pose_mlx imports where it calls them) that fails the test on any download of
the model's weights before that point."""

import json
import shutil

import pytest

from _finetune_helpers import text_dir, tiny_model  # noqa: F401
from pose_mlx.finetune import main

FAST = ["--window", "16", "--steps", "1", "--lr", "1e-3", "--warmup", "1", "--no-progress"]


@pytest.fixture
def hub(tiny_model, tmp_path, monkeypatch):
    """A stub hub serving "someone/tiny" (the tiny model): `events` lists what was asked of it, in order; a weight
    download is allowed only once `hub.weights_allowed` is set, otherwise it fails the test."""
    import huggingface_hub

    import pose_mlx.model.source as source

    class Hub:
        events: list = []
        weights_allowed = False

    snapshot = tmp_path / "hub" / "snapshots" / "0"
    snapshot.mkdir(parents=True)
    shutil.copyfile(tiny_model / "config.json", snapshot / "config.json")

    def hf_hub_download(repo_id, filename, **kwargs):
        Hub.events.append(("file", repo_id, filename))
        assert (repo_id, filename) == ("someone/tiny", "config.json")
        return str(snapshot / filename)

    def snapshot_download(repo_id=None, repo_type=None, **kwargs):
        Hub.events.append(("snapshot", repo_id, repo_type))
        if repo_type == "dataset":
            pytest.fail("no hub data set was asked for")
        if not Hub.weights_allowed:
            pytest.fail(f"the weights of {repo_id} were downloaded before the cheap checks")
        for path in tiny_model.iterdir():  # the whole model arrives in the same snapshot folder
            shutil.copyfile(path, snapshot / path.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(source, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.chdir(tmp_path)  # "someone/tiny" is no local folder
    return Hub


def _fails(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_a_run_that_does_not_fit_stops_before_the_weights_are_downloaded(hub, text_dir, tmp_path, capsys):
    line = _fails(capsys, "--model", "someone/tiny", "--target", "4x", "--data", text_dir, "--output", tmp_path / "o",
                  "--max-memory", "64KB", *FAST)
    assert "needs about" in line and "more than 64 KiB" in line
    assert hub.events == [("file", "someone/tiny", "config.json")]


@pytest.mark.parametrize("kind", ["missing", "empty folder", "empty files"])
def test_bad_data_stops_before_the_weights_are_downloaded(hub, kind, tmp_path, capsys):
    data = tmp_path / "texts"
    if kind != "missing":
        data.mkdir()
    if kind == "empty files":
        (data / "__init__.py").write_text("")
        (data / "notes.md").write_text("  \n")
    line = _fails(capsys, "--model", "someone/tiny", "--target", "4x", "--data", data, "--output", tmp_path / "o",
                  *FAST)
    expected = {"missing": f"--data {data}: no such file or folder",
                "empty folder": f"--data {data}: no .txt/.md/.py/.jsonl files in this folder",
                "empty files": f"--data {data}: no readable document (0 files read, skipped 2 empty, 0 binary, "
                               "0 not UTF-8)"}[kind]
    assert line == f"pose_mlx.finetune: error: {expected}"
    assert hub.events == [("file", "someone/tiny", "config.json")]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_run_that_passes_the_checks_downloads_the_weights_then_trains(hub, text_dir, tmp_path, capsys):
    """The same stub lets a sound run through: its config first, the checks, then the weights (so the tests above
    would have seen an early download)."""
    hub.weights_allowed = True
    code = main([str(a) for a in ["--model", "someone/tiny", "--target", "4x", "--data", text_dir, "--output",
                                  tmp_path / "o", "--cache-dir", tmp_path / "cache", *FAST]])
    assert code == 0, capsys.readouterr().err
    assert hub.events == [("file", "someone/tiny", "config.json"), ("snapshot", "someone/tiny", None)]
    assert json.loads((tmp_path / "o" / "pose_mlx.json").read_text())["steps"] == 1


def test_a_jsonl_of_chat_records_passes_the_data_check_without_a_tokenizer(tmp_path):
    from pose_mlx.training.data import DataError, check_readable

    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    check_readable(chat)
    chat.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:1: expected a JSON object with 'text', 'messages'"):
        check_readable(chat)
