"""Passkey retrieval: prompt sizing, answer parsing, greedy decoding with a shared KV cache, CLI."""

import json
import re
from pathlib import Path
import time

import numpy as np
import pytest

from pose_mlx.eval import longctx, passkey
from pose_mlx.errors import EXIT_INTERRUPTED, UserError

import mlx.core as mx

from conftest import build_model
from _eval_helpers import assert_cost, count_appends, make_eval_folder


@pytest.mark.parametrize("text, expected", [
    ("12345.", 12345), (" 12345", 12345), ("The pass key is 12345", 12345), ("1234 5", 1234),
    ("no digits here", None), ("", None), ("key: 007 and 42", 7),
])
def test_parse_answer(text, expected):
    assert passkey.parse_answer(text) == expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_eval_folder(tmp_path_factory.mktemp("pk") / "tiny", max_position_embeddings=256)
    return folder, longctx.load_eval_model(folder)


@pytest.mark.parametrize("length", [80, 131, 256, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_prompt_hits_its_target_length_within_one_sentence(tiny, length, depth):
    tok = tiny[1].tokenizer
    prompt = passkey.build_prompt(tok, 0, length, depth, 54321)
    longest_sentence = max(len(longctx.encode(tok, " " + s)) for s in passkey.FILLER)
    assert length - longest_sentence <= len(prompt) <= length
    text = tok.decode(prompt[1:])
    assert prompt[0] == 0
    assert text.startswith(passkey.TASK) and text.endswith(passkey.QUESTION)
    assert "The pass key is 54321. Remember it. 54321 is the pass key." in text
    before, after = text.split("The pass key is 54321.")
    n_before = sum(before.count(s) for s in passkey.FILLER)
    n_after = sum(after.count(s) for s in passkey.FILLER)
    assert abs(n_before - depth * (n_before + n_after)) <= 0.5 + 1e-9


@pytest.mark.parametrize("length", [70, 131, 1000, 20_000])
def test_prompt_has_the_most_sentences_that_fit(tiny, length, monkeypatch):
    """n filler sentences fit and n + 1 do not; found in O(log n) encodings of the prompt (a prompt of
    millions of tokens is encoded a few dozen times, not once per sentence between a guess and the answer)."""
    tok = tiny[1].tokenizer
    calls = []
    original = passkey.prompt_tokens
    monkeypatch.setattr(passkey, "prompt_tokens", lambda *a: calls.append(a) or original(*a))
    prompt = passkey.build_prompt(tok, 0, length, 0.5, 777)
    text = tok.decode(prompt[1:])
    n = sum(text.count(s) for s in passkey.FILLER)
    assert prompt == original(tok, 0, n, 0.5, 777) and len(prompt) <= length
    assert len(original(tok, 0, n + 1, 0.5, 777)) > length
    assert len(calls) <= 4 + 2 * max(1, n).bit_length()


def test_too_short_length_is_an_error(tiny):
    with pytest.raises(UserError, match="shorter than the passkey template"):
        passkey.build_prompt(tiny[1].tokenizer, 0, 20, 0.5, 12345)


def test_greedy_generation_matches_manual_argmax_without_cache(tiny):
    model, tok = tiny[1].model, tiny[1].tokenizer
    prompt = passkey.build_prompt(tok, 0, 120, 0.5, 11111)
    ids = list(prompt)
    for _ in range(passkey.MAX_NEW_TOKENS):  # full forward each step, no KV cache
        ids.append(int(np.argmax(np.array(model(mx.array(ids)[None])[0, -1]))))
    gen = passkey.PrefixCachedGenerator(model, chunk=32)
    assert gen.generate(prompt, passkey.MAX_NEW_TOKENS, stop=set()) == ids[len(prompt):]


def test_prefix_reuse_gives_the_same_answers_with_less_work(tiny):
    model, tok = tiny[1].model, tiny[1].tokenizer
    kwargs = dict(lengths=[100, 200], trials=4, depths=None, seed=3, chunk=32, show_progress=False)
    reused, g1 = passkey.run_passkey(model, tok, reuse=True, **kwargs)
    fresh, g2 = passkey.run_passkey(model, tok, reuse=False, **kwargs)
    assert [t.answer for t in reused] == [t.answer for t in fresh]
    assert g2.computed == sum(t.prompt_tokens for t in fresh)
    assert g1.computed < g2.computed


def test_a_dynamic_ntk_model_reuses_a_prefix_only_at_the_same_length(monkeypatch):
    """Dynamic NTK rotates every key by a base set by the whole prompt's length: a prompt as long as the cached
    one keeps their shared prefix and gets the last logits of one full forward pass; a longer one is computed
    afresh. Sharing across lengths (forced below) would mix two bases and change the logits."""
    from pose_mlx.model.patch import extend

    model = build_model("llama")
    extend(model, "dynamic", 32, 256)
    rng = np.random.default_rng(5)
    first = rng.integers(0, 97, size=120).tolist()
    same = first[:80] + [(t + 1) % 97 for t in first[80:]]  # differs from token 80 on
    longer = first[:80] + rng.integers(0, 97, size=60).tolist()
    assert longer[80] != first[80]
    returned = []
    prefill = longctx.prefill
    monkeypatch.setattr(longctx, "prefill", lambda *a, **k: returned.append(prefill(*a, **k)) or returned[-1])

    def run(generator, prompts):
        for prompt in prompts:
            before = generator.computed
            generator.generate(prompt, 3, stop=set())
            yield generator.computed - before, np.array(returned[-1]), np.array(model(mx.array(prompt)[None])[0, -1])

    steps = list(run(passkey.PrefixCachedGenerator(model, chunk=16), [first, same, longer]))
    assert [computed for computed, *_ in steps] == [120, 40, 140]
    for _, got, full in steps:
        np.testing.assert_allclose(got, full, atol=1e-4)
    forced = passkey.PrefixCachedGenerator(model, chunk=16)
    forced.dynamic = False  # as if the base did not depend on the length
    *_, (computed, got, full) = run(forced, [first, longer])
    assert computed == 60 and np.abs(got - full).max() > 1e-3


def test_trial_plan_keys_and_depths():
    plan = passkey.trial_plan([100, 200], trials=6, depths=3, seed=0)
    assert len(plan) == 12
    assert [d for _, d, _ in plan[:6]] == [0.0, 0.5, 1.0, 0.0, 0.5, 1.0]
    keys = [k for *_, k in passkey.trial_plan([100], trials=500, depths=None, seed=1)]
    assert all(10_000 <= k <= 99_999 for k in keys) and len(set(keys)) > 450


def test_depth_grid_averages_hits_per_cell():
    T = passkey.Trial
    trials = [T(100, 99, 0.0, 1, "", True), T(100, 99, 0.0, 1, "", False), T(100, 99, 1.0, 1, "", True),
              T(200, 199, 0.0, 1, "", False)]
    grid, labels, lengths = passkey.depth_grid(trials)
    assert lengths == [100, 200] and labels == ["0%", "100%"]
    np.testing.assert_array_equal(grid[:, 0], [0.5, 1.0])
    assert grid[0, 1] == 0.0 and np.isnan(grid[1, 1])


def test_cli_end_to_end(tiny, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    titles, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: (
        titles.setdefault(Path(path).name, self.axes[0].get_title()), save(self, path, **kw))[1])
    folder = tiny[0]
    out = tmp_path / "pk.json"
    started = time.perf_counter()
    rc = passkey.main(["--model", str(folder), "--lengths", "100,200", "--trials", "3", "--depths", "3",
                       "--output", str(out), "--no-progress"])
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "| 100 |" in captured.out and "| 200 |" in captured.out
    record = json.loads(out.read_text())
    assert {"length", "prompt_tokens", "depth", "key", "answer", "correct"} <= set(record["trials"][0])
    assert len(record["trials"]) == 6
    for acc in record["accuracy"]:
        hits = [t["correct"] for t in record["trials"] if t["length"] == acc["length"]]
        assert acc["accuracy"] == pytest.approx(np.mean(hits))
    assert_cost(record, folder, elapsed)
    assert (tmp_path / "pk_accuracy.png").stat().st_size > 1000
    assert (tmp_path / "pk_heatmap.png").stat().st_size > 1000
    # each accuracy plot says how many trials each of its points averages
    assert titles == {"pk_accuracy.png": "Passkey retrieval accuracy (n = 3 trials per length)",
                      "pk_heatmap.png": "Passkey accuracy by depth and length\n(n = 3 trials per length)"}


def test_interrupted_run_takes_up_its_finished_trials(tiny, tmp_path, capsys, monkeypatch):
    """Killed after 2 of 6 trials, the same command runs only the other 4 and writes what an uninterrupted run
    writes; a run with other settings starts over."""
    flags = ["--model", str(tiny[0]), "--lengths", "100,200", "--trials", "3", "--depths", "3", "--no-progress"]
    assert passkey.main([*flags, "--output", str(tmp_path / "whole.json")]) == 0
    out = tmp_path / "pk.json"
    count_appends(monkeypatch, interrupt_after=2)
    assert passkey.main([*flags, "--output", str(out)]) == EXIT_INTERRUPTED
    assert "2 finished trials are kept" in capsys.readouterr().err
    assert not out.exists() and len((tmp_path / "pk.json.partial.jsonl").read_text().splitlines()) == 3
    appended = count_appends(monkeypatch)
    capsys.readouterr()
    assert passkey.main([*flags, "--output", str(out)]) == 0
    assert "taking up 2 of 6 trials" in capsys.readouterr().err and len(appended) == 4
    resumed, whole = json.loads(out.read_text()), json.loads((tmp_path / "whole.json").read_text())
    assert resumed["trials"] == whole["trials"]
    assert resumed["cost"]["taken_up"] == 2 and whole["cost"]["taken_up"] == 0  # whose time `seconds` lacks
    assert not (tmp_path / "pk.json.partial.jsonl").exists()
    (tmp_path / "pk.json.partial.jsonl").write_text(json.dumps({"model": "another"}) + "\n")
    appended = count_appends(monkeypatch)
    assert passkey.main([*flags, "--output", str(out)]) == 2 and appended == []  # a result is never replaced
    assert f"--output {out} exists" in capsys.readouterr().err
    assert passkey.main([*flags, "--output", str(out), "--overwrite"]) == 0 and len(appended) == 6  # another
    # run's partial file: ignored


def test_cli_default_lengths_and_bad_inputs(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output is written in the current folder
    monkeypatch.setattr("pose_mlx.memory.device.available_memory", lambda: (2**30, "a 1 GiB test machine"))
    folder = tiny[0]
    assert passkey.main(["--model", str(folder), "--trials", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| 128 |" in out and "| 256 |" in out  # half the window (256) up to max_position_embeddings
    small = make_eval_folder(tmp_path / "small", max_position_embeddings=32)
    assert passkey.main(["--model", str(small), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "shorter than the passkey template" in err
    hint = re.search(r"pass (--lengths \d+ --allow-beyond-window) ", err).group(1).split()  # as pasted, it runs
    assert passkey.main(["--model", str(small), "--trials", "1", "--no-progress", *hint]) == 0
    capsys.readouterr()
    for argv, fragment in [(["--lengths", "1k;2k"], "--lengths"), (["--lengths", "16"], "template"),
                           (["--lengths", "16000k", "--allow-beyond-window"], "than the 1 GiB"),
                           (["--lengths", "16000k"], "--allow-beyond-window"), (["--lengths", "100000k"], "outside")]:
        assert passkey.main(["--model", str(folder), "--no-progress"] + argv) != 0
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1 and fragment in err, err


def test_module_entry_point_reports_bad_input_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pose_mlx.passkey", "--model", str(tmp_path), "--lengths", "2k,x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pose_mlx.passkey: error: --lengths 'x' is not a length: use e.g. 32768, 32k, 1.5k or 8x"


@pytest.mark.parametrize("reuse", [True, False])
def test_a_model_that_reads_its_context_scores_full_accuracy(tiny, reuse):
    from _eval_helpers import RetrievalOracle

    tok = tiny[1].tokenizer
    oracle = RetrievalOracle(tok, tiny[1].model.args.vocab_size)
    trials, gen = passkey.run_passkey(oracle, tok, [100, 300], trials=5, depths=None, seed=7, chunk=64,
                                      show_progress=False, reuse=reuse)
    assert all(t.correct for t in trials), [(t.key, t.answer) for t in trials]
    assert all(t.answer.strip() == str(t.key) for t in trials)
    if reuse:
        assert gen.computed < sum(t.prompt_tokens for t in trials)


def test_default_lengths_error_suggests_a_length_that_fits(tmp_path, capsys):
    small = make_eval_folder(tmp_path / "small", max_position_embeddings=32)
    assert passkey.main(["--model", str(small), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    suggested = int(err.split("pass --lengths ")[1].split()[0])
    info = longctx.load_eval_model(small)
    assert passkey.build_prompt(info.tokenizer, 0, suggested, 0.5, 99_999)  # the suggestion fits the template


@pytest.mark.parametrize("argv, flag", [(["--trials", "0"], "--trials"), (["--depths", "0"], "--depths")])
def test_trial_counts_are_checked_before_loading_the_model(tmp_path, capsys, argv, flag):
    # the folder does not exist: had the model been loaded first, the error would name --model
    assert passkey.main(["--model", str(tmp_path / "missing"), "--no-progress"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {flag}" in err, err


@pytest.mark.parametrize("columns", [1, 2, 8])
def test_heatmap_is_never_narrower_than_its_title(tmp_path, columns):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from pose_mlx.plots import heatmap

    title = "Passkey accuracy by depth and length"
    path = heatmap(tmp_path / "h.png", np.full((3, columns), 0.5), ["0%", "50%", "100%"],
                   [str(256 * 2**i) for i in range(columns)], "context length (tokens)", "needle depth", title)
    width_px = mpimg.imread(path).shape[1]
    fig = plt.figure(dpi=120)  # the title's own width, rendered at the same size and dpi
    text = fig.text(0, 0, title, fontsize=plt.rcParams["axes.titlesize"])
    fig.canvas.draw()
    title_px = text.get_window_extent().width
    plt.close(fig)
    assert width_px > title_px + 20


def test_heatmap_cells_without_trials_are_grey(tmp_path):
    import matplotlib.image as mpimg

    from pose_mlx.plots import heatmap

    def grey_pixels(grid):
        rgb = mpimg.imread(heatmap(tmp_path / "h.png", grid, ["a", "b"], ["1", "2"], "x", "y", "t"))[..., :3]
        mean = rgb.mean(axis=-1)
        return int(((np.ptp(rgb, axis=-1) < 0.02) & (mean > 0.7) & (mean < 0.9)).sum())

    # the same grid with one cell empty instead of 0: that whole cell (thousands of pixels) turns grey
    assert grey_pixels(np.array([[0.0, np.nan], [1.0, 0.5]])) > grey_pixels(np.array([[0.0, 0.0], [1.0, 0.5]])) + 5000
