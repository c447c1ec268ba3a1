"""Unit tests of the fine-tuning pieces: the length grammar, schedule parameters, LR schedule, masked loss,
checkpoints."""


import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from pose_mlx.training.checkpoint import load_checkpoint, read_state, save_checkpoint
from pose_mlx.errors import UserError
from pose_mlx.lengths import parse_length as parse_target, parse_lengths
from pose_mlx.settings import parse_param
from pose_mlx.training.loop import TrainConfig, learning_rate_schedule, make_optimizer, masked_loss


@pytest.mark.parametrize("text, original, expected", [
    ("32768", None, 32768), ("32k", None, 32768), ("32K", None, 32768), ("1.5k", None, 1536),
    ("8x", 4096, 32768), ("2.5x", 1000, 2500), (" 4k ", None, 4096),
])
def test_parse_target(text, original, expected):
    assert parse_target(text, original) == expected


@pytest.mark.parametrize("text", ["32q", "", "k", "-4k", "1.3k", "8x8", "0", "1", "1e12", "99999999999"])
def test_parse_target_rejects(text):
    with pytest.raises(UserError, match="--target"):
        parse_target(text, 4096)


def test_parse_target_relative_needs_original():
    with pytest.raises(UserError, match="--original"):
        parse_target("8x", None)


def test_parse_lengths_shares_the_grammar():
    assert parse_lengths("2k, 1x,8192,2048", original=1000) == [1000, 2048, 8192]
    for bad in ("", "2k,,4k", "2k,x"):
        with pytest.raises(UserError, match="--lengths"):
            parse_lengths(bad, 1000)


def test_parse_param():
    assert parse_param("beta_fast=32") == ("beta_fast", 32)
    assert parse_param("blend=wavelength") == ("blend", "wavelength")
    assert parse_param("long_factor=[1, 2.5]") == ("long_factor", [1, 2.5])
    # Python spellings (as --help prints defaults) must not become truthy strings like "False"
    assert parse_param("truncate=False") == ("truncate", False)
    assert parse_param("truncate=true") == ("truncate", True)
    assert parse_param("attention_factor=None") == ("attention_factor", None)
    with pytest.raises(UserError, match="^--schedule-param 'novalue' must look like key=value$"):
        parse_param("novalue")


@pytest.mark.parametrize("lr, warmup, steps", [(1e-3, 4, 12), (2e-5, 10, 1000), (1.0, 0, 5), (1.0, 1, 5),
                                             (1.0, 5, 5), (1.0, 10, 5), (1.0, 3, 1)])
def test_learning_rate_schedule(lr, warmup, steps):
    """Update k gets lr*(k+1)/warmup during warm-up, then lr*(steps-k)/(steps-warmup): never 0, peak lr. A warm-up
    of at least `steps` updates is cut to steps - 1, so the last update still reaches the peak."""
    schedule = learning_rate_schedule(lr, warmup, steps)
    warmup = min(warmup, steps - 1)
    for k in range(steps):
        expected = lr * (k + 1) / warmup if k < warmup else lr * (steps - k) / (steps - warmup)
        assert math.isclose(float(schedule(mx.array(k))), expected, rel_tol=1e-4, abs_tol=1e-6 * lr), k
    assert float(schedule(mx.array(steps - 1))) > 0


def test_masked_loss_matches_numpy():
    """Mean token cross-entropy over mask==1 positions, computed independently with NumPy log-softmax."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)

    class Fixed(nn.Module):
        def __call__(self, x):
            return mx.array(logits)

    targets = rng.integers(0, 7, size=(2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    expected = (nll * mask).sum() / mask.sum()
    got = masked_loss(Fixed(), mx.zeros((2, 5), mx.int32), mx.array(targets), mx.array(mask))
    assert abs(got.item() - expected) < 1e-5


def test_bad_training_values_are_refused_as_settings():
    """The one validation path: the run's settings refuse them with a UserError naming the flag; TrainConfig,
    built from validated settings, only asserts its contract."""
    from pose_mlx.settings import RunSettings, validate

    for flag, changes in (("--steps", {"steps": 0}), ("--lr", {"lr": 0.0}), ("--warmup", {"warmup": -1}),
                          ("--grad-accum", {"grad_accum": 0}), ("--save-every", {"save_every": -1})):
        with pytest.raises(UserError, match=f"^{flag} must be"):
            validate(RunSettings(model="m", **changes))
    with pytest.raises(AssertionError):
        TrainConfig(steps=0)


def test_checkpoint_roundtrip_restores_weights_and_optimizer(tmp_path):
    """Save after two updates, perturb everything, load: weights, Adam moments, step return."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config

    model = build_model(model_config(64, hidden_size=16, num_layers=2, num_heads=2), seed=0)
    model.freeze()
    linear_to_lora_layers(model, 1, {"rank": 2, "scale": 1.0, "dropout": 0.0})  # only the last block
    opt = make_optimizer(TrainConfig(steps=10, lr=1e-2, warmup=0))
    grad_fn = nn.value_and_grad(model, lambda m, x: m(x).astype(mx.float32).square().mean())
    for _ in range(2):
        _, g = grad_fn(model, mx.array([[1, 2, 3]]))
        opt.update(model, g)
    mx.eval(model.parameters(), opt.state)
    weights = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    state = {k: np.array(v) for k, v in tree_flatten(opt.state)}
    save_checkpoint(tmp_path, 2, model, opt, {"position": 7}, metrics={"loss": 1.5})

    model.update(tree_map(lambda p: p + 1.0, model.trainable_parameters()))
    fresh = make_optimizer(TrainConfig(steps=10, lr=1e-2, warmup=0))
    record = load_checkpoint(tmp_path, model, fresh)
    assert record["step"] == 2 and record["data"] == {"position": 7} and record["metrics"]["loss"] == 1.5
    for k, v in tree_flatten(model.trainable_parameters()):
        np.testing.assert_array_equal(np.array(v), weights[k])
    restored = {k: np.array(v) for k, v in tree_flatten(fresh.state)}
    assert restored.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(restored[k], state[k])
    # one more update from the restored optimizer continues the same step count
    _, g = grad_fn(model, mx.array([[1, 2, 3]]))
    fresh.update(model, g)
    assert int(fresh.state["step"].item()) == 3


def _small(tmp_path):
    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config

    model = build_model(model_config(64, hidden_size=16, num_layers=1, num_heads=2), seed=0)
    opt = make_optimizer(TrainConfig(steps=10, lr=1e-2, warmup=0))
    opt.init(model.trainable_parameters())
    return model, opt


def test_checkpoint_keeps_the_previous_one_and_nothing_older(tmp_path):
    """Three saves leave the newest pair (named by state.json) and the one before it (named by previous.json)."""
    model, opt = _small(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["optimizer-2.safetensors", "optimizer-3.safetensors", "previous.json", "state.json",
                     "weights-2.safetensors", "weights-3.safetensors"]
    assert read_state(tmp_path)["step"] == 3
    assert json.loads((tmp_path / "previous.json").read_text())["step"] == 2
    assert read_state(tmp_path / "missing") is None


def test_flipped_byte_in_a_checkpoint_is_named_and_the_previous_one_offered(tmp_path):
    """One flipped byte in the newest weights file: resume refuses, naming the file and the intact step before."""
    model, opt = _small(tmp_path)
    save_checkpoint(tmp_path, 1, model, opt, {})
    save_checkpoint(tmp_path, 2, model, opt, {})
    weights = tmp_path / "weights-2.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="weights-2.safetensors .step 2. is damaged") as info:
        load_checkpoint(tmp_path, model, opt)
    assert "previous checkpoint (step 1) is intact" in str(info.value)
    (tmp_path / "previous.json").replace(tmp_path / "state.json")  # the fallback the message describes
    assert load_checkpoint(tmp_path, model, opt)["step"] == 1


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    from pose_mlx.training.checkpoint import NonFiniteWeights

    model, opt = _small(tmp_path)
    save_checkpoint(tmp_path, 1, model, opt, {})
    key = next(k for k, _ in tree_flatten(model.trainable_parameters()))
    model.load_weights([(key, mx.full(dict(tree_flatten(model.parameters()))[key].shape, float("nan")))],
                       strict=False)
    with pytest.raises(NonFiniteWeights, match="^a trainable parameter is not finite at step 2$"):
        save_checkpoint(tmp_path, 2, model, opt, {})
    assert read_state(tmp_path)["step"] == 1 and not (tmp_path / "weights-2.safetensors").exists()


@pytest.mark.parametrize("grad_accum, checkpoint, lora", [(1, False, False), (2, True, False), (1, False, True)])
def test_compiled_update_equals_eager(grad_accum, checkpoint, lora):
    """`make_update` under mx.compile takes the same steps as the eager path without checkpointing: same losses,
    grad norms, weights (PoSE positions change every batch, so they must be a compiled argument, not a traced-in
    constant; with gradient checkpointing they must still be set when the backward pass re-runs the forward)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from pose_mlx import extend, use_positions
    from pose_mlx.training.data import ExampleStream, TokenizedCorpus
    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config
    from pose_mlx.training.loop import _enable_grad_checkpoint, make_update

    tokens = np.random.default_rng(0).integers(3, 64, size=4 * 200).astype(np.int32)
    corpus = TokenizedCorpus(tokens, np.arange(5, dtype=np.int64) * 200, np.arange(4), "t", {})
    runs = {}
    for compiled, ckpt in ((False, False), (True, checkpoint), (False, checkpoint)):
        model = build_model(model_config(64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16),
                            seed=0)
        extend(model, "linear", 16, 128)
        if lora:
            mx.random.seed(0)
            model.freeze()
            linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
        restore = _enable_grad_checkpoint(model) if ckpt else None
        config = TrainConfig(steps=6, lr=3e-3, warmup=1, grad_accum=grad_accum, compile=compiled, progress=False)
        update = make_update(model, make_optimizer(config), config, use_positions)
        batches = iter(ExampleStream(corpus, 16, 128, chunks=3, batch_size=2, seed=1))
        runs[compiled, ckpt] = [update(batches) for _ in range(6)], dict(tree_flatten(model.trainable_parameters()))
        if restore:
            restore()
    eager, w_eager = runs[False, False]
    for key in ((True, checkpoint), (False, checkpoint)):
        other, w_other = runs[key]
        np.testing.assert_allclose(np.array(other)[:, :2], np.array(eager)[:, :2], atol=1e-5, rtol=1e-5)
        assert [r.tokens for r in other] == [r.tokens for r in eager] == [2 * 15 * grad_accum] * 6
        for name, value in w_eager.items():
            np.testing.assert_allclose(np.array(w_other[name]), np.array(value), atol=1e-5, rtol=0, err_msg=name)


def test_loss_depends_on_position_ids_only_through_relative_distances():
    """The training loss sees the position ids: a skip inside the window changes it, shifting every id by the same
    amount does not (RoPE is relative), and a model whose positions are ignored would fail both."""
    from pose_mlx import extend, use_positions
    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config
    from pose_mlx.training.data import collate
    from pose_mlx.training.loop import probe_loss

    model = build_model(model_config(64, hidden_size=32, num_layers=2, num_heads=4), seed=2)
    extend(model, "linear", 16, 128)
    tokens = np.random.default_rng(5).integers(3, 64, size=17).astype(np.int32)
    ones = np.ones(16, dtype=np.float32)

    def loss(positions):
        return probe_loss(model, collate([(tokens, np.asarray(positions), ones)], [0]), use_positions)

    contiguous = loss(np.arange(17))
    assert loss(np.arange(17) + 40) == pytest.approx(contiguous, abs=1e-5)
    assert abs(loss(np.concatenate([np.arange(8), np.arange(9) + 60])) - contiguous) > 1e-4


# ------------------------------------------------------------------------------------------ collapse check


def test_collapse_ceiling_is_decided_from_the_starting_loss():
    """Hand-computed: u = ln 97, m = 10% of u. A model that knew something (start below u - m) is collapsed back at
    u; one that began at the guess only well above its own start (or the guess, whichever is higher)."""
    from pose_mlx.training.loop import COLLAPSE_MARGIN, collapse_ceiling

    u = math.log(97)
    m = COLLAPSE_MARGIN * u
    assert COLLAPSE_MARGIN == 0.1
    assert collapse_ceiling(2.0, 97) == u  # pre-trained: back at the guess is collapse
    assert collapse_ceiling(u - m - 1e-6, 97) == u
    assert collapse_ceiling(u - m / 2, 97) == pytest.approx(u + m)  # barely below the guess: noise allowed
    assert collapse_ceiling(u, 97) == pytest.approx(1.1 * u)
    assert collapse_ceiling(u + 0.3, 97) == pytest.approx(u + 0.3 + m)  # a random model starting above the guess
    assert collapse_ceiling(float("nan"), 97) == u


def _random_model_and_probe():
    from pose_mlx.model.source import build_model
    from pose_mlx.toy import model_config
    from pose_mlx.training.data import collate

    model = build_model(model_config(97, hidden_size=32, num_layers=2, num_heads=4), seed=1)
    rng = np.random.default_rng(7)
    rows = [(rng.integers(3, 97, size=33).astype(np.int32), np.arange(33), np.ones(32, dtype=np.float32))
            for _ in range(4)]
    return model, collate(rows, [0, 1, 2, 3])


def _positions(model, ids):
    """Contiguous ids: the model's own positions (no schedule to apply)."""
    import contextlib

    return contextlib.nullcontext()


def test_a_healthy_random_model_at_the_uniform_guess_is_not_collapsed():
    """A tiny random model starts at about ln(vocab) or above; a short healthy run (or TF32 rounding on a GPU) moves its
    probe loss by hundredths of a nat, up or down. Judged from its own start, that is not a collapse, even though
    the loss is above both the start and the uniform guess (which the rule `loss >= ln V and loss > start` flagged)."""
    from pose_mlx.training.loop import check_not_collapsed, probe_loss

    model, probe = _random_model_and_probe()
    start = probe_loss(model, probe, _positions)
    assert start >= math.log(97)  # a random model: no better than the guess (random logits put it a little above)
    for moved in (-0.05, 0.0, 0.05):  # the same model judged against a start slightly above or below its loss now
        check_not_collapsed(model, probe, _positions, before=start - moved, step=8)


def test_real_collapses_are_caught():
    """Loss exploding against the start, a non-finite loss, a pre-trained model fallen back to the guess, and
    logits blind to the input are all `Collapsed`."""
    from pose_mlx.training.loop import Collapsed, check_not_collapsed, probe_loss

    model, probe = _random_model_and_probe()
    start = probe_loss(model, probe, _positions)
    with pytest.raises(Collapsed, match="far above where it started"):  # a model at the guess that blew up
        head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
        saved = head.weight
        head.weight = saved * 30
        check_not_collapsed(model, probe, _positions, before=start, step=3)
    head.weight = saved
    with pytest.raises(Collapsed, match="no better than a uniform guess"):  # it had learned (start 1.5), now at u
        check_not_collapsed(model, probe, _positions, before=1.5, step=3)
    with pytest.raises(Collapsed, match="whatever its input"):  # finite, normal-sized loss, but input-blind
        blind = model.model.norm.weight
        model.model.norm.weight = mx.zeros_like(blind)
        check_not_collapsed(model, probe, _positions, before=start, step=3)
    model.model.norm.weight = blind
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = mx.full(layer.weight.shape, float("nan"))
    with pytest.raises(Collapsed, match="to nan"):
        check_not_collapsed(model, probe, _positions, before=start, step=3)


def test_progress_bar_says_it_compiles_until_the_first_update(capsys):
    """With mx.compile the bar names the first update's tracing (it can take ~90 s on a fresh GPU) and drops the
    words once that update is done; eager runs say nothing of it."""
    from pose_mlx.training.loop import _Progress

    bar = _Progress(True, 3, 0, compiling=True)
    assert bar.bar.desc.startswith("compiling the training step")
    bar.update({"loss": 1.0, "tokens_per_s": 10.0, "peak_memory_gb": 0.1}, None)
    assert bar.bar.desc == ""
    bar.close()
    eager = _Progress(True, 3, 0)
    assert eager.bar.desc == ""
    eager.close()
    capsys.readouterr()
