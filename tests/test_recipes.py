"""Recipes that keep short context: mixed-window training (`--short-share`, after LongRoPE2), the middle-focused
sampler (`--sampler pose-middle`, after CREAM) and YaRN's frequencies without its attention temperature."""


import json
import math
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from _finetune_helpers import ORIGINAL, text_dir, tiny_model  # noqa: F401
from pose_mlx.finetune import main
from pose_mlx.model.patch import extend, use_positions
from pose_mlx.model.source import load as pose_load
from pose_mlx.training.data import ExampleStream, tokenize_corpus
from pose_mlx.training.positions import pose_position_ids
from pose_mlx.rope import scaled_inv_freq

TARGET = 8 * ORIGINAL
L = 24  # tokens per row in the model tests


def _models(tiny_model, schedule="yarn"):
    """(the tiny model extended with `schedule` at 8x, the same weights extended with schedule none)."""
    scheduled, _ = pose_load(tiny_model, apply_schedule=False)
    plain, _ = pose_load(tiny_model, apply_schedule=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(scheduled, schedule, ORIGINAL, TARGET)
        extend(plain, "none", ORIGINAL, TARGET)
    return scheduled, plain


def _batch():
    tokens = mx.array(np.random.default_rng(0).integers(3, 500, size=(2, L)), dtype=mx.int32)
    positions = np.stack([pose_position_ids(L, TARGET, 2, rng=4), np.arange(L)]).astype(np.int32)
    assert positions[0].max() >= ORIGINAL  # the long row really reaches beyond the original window
    return tokens, mx.array(positions)


def _logits(model, tokens, positions, rows=None):
    with use_positions(model, positions, rows):
        return np.array(model(tokens).astype(mx.float32))


def test_a_short_row_rotates_with_the_original_rope_and_a_long_row_with_the_schedule(tiny_model):
    """Row 1 marked short gives the logits of the model extended with schedule none (original frequencies,
    attention factor 1) at the same positions; row 0, unmarked, those of the YaRN model read without a selector;
    swapping the marks swaps the answers."""
    yarn, plain = _models(tiny_model)
    assert yarn.pose_extension.layers[0].attention_factor > 1  # YaRN's temperature is really there to drop
    tokens, positions = _batch()
    want_long = _logits(yarn, tokens, positions)
    want_short = _logits(plain, tokens, positions)
    mixed = _logits(yarn, tokens, positions, mx.array([False, True]))
    np.testing.assert_allclose(mixed[0], want_long[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(mixed[1], want_short[1], atol=1e-5, rtol=0)
    assert not np.allclose(want_long[1], want_short[1], atol=1e-3)  # the two RoPEs differ on row 1
    swapped = _logits(yarn, tokens, positions, np.array([True, False]))
    np.testing.assert_allclose(swapped[0], want_short[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(swapped[1], want_long[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="original_rows"):
        _logits(yarn, tokens, positions, mx.array([True]))


def test_the_row_selector_is_an_input_of_a_compiled_gradient_with_checkpointing(tiny_model):
    """Under mx.compile with the selector passed as an input (as the training loop does) and with every block
    checkpointed, the mixed loss and its gradients equal the average of the two models' per-row losses and
    gradients, for both markings in turn: the selector is read again at each call and stays set for the
    backward pass's recomputation."""
    from mlx.utils import tree_flatten
    from pose_mlx.training.loop import _enable_grad_checkpoint

    yarn, plain = _models(tiny_model)
    tokens, positions = _batch()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ids = positions[:, :-1]

    def loss(model, x, y):
        return nn.losses.cross_entropy(model(x), y).mean()

    def reference(model, row):
        grad = nn.value_and_grad(model, loss)
        with use_positions(model, ids[row:row + 1]):
            return grad(model, inputs[row:row + 1], targets[row:row + 1])

    restore = _enable_grad_checkpoint(yarn)
    try:
        grad = nn.value_and_grad(yarn, loss)

        def step(x, y, pos, rows):
            with use_positions(yarn, pos, rows):
                return grad(yarn, x, y)

        step = mx.compile(step, inputs=yarn.state, outputs=yarn.state)
        for rows in ([False, True], [True, False]):
            value, grads = step(inputs, targets, ids, mx.array(rows))
            parts = [reference(plain if rows[b] else yarn, b) for b in range(2)]
            assert math.isclose(value.item(), (parts[0][0].item() + parts[1][0].item()) / 2, rel_tol=1e-5)
            want = dict(tree_flatten(parts[0][1]))
            other = dict(tree_flatten(parts[1][1]))
            for name, g in tree_flatten(grads):
                np.testing.assert_allclose(np.array(g), (np.array(want[name]) + np.array(other[name])) / 2,
                                           atol=2e-5, rtol=1e-3)
    finally:
        restore()


class _Bytes:
    bos_token_id, eos_token_id = 1, 2

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def get_vocab(self):
        return {f"<{i}>": i + 3 for i in range(256)}


def _corpus(tmp_path, lengths=(60, 90, 150, 70)):
    folder = tmp_path / "docs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k, n in enumerate(lengths):
        (folder / f"{k}.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, size=n - 2)))
    return tokenize_corpus(folder, _Bytes(), tmp_path / "cache", 2, progress=False)


def test_short_share_marks_rows_by_a_seeded_formula(tmp_path):
    """Example k is short iff r_k < F, r = default_rng([seed, 1]).random(...): exact marks for seed 7 and
    F = 0.5, about half of 200 rows; a short row holds positions 0 .. window - 1 over consecutive document
    tokens; a long row follows the PoSE sampler (positions reaching past the window in most rows)."""
    corpus = _corpus(tmp_path)
    window, target, batch, batches = 16, 128, 4, 50
    stream = ExampleStream(corpus, window, target, batch_size=batch, seed=7, short_share=0.5)
    drawn = [stream.next_batch() for _ in range(batches)]
    marks = np.concatenate([b.short for b in drawn])
    want = np.random.default_rng([7, 1]).random(batch * batches) < 0.5
    np.testing.assert_array_equal(marks, want)
    assert 80 <= marks.sum() <= 120  # Binomial(200, 1/2): mean 100, sd 7.1
    skipped = 0
    for b in drawn:
        for row in range(batch):
            if b.short[row]:
                np.testing.assert_array_equal(b.positions[row], np.arange(window - 1))
                doc = np.asarray(corpus.doc(int(b.docs[row])))
                tokens = np.append(b.inputs[row], b.targets[row, -1])
                assert any((doc[v:v + window] == tokens).all() for v in range(len(doc) - window + 1))
            else:
                skipped += int(b.positions[row].max() >= window)
    assert skipped > 0.5 * (~marks).sum()
    plain = ExampleStream(corpus, window, target, batch_size=batch, seed=7)
    assert plain.next_batch().short is None  # F = 0: no marks, the ordinary stream


def test_a_resumed_stream_continues_the_same_marks_and_draws(tmp_path):
    corpus = _corpus(tmp_path)
    make = lambda: ExampleStream(corpus, 16, 128, batch_size=3, seed=2, short_share=0.3)  # noqa: E731
    reference = make()
    expected = [reference.next_batch() for _ in range(6)]
    first = make()
    for _ in range(2):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    for want in expected[2:]:
        got = resumed.next_batch()
        for name in ("inputs", "positions", "docs", "short"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert np.concatenate([b.short for b in expected]).any()


@pytest.mark.parametrize("flags,message", [
    (["--short-share", "1"], "--short-share must be a fraction in [0, 1)"),
    (["--short-share", "-0.1"], "--short-share must be a fraction in [0, 1)"),
    (["--short-share", "nan"], "--short-share must be a fraction in [0, 1)"),
    (["--short-share", "0.5", "--sampler", "plain"], "--short-share"),
    (["--sampler", "pose-middle", "--window", "2"], "pose-middle needs a window of at least 3"),
])
def test_bad_recipe_flags_are_one_line_user_errors(tiny_model, text_dir, tmp_path, capsys, flags, message):
    code = main(["--model", str(tiny_model), "--target", "8x", "--data", str(text_dir),
                 "--output", str(tmp_path / "out"), "--steps", "1", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_mixed_window_run_trains_marked_rows_and_exports_the_schedule(tiny_model, text_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """A checkpointed run with --short-share 0.5 (eager, so the spy can read the arrays; the compiled path is
    tested above) hands every model call the marks of the stream (rows at 0 .. 14 exactly where marked, some of
    each kind) and exports the YaRN model, as a run without it would."""
    import pose_mlx.training.stage as stage

    seen = []
    real = stage.fine_tune

    def spy(model, tokenizer, plan, at_positions):
        def recording(m, ids, short=None):
            seen.append(None if short is None else (np.array(ids), np.array(short)))
            return at_positions(m, ids, short)
        return real(model, tokenizer, plan, recording)

    monkeypatch.setattr(stage, "fine_tune", spy)
    out = tmp_path / "mixed"
    code = main(["--model", str(tiny_model), "--target", "8x", "--schedule", "yarn", "--short-share", "0.5",
                 "--data", str(text_dir), "--output", str(out), "--cache-dir", str(tmp_path / "cache"),
                 "--window", "16", "--batch-size", "4", "--steps", "3", "--lr", "1e-3", "--warmup", "1",
                 "--grad-checkpoint", "--no-compile", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert seen and None not in seen
    marks = np.concatenate([short for _, short in seen])
    assert marks.any() and not marks.all()
    for ids, short in seen:
        for row in np.flatnonzero(short):
            np.testing.assert_array_equal(ids[row], np.arange(15))
    record = json.loads((out / "pose_mlx.json").read_text())
    assert record["schedule"]["schedule"] == "yarn" and record["short_share"] == 0.5
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 8.0


def test_yarn_frequencies_only_keeps_the_frequencies_and_drops_the_temperature(tiny_model, tmp_path):
    """--schedule yarn --schedule-param attention_factor=1: YaRN's interpolated frequencies, attention factor 1;
    exported as mscale 0 (0.1 * 0 * ln s + 1 = 1), which mlx-lm's YaRN reads back to the same logits."""
    from mlx_lm import load

    from pose_mlx.model.export import export_model

    head_dim = 8
    freqs, factor = scaled_inv_freq("yarn", head_dim, 500.0, 8.0, ORIGINAL, attention_factor=1.0)
    yarn_freqs, yarn_factor = scaled_inv_freq("yarn", head_dim, 500.0, 8.0, ORIGINAL)
    np.testing.assert_array_equal(freqs, yarn_freqs)
    assert factor == 1.0 and math.isclose(yarn_factor, 0.1 * math.log(8) + 1)
    model, _ = load(str(tiny_model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extend(model, "yarn", ORIGINAL, TARGET, attention_factor=1.0)
    config = json.loads((tiny_model / "config.json").read_text())
    info = export_model(model, config, tiny_model, tmp_path / "out", record={"steps": 0})
    assert info["mlx_lm_exact"] is True
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    assert written["rope_type"] == "yarn" and written["mscale"] == 0.0
    ids = mx.array([list(range(5, 5 + 3 * ORIGINAL))])
    loaded, _ = load(str(tmp_path / "out"))
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(model(ids)), atol=1e-4, rtol=0)


def test_a_stopped_mixed_window_run_resumes_with_identical_losses(tiny_model, text_dir, tmp_path):
    """SIGTERM mid-run, then --resume: the per-step losses equal an uninterrupted run's (<= 1e-5), so the resumed
    stream continued the same short/long marks and the same draws (the real CLI in subprocesses)."""
    import os
    import signal
    import subprocess

    from _finetune_helpers import read_log
    from test_finetune_resume import STEPS, _cmd, _wait_for_steps

    mixed = ("--short-share", "0.5", "--schedule", "yarn")
    ref = tmp_path / "ref" / "out"
    subprocess.run(_cmd(tiny_model, text_dir, ref, tmp_path / "cache", *mixed), check=True, capture_output=True)
    reference = [r["loss"] for r in read_log(ref / "train_log.jsonl")]
    out = tmp_path / "out"
    log = tmp_path / "out.partial" / "log.jsonl"
    proc = subprocess.Popen(_cmd(tiny_model, text_dir, out, tmp_path / "cache", *mixed), stderr=subprocess.PIPE,
                            text=True)
    _wait_for_steps(proc, log, 10)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()
    assert 10 <= len(read_log(log)) < STEPS, "the stop did not land mid-run"
    done = subprocess.run(_cmd(tiny_model, text_dir, out, tmp_path / "cache", "--resume"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    losses = [r["loss"] for r in read_log(out / "train_log.jsonl")]
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, reference, atol=1e-5, rtol=0)
    assert json.loads((out / "pose_mlx.json").read_text())["short_share"] == 0.5


def test_data_parallel_ranks_split_the_marks_of_the_single_stream(tmp_path):
    """With 2 ranks each keeps its half of the rows the single stream with the doubled batch draws, marks included."""
    corpus = _corpus(tmp_path)
    single = ExampleStream(corpus, 16, 128, batch_size=4, seed=5, short_share=0.5)
    ranks = [ExampleStream(corpus, 16, 128, batch_size=2, seed=5, short_share=0.5, rank=r, world=2)
             for r in range(2)]
    for _ in range(5):
        whole, parts = single.next_batch(), [r.next_batch() for r in ranks]
        for name in ("inputs", "positions", "short"):
            np.testing.assert_array_equal(np.concatenate([getattr(p, name) for p in parts]), getattr(whole, name))
