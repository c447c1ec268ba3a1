"""Sliding-window perplexity: window plan, agreement with a hand-computed NLL, and the CLI."""

import json
import time
import math

import numpy as np
import pytest

from pose_mlx.eval import perplexity as ppl

import mlx.core as mx

from conftest import build_model
from _eval_helpers import assert_cost, make_eval_folder


@pytest.mark.parametrize("window", [8, 9, 33])
@pytest.mark.parametrize("stride_kind", ["small", "half", "large", "window", "huge"])
@pytest.mark.parametrize("n", [1, 5, 31, 32, 100])
def test_every_token_is_scored_exactly_once(window, stride_kind, n):
    stride = {"small": max(1, window // 4), "half": window // 2, "large": window // 2 + 3,
              "window": window, "huge": 5 * window}[stride_kind]
    plan = ppl.window_plan(n, window, stride)
    counts = np.zeros(n, dtype=int)
    for w in plan:
        assert 0 <= w.start <= w.score_from < w.stop <= n
        assert w.stop - w.start <= window - 1  # BOS + at most W-1 tokens
        counts[w.score_from : w.stop] += 1
    assert (counts == 1).all()
    if n >= window - 1:  # every window is full, so each token has the longest context the plan allows
        assert all(w.stop - w.start == window - 1 for w in plan)


def test_window_starts_advance_by_the_stride():
    plan = ppl.window_plan(100, 17, 5)
    assert [w.start for w in plan[:4]] == [0, 5, 10, 15]
    assert plan[0].score_from == 0 and plan[1].score_from == 16


def _hand_nll(model, bos, tokens):
    """Sum of -log softmax(full forward logits)[next token] over `tokens`, with BOS as the first input."""
    ids = np.array([bos] + list(tokens), dtype=np.int32)
    logits = np.array(model(mx.array(ids)[None])[0], dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return -logp[np.arange(len(tokens)), ids[1:]].sum()


def test_perplexity_equals_hand_computed_nll():
    model = build_model("llama")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 97, size=21).tolist(), rng.integers(1, 97, size=14).tolist()]
    # window 8 with stride >= 7: non-overlapping blocks of 7 tokens, each after its own BOS
    total = sum(_hand_nll(model, 0, d[i : i + 7]) for d in docs for i in range(0, len(d), 7))
    [r] = ppl.perplexity(model, docs, [8], stride=7, bos=0, chunk=3, show_progress=False)
    assert r.tokens == 35
    assert r.ppl == pytest.approx(math.exp(total / 35), rel=1e-4)
    # one window longer than the documents: every token conditioned on the whole prefix
    whole = sum(_hand_nll(model, 0, d) for d in docs)
    [r] = ppl.perplexity(model, docs, [64], stride=4, bos=0, show_progress=False)
    assert r.ppl == pytest.approx(math.exp(whole / 35), rel=1e-4)


def test_overlapping_windows_score_each_token_with_its_window_context():
    model = build_model("llama")
    doc = np.random.default_rng(3).integers(1, 97, size=12).tolist()
    # window 6 (5 tokens), stride 2: windows [0,5) scores 0-4, [2,7) scores 5-6, [4,9) 7-8, [6,11) 9-10,
    # last window moved to [7,12) scores 11
    def nll_of(start, stop, first):
        ids = np.array([0] + doc[start:stop], dtype=np.int32)
        logits = np.array(model(mx.array(ids)[None])[0], dtype=np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        return sum(-logp[j - start, doc[j]] for j in range(first, stop))
    total = nll_of(0, 5, 0) + nll_of(2, 7, 5) + nll_of(4, 9, 7) + nll_of(6, 11, 9) + nll_of(7, 12, 11)
    t, c = ppl.document_nll(model, doc, 6, 2, bos=0, chunk=2)
    assert c == 12
    assert t == pytest.approx(total, rel=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_eval_folder(tmp_path_factory.mktemp("ppl") / "tiny", max_position_embeddings=64)


def _corpus(tmp_path, n_docs=3, sentences=40):
    data = tmp_path / "docs"
    data.mkdir()
    for i in range(n_docs):
        (data / f"d{i}.txt").write_text(" ".join(f"The sky is blue {j}." for j in range(sentences * (i + 1))))
    return data


def test_cli_writes_table_json_and_plot(folder, tmp_path, capsys):
    data = _corpus(tmp_path)
    out = tmp_path / "res" / "ppl.json"
    started = time.perf_counter()
    rc = ppl.main(["--model", str(folder), "--data", str(data), "--lengths", "32,64", "--stride", "16",
                   "--docs", "2", "--output", str(out), "--no-progress"])
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "token-weighted" in captured.out and "| 32 | 64 |" in captured.out
    record = json.loads(out.read_text())
    assert [r["length"] for r in record["results"]] == [32, 64]
    assert all(r["tokens"] == 2 * 63 and r["ppl"] > 1 for r in record["results"])  # same tokens at each length
    assert_cost(record, folder, elapsed)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_scoring_runs_with_mlx_cache_held_to_the_predicted_peak(folder, tmp_path, monkeypatch):
    """The command scores under MLX's buffer cache limit set to the planner's prediction for its longest length
    (every position's logits), and gives the previous limit back afterwards."""
    import pose_mlx.memory as memory
    from pose_mlx.eval import longctx

    seen, score = [], ppl.perplexity

    def spy(*args, **kwargs):
        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        seen.append(limit)
        return score(*args, **kwargs)

    monkeypatch.setattr(ppl, "perplexity", spy)
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    rc = ppl.main(["--model", str(folder), "--data", str(_corpus(tmp_path)), "--lengths", "32,64", "--stride",
                   "16", "--docs", "2", "--output", str(tmp_path / "p.json"), "--no-progress"])
    assert rc == 0
    info = longctx.load_eval_model(str(folder))
    stored = {**info.config, "torch_dtype": "float32"}  # the folder's weights (its config names no dtype)
    assert seen == [memory.eval_memory(stored, 64, longctx.DEFAULT_CHUNK).peak]
    assert mx.set_cache_limit(before) == before


def test_fewer_long_enough_documents_than_asked_for_are_said(folder, tmp_path, capsys):
    """--docs is an upper bound: with fewer documents of the needed length the command scores those and says
    so on stderr (a protocol asking for 4 documents learns it got 3)."""
    data = _corpus(tmp_path, n_docs=3, sentences=2)  # about 12, 24 and 36 tokens
    out = tmp_path / "p.json"
    rc = ppl.main(["--model", str(folder), "--data", str(data), "--lengths", "16", "--stride", "8",
                   "--docs", "3", "--min-doc-tokens", "20", "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0
    documents = json.loads(out.read_text())["documents"]
    assert documents < 3
    said = "1 document of --data has" if documents == 1 else f"{documents} documents of --data have"  # not
    assert f"note: {said} at least 20 tokens, fewer than the --docs 3" in err  # "1 document(s) ... have"


def test_truncate_lets_separate_runs_score_the_tokens_of_a_joint_run(folder, tmp_path, capsys):
    """A 32-token run with --truncate 63 scores exactly what the joint 32,64 run scores at 32 (its default
    truncation is 64 - 1), so lengths run one at a time stay comparable."""
    data = _corpus(tmp_path)
    common = ["--model", str(folder), "--data", str(data), "--stride", "16", "--docs", "2", "--no-progress"]
    joint, alone, short = (tmp_path / f"{n}.json" for n in ("joint", "alone", "short"))
    assert ppl.main(common + ["--lengths", "32,64", "--output", str(joint)]) == 0
    assert ppl.main(common + ["--lengths", "32", "--truncate", "63", "--output", str(alone)]) == 0
    assert ppl.main(common + ["--lengths", "32", "--output", str(short)]) == 0
    capsys.readouterr()
    [at32, _] = json.loads(joint.read_text())["results"]
    [one] = json.loads(alone.read_text())["results"]
    [cut] = json.loads(short.read_text())["results"]
    assert one["tokens"] == at32["tokens"] == 2 * 63 and one["ppl"] == pytest.approx(at32["ppl"], rel=1e-5)
    assert cut["tokens"] == 2 * 31  # without it a lone 32 run scores only each document's first 31 tokens


def _fails(capsys, argv, fragment):
    rc = ppl.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err


def test_cli_bad_inputs(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("pose_mlx.memory.device.available_memory", lambda: (2**30, "a 1 GiB test machine"))
    data = _corpus(tmp_path, n_docs=1, sentences=5)
    base = ["--model", str(folder), "--data", str(data), "--no-progress"]
    _fails(capsys, base + ["--lengths", "4k"], "or pass --allow-beyond-window to measure past it on purpose")
    _fails(capsys, base + ["--lengths", "4k", "--allow-beyond-window"], "the longest has")
    _fails(capsys, base + ["--lengths", "2y"], "--lengths")
    _fails(capsys, base + ["--lengths", "16000k", "--allow-beyond-window"], "than the 1 GiB")
    _fails(capsys, base + ["--lengths", "100000k"], "outside")
    _fails(capsys, base + ["--chunk", "0"], "--chunk")
    _fails(capsys, base + ["--min-doc-tokens", "-5"], "--min-doc-tokens")
    _fails(capsys, base + ["--lengths", "32", "--truncate", "20"], "--truncate 20 is shorter")
    _fails(capsys, base + ["--truncate", "100", "--no-truncate"], "exclude each other")
    _fails(capsys, ["--model", str(tmp_path / "nowhere"), "--data", str(data)], "no such folder or file")
    bare = make_eval_folder(tmp_path / "bare", tokenizer=False)
    _fails(capsys, ["--model", str(bare), "--data", str(data)], "tokenizer")


def test_module_entry_point_short_data_is_one_line(folder, tmp_path):
    import subprocess
    import sys

    data = tmp_path / "short.txt"
    data.write_text("The sky is blue.")
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.perplexity", "--model", str(folder), "--data", str(data),
                           "--lengths", "1k", "--allow-beyond-window"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("pose_mlx.perplexity: error: --data: no document has at least 1023 tokens")
    assert "the longest has" in line
