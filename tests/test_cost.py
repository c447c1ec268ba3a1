"""pose_mlx.eval.cost: the work of a forward pass against hand counts and an mlx-lm model's own parameters, the
shared prefixes of prompts, the progress bar within an item and its estimate line (a fake clock); what `passkey`,
`perplexity` and `ruler` say before they start."""

import json

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
def test_the_estimate_line_scales_the_work_measured_by_the_work_left(first_seconds, printed, capsys):
    """Works 2, 1, 7 (the first taken up): the first item that runs (work 1) takes `first_seconds`, so the other
    (work 7) is estimated at 7x that; said once, only when the whole is above a minute."""
    clock = Clock()
    with WorkBar("passkey", [2.0, 1.0, 7.0], "trial", show=False, clock=clock) as bar:
        clock.now = 100.0  # time spent before the first item that runs does not count
        bar.skip(0)
        clock.now += first_seconds / 2
        bar.within(1, 0.5)  # under ESTIMATE_AFTER_S measured (30 / 2 = 15 s is not): no estimate from half an item
        clock.now += first_seconds / 2
        bar.done(1)
        clock.now += 7 * first_seconds
        bar.done(2)
    err = capsys.readouterr().err
    if printed:  # measured 15 s for half of item 1 (work 0.5 of 8): 7.5 more
        assert err == ("passkey: about 3 min 45 s more, 4 min 0 s in all for 2 trials (the first 6% of the predicted "
                       "work took 15 s; the rest scaled by its predicted compute)\n")
    else:
        assert err == ""


def test_one_long_item_shows_its_progress_and_estimate_from_within(capsys):
    """One 16k passkey trial showed "passkey 0/1 trials: 0%" for 4 min 40 s, then "about 0 s more for the other 0
    trials". Its prefill moves the bar (and its ETA) chunk by chunk, with the tokens read; the estimate comes once
    ESTIMATE_AFTER_S seconds of it are measured, for the one trial."""
    clock, compute = Clock(), Compute(block_parameters=1000, attention=10, output=7)
    bar = WorkBar("passkey", [compute.generation(16384, 0, 10)], "trial", show=True, clock=clock)
    fed = bar.reading(0, compute, 16384, "16384 tokens", answer=10)
    clock.now = 4.0
    fed(512, 16384)
    assert bar.bar.postfix == "16384 tokens: 512/16,384 read" and 0 < bar.bar.n < bar.bar.total
    assert str(bar.bar).startswith("passkey 0/1 trial:  ") and "<" in str(bar.bar)  # an ETA once a chunk is in
    share = compute.prefill(1024, 0) / compute.generation(16384, 0, 10)
    clock.now = cost.ESTIMATE_AFTER_S
    fed(1024, 16384)
    assert bar.bar.n == pytest.approx(share * bar.bar.total)
    clock.now = 600.0
    bar.done(0, "16384 tokens")
    bar.close()
    err = capsys.readouterr().err
    left = (1 - share) * cost.ESTIMATE_AFTER_S / share
    [line] = [line for line in err.split("\r") + err.split("\n") if line.startswith("passkey: about")]
    assert line.startswith(f"passkey: about {cost.format_duration(left)} more, "
                           f"{cost.format_duration(left + cost.ESTIMATE_AFTER_S)} in all for 1 trial (the first ")
    assert "other 0" not in err and "passkey 1/1 trial: 100%" in err


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


def test_a_tiny_model_run_moves_the_bar_within_each_trial(tiny, tmp_path, capsys, monkeypatch):
    """A real passkey run (chunk 32): each trial's prefill reports each chunk, with the prompt's tokens read, before
    the trial ends; perplexity's windows too; nothing says "the other 0"."""
    seen = []
    within = WorkBar.within
    monkeypatch.setattr(WorkBar, "within", lambda self, i, share, note="": (seen.append((i, share, note)),
                                                                           within(self, i, share, note))[1])
    assert passkey.main(["--model", str(tiny), "--lengths", "200", "--trials", "1", "--chunk", "32",
                         "--output", str(tmp_path / "pk.json")]) == 0
    prompt = json.loads((tmp_path / "pk.json").read_text())["trials"][0]["prompt_tokens"]
    read = [int(note.split(": ")[1].split("/")[0].replace(",", "")) for _i, _s, note in seen]
    assert read == list(range(32, prompt, 32)) + [prompt]  # every chunk, the last one the whole prompt
    assert all(note.endswith(f"/{prompt:,} read") and note.startswith("200 tokens: ") for _i, _s, note in seen)
    shares = [share for _i, share, _n in seen]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] < 1  # the answer's tokens are still to come
    err = capsys.readouterr().err
    assert "passkey 1/1 trial: 100%" in err and "other 0" not in err
    seen.clear()
    data = tmp_path / "doc.txt"
    data.write_text(" ".join(f"The sky is blue {i}." for i in range(300)))
    assert perplexity.main(["--model", str(tiny), "--data", str(data), "--lengths", "128", "--stride", "127",
                            "--docs", "1", "--chunk", "32", "--output", str(tmp_path / "p.json")]) == 0
    assert [note for _i, _s, note in seen] == [f"128 tokens: {n}/128 read" for n in (32, 64, 96)]
    assert "perplexity 1/1 window: 100%" in capsys.readouterr().err


def test_passkey_default_trials_are_a_first_look():
    args = passkey.build_parser().parse_args(["--model", "m"])
    assert args.trials == passkey.DEFAULT_TRIALS == 10
    assert "standard error" in passkey.build_parser().format_help()
