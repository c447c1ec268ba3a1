"""pose_mlx.eval.cost: the work of a forward pass against hand counts and an mlx-lm model's own parameters, the
shared prefixes of prompts, and the progress bar's estimate line (a fake clock); what `passkey`, `perplexity` and
`ruler` say before they start."""

import pytest

from pose_mlx import memory
from pose_mlx.eval import cost, passkey, perplexity
from pose_mlx.eval.cost import Compute, WorkBar

from conftest import build_model
from _eval_helpers import make_eval_folder

CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5, head_dim=16, tie_word_embeddings=False)


def test_compute_counts_the_blocks_linear_weights_of_the_mlx_lm_model():
    from mlx.utils import tree_flatten

    model = build_model("llama", **{k: v for k, v in CONFIG.items() if k != "model_type"})
    linear = sum(v.size for k, v in tree_flatten(model.parameters())
                 if ".layers." in k and k.endswith("_proj.weight"))  # the independent count
    compute = Compute.of(memory.architecture(CONFIG))
    assert compute.block_parameters == linear
    assert compute.attention == 4 * 16 * 3 and compute.output == 64 * 100


def test_prefill_and_generation_by_hand():
    c = Compute(block_parameters=1000, attention=10, output=7)
    # 3 new tokens after 5 cached: the weights 2*3*1000; the keys seen 6 + 7 + 8 = 21, each 4 x 10 FLOPs
    # (= 2*10*(3^2 + 2*3*5) + 2*10*3, the formula's n^2 standing for n(n+1)/2 x 2); the last logits 2*7
    assert c.prefill(3, 5) == 2 * 3 * 1000 + 2 * 10 * (9 + 30) + 2 * 7
    assert c.prefill(3, 5, logits=3) == c.prefill(3, 5) + 2 * 2 * 7
    assert c.generation(prompt=8, kept=5, answer=2) == c.prefill(3, 5) + c.prefill(1, 8) + c.prefill(1, 9)
    assert Compute.tokens_only().prefill(5, 100) == 10


def test_shared_prefix_follows_length_and_group():
    items = [(100, 0.9), (100, 0.5), (200, 0.8), (200, 0.1), (200, 0.7)]
    assert cost.shared_prefix(items) == [0, 50, 0, 20, 140]
    assert cost.shared_prefix(items, group=lambda i: i == 4) == [0, 50, 0, 20, 0]  # a new group shares nothing


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("first_seconds, printed", [(30.0, True), (5.0, False)])
def test_the_estimate_line_scales_the_first_item_by_the_work_left(first_seconds, printed, capsys):
    """Works 1, 2, 7 (one taken up): the first item that runs takes `first_seconds`, so the other (work 7) is
    estimated at 7x that; said once, only when the whole is above a minute."""
    clock = Clock()
    with WorkBar("passkey", [2.0, 1.0, 7.0], "trial", show=False, clock=clock) as bar:
        clock.now = 100.0  # time spent before the first item that runs does not count
        bar.skip(0)
        clock.now += first_seconds
        bar.done(1)
        clock.now += 7 * first_seconds
        bar.done(2)
    err = capsys.readouterr().err
    if printed:
        assert err == ("passkey: about 3 min 30 s more for the other 1 trials (the first took 30 s; the others "
                       "scaled by their predicted compute)\n")
    else:
        assert err == ""


def test_durations():
    assert [cost.format_duration(s) for s in (0.4, 59, 61, 3599, 3600, 7500)] == [
        "0 s", "59 s", "1 min 1 s", "59 min 59 s", "1 h 0 min", "2 h 5 min"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_eval_folder(tmp_path_factory.mktemp("cost") / "tiny", max_position_embeddings=256)


def test_commands_say_what_will_run_before_they_start(tiny, tmp_path, capsys):
    assert passkey.main(["--model", str(tiny), "--lengths", "100,200", "--trials", "3", "--depths", "3",
                         "--output", str(tmp_path / "pk.json"), "--no-progress"]) == 0
    lines = capsys.readouterr().err.splitlines()
    [plan] = [line for line in lines if line.startswith("passkey: 6 trials")]
    # depths 1, 0.5, 0 (deepest first): the second prompt of a length shares the half before its needle
    assert plan == ("passkey: 6 trials (3 at each of 100, 200 tokens): 900 prompt tokens, about 750 of them "
                    "computed (the rest shared with the prompt before)")
    data = tmp_path / "doc.txt"
    data.write_text(" ".join(f"The sky is blue {i}." for i in range(300)))
    assert perplexity.main(["--model", str(tiny), "--data", str(data), "--lengths", "64,128", "--stride", "32",
                            "--docs", "1", "--output", str(tmp_path / "p.json"), "--no-progress"]) == 0
    [plan] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("perplexity: ")]
    windows = {64: 1 + -(-(127 - 63) // 32), 128: 1}  # 127 tokens scored: windows of 63 inputs every 32, then one
    assert plan == (f"perplexity: {sum(windows.values())} windows of 1 document at 64, 128 tokens: "
                    f"{windows[64] * 64 + 128:,} tokens")


def test_passkey_default_trials_are_a_first_look():
    args = passkey.build_parser().parse_args(["--model", "m"])
    assert args.trials == passkey.DEFAULT_TRIALS == 10
    assert "standard error" in passkey.build_parser().format_help()
