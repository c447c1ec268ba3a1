"""Where evaluation results go (pose_mlx.eval.results): one folder per model, names that say what was measured,
and no result ever replaced by another, end to end through `python -m pose_mlx.passkey` / `perplexity` and unit by
unit."""

import json
import os
from pathlib import Path

import pytest

from pose_mlx.eval import passkey, perplexity, results
from pose_mlx.errors import EXIT_INTERRUPTED, UserError
from pose_mlx.model.source import ModelRef

from _eval_helpers import count_appends, make_eval_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_eval_folder(tmp_path_factory.mktemp("results") / "tiny", max_position_embeddings=256)


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file():
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _written(err: str) -> Path:
    [line] = [line for line in err.splitlines() if line.startswith("no --output given: writing ")]
    return Path(line.removeprefix("no --output given: writing "))


def test_a_second_run_is_named_apart_and_the_first_kept(tiny, tmp_path, capsys, monkeypatch):
    """Two identical runs without --output: the second lands beside the first (-2), which is untouched; another
    trial count is another name; nothing is written into the current folder."""
    model = _copy(tiny, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(model), "--lengths", "128", "--trials", "1", "--no-progress"]
    assert passkey.main(argv) == 0
    first = _written(capsys.readouterr().err)
    assert first == model / "eval" / "passkey-128-1trials.json"
    before = first.read_bytes()
    assert passkey.main(argv) == 0
    second = _written(capsys.readouterr().err)
    assert second == model / "eval" / "passkey-128-1trials-2.json" and first.read_bytes() == before
    assert second.with_name(second.stem + "_heatmap.png").is_file()
    assert passkey.main([*argv[:-2], "2", "--no-progress"]) == 0
    assert _written(capsys.readouterr().err).name == "passkey-128-2trials.json"
    assert passkey.main([*argv, "--overwrite"]) == 0  # replaces the first name instead
    assert _written(capsys.readouterr().err) == first and first.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_models_of_the_same_name_do_not_collide(tiny, tmp_path, capsys, monkeypatch):
    """a/pose and b/pose: each model's results stay in its own folder."""
    monkeypatch.chdir(tmp_path)
    a, b = _copy(tiny, tmp_path / "a" / "pose"), _copy(tiny, tmp_path / "b" / "pose")
    for model in (a, b):
        assert passkey.main(["--model", str(model), "--lengths", "128", "--trials", "1", "--no-progress"]) == 0
        assert _written(capsys.readouterr().err) == model / "eval" / "passkey-128-1trials.json"


def test_an_existing_output_is_refused_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch):
    from pose_mlx.eval import longctx

    out = tmp_path / "pk.json"
    out.write_text("{}")
    loads = []
    monkeypatch.setattr(longctx, "load_eval_model", lambda *a, **k: loads.append(a))
    for main, extra in ((passkey.main, []), (perplexity.main, ["--data", str(tmp_path)])):
        assert main(["--model", str(tiny), *extra, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--output {out} exists" in err and "--overwrite" in err
    assert loads == [] and out.read_text() == "{}"


def test_an_interrupted_default_run_resumes_under_its_name_and_spares_another_runs_records(tiny, tmp_path, capsys,
                                                                                             monkeypatch):
    """Ctrl-C after one trial: the same command takes it up under the same default name. A run that the name
    does not tell apart (here: a partial file whose header names another schedule) finds the name's partial file
    holding another run's records and goes to -2, leaving them."""
    model = _copy(tiny, tmp_path / "m")
    argv = ["--model", str(model), "--lengths", "128", "--trials", "3", "--depths", "3", "--no-progress"]
    count_appends(monkeypatch, interrupt_after=1)
    assert passkey.main(argv) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "1 finished trial is kept in " in err and "the same command takes it up" in err  # not "1 ... trials are"
    name = _written(err)
    partial = name.with_name(name.name + ".partial.jsonl")
    assert not name.exists() and len(partial.read_text().splitlines()) == 2  # header + one trial
    header = json.loads(partial.read_text().splitlines()[0])
    other = {**header, "schedule": "another run's"}
    partial.write_text("\n".join([json.dumps(other), *partial.read_text().splitlines()[1:]]) + "\n")
    appended = count_appends(monkeypatch)
    assert passkey.main(argv) == 0
    assert _written(capsys.readouterr().err) == name.with_name(name.stem + "-2.json") and len(appended) == 3
    assert json.loads(partial.read_text().splitlines()[0]) == other  # the other run's records are left alone
    partial.write_text("\n".join([json.dumps(header), *partial.read_text().splitlines()[1:]]) + "\n")
    appended = count_appends(monkeypatch)
    assert passkey.main(argv) == 0  # its own records: taken up under the first name
    err = capsys.readouterr().err
    assert _written(err) == name and "taking up 1 of 3 trials" in err and len(appended) == 2
    assert name.is_file() and not partial.exists()


def test_results_folder_per_kind_of_model_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "models" / "pose"
    folder.mkdir(parents=True)
    assert results.results_folder(str(folder), ModelRef(str(folder), folder)) == folder / "eval"
    gguf = tmp_path / "SmolLM2-135M.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert results.results_folder(str(gguf), ModelRef(str(gguf), gguf)) == Path("out/eval/SmolLM2-135M.Q4_1")
    hub = ModelRef("meta-llama/Llama-2-7b-hf", tmp_path / "hub-cache" / "snapshot")
    assert results.results_folder("llama-2-7b", hub) == Path("out/eval/meta-llama--Llama-2-7b-hf")
    assert results.results_folder("meta-llama/Llama-2-7b-hf", hub) == Path("out/eval/meta-llama--Llama-2-7b-hf")
    if os.geteuid() != 0:  # root may write anywhere
        folder.chmod(0o555)
        try:
            assert results.results_folder(str(folder), ModelRef(str(folder), folder)) == Path("out/eval/pose")
        finally:
            folder.chmod(0o755)


@pytest.mark.parametrize("kind, lengths, schedule, details, expected", [
    ("passkey", [16384], None, ("5trials",), "passkey-16k-5trials"),
    ("passkey", [4096, 8192, 16384], "yarn-x4", ("10trials", "", "seed3"), "passkey-yarn-x4-4k_8k_16k-10trials-seed3"),
    ("perplexity", [1536, 2000], None, ("my docs/../x",), "perplexity-1.5k_2000-my_docs--..--x"),
    ("ruler", [128], None, ("10samples",), "ruler-128-10samples"),
])
def test_default_names_say_what_was_measured(kind, lengths, schedule, details, expected):
    assert results.default_name(kind, lengths, schedule, details) == expected
    assert "/" not in expected and not expected.startswith(".")


def test_free_path_counts_up_and_gives_up(tmp_path, monkeypatch):
    assert results.free_path(tmp_path, "x") == tmp_path / "x.json"
    (tmp_path / "x.json").write_text("{}")
    (tmp_path / "x-2.json").write_text("{}")
    assert results.free_path(tmp_path, "x") == tmp_path / "x-3.json"
    assert results.free_path(tmp_path, "x", overwrite=True) == tmp_path / "x.json"
    monkeypatch.setattr(results, "MAX_TRIES", 2)
    with pytest.raises(UserError, match="pass --output"):
        results.free_path(tmp_path, "x")
