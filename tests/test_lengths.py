"""The length grammar on every flag that counts tokens: `8192`, `8k`, `8K`, `1.5k`; `8x` only where a length is
relative to the original window (`--target`, `--lengths`)."""

import argparse

import pytest

from pose_mlx.errors import UserError
from pose_mlx.eval import passkey, perplexity, ruler
from pose_mlx.lengths import parse_length, tokens
from pose_mlx.settings import parse_invocation


@pytest.mark.parametrize("text, expected", [("8192", 8192), ("8k", 8192), ("8K", 8192), ("1.5k", 1536),
                                            (" 32768 ", 32768), ("1k", 1024), ("0", 0)])
def test_tokens_reads_the_grammar(text, expected):
    assert tokens(text) == expected


@pytest.mark.parametrize("text, reason", [("2x", "not a number of tokens"), ("8m", "not a number of tokens"),
                                          ("-4", "not a number of tokens"), ("1.3k", "not a whole number"),
                                          ("", "not a number of tokens")])
def test_tokens_refuses_factors_and_junk(text, reason):
    with pytest.raises(argparse.ArgumentTypeError, match=reason):
        tokens(text)


def test_target_keeps_factors():
    assert parse_length("2x", original=4096) == 8192 and parse_length("32K") == 32768


def test_finetune_token_flags_take_the_grammar(tmp_path):
    """--window 1k and --original 8k (refused as `invalid int value: '1k'` before) and --min-length 2K."""
    s = parse_invocation(["--model", "m", "--target", "4x", "--window", "1k", "--original", "8k",
                          "--min-length", "2K"]).settings
    assert (s.window, s.original, s.min_length) == (1024, 8192, 2048)
    config = tmp_path / "run.yaml"
    config.write_text("window: 1.5k\noriginal: 4096\n")
    s = parse_invocation(["--model", "m", "--config", str(config)]).settings
    assert (s.window, s.original) == (1536, 4096)


def test_a_factor_is_refused_where_no_original_window_applies(tmp_path):
    with pytest.raises(UserError, match=r"argument --window: '2x' is not a number of tokens: use e\.g\. 8192, 8k"):
        parse_invocation(["--model", "m", "--window", "2x"])
    config = tmp_path / "run.yaml"
    config.write_text("window: 2x\n")
    with pytest.raises(UserError, match=r"--config .*run\.yaml: window '2x' is not a number of tokens"):
        parse_invocation(["--model", "m", "--config", str(config)])


@pytest.mark.parametrize("module, argv, expected", [
    (passkey, ["--original", "4k", "--chunk", "1k"], {"original": 4096, "chunk": 1024}),
    (perplexity, ["--data", "d", "--stride", "1k", "--min-doc-tokens", "2k", "--truncate", "8K"],
     {"stride": 1024, "min_doc_tokens": 2048, "truncate": 8192}),
    (ruler, ["--original", "8k", "--chunk", "512", "--max-new-tokens", "0.5k"],
     {"original": 8192, "chunk": 512, "max_new_tokens": 512}),
])
def test_evaluator_token_flags_take_the_grammar(module, argv, expected):
    args = vars(module.build_parser().parse_args(["--model", "m", *argv]))
    assert {k: args[k] for k in expected} == expected


def test_the_lengths_grammar_before_loading_reads_factors_of_any_window():
    """`--lengths 1x` was refused before the model was loaded ("'1x' = 1 tokens is outside [2, ...]": the grammar
    was checked against a window of 1): `x` items wait for the model's window; the rest is checked at once."""
    from pose_mlx.lengths import check_lengths, parse_lengths

    for text in ("1x", "0.5x,2k", "1x,4x", "1.5x"):
        check_lengths(text)
    assert parse_lengths("1x,4x", 256) == [256, 1024]
    for text, reason in (("1x;2k", "is not a length"), ("1x,,2k", "empty item"), ("1.5", "whole number"),
                         ("100000k", "outside"), (" , ", "no length given")):
        with pytest.raises(UserError, match=reason):
            check_lengths(text)
