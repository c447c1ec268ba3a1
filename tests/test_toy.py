"""pose_mlx.toy: offline model folders load through mlx-lm and reproduce the model and tokenizer that made them."""


import importlib.util
import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import sentencepiece as spm
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import load as load_tokenizer

from pose_mlx import toy
from pose_mlx.model.source import build_model

TRAIN_CHARS = 300_000


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = toy.stdlib_texts(max_chars=TRAIN_CHARS)
    return toy.train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(scope="module")
def held_out():
    """Standard-library files far from the training slice (sorted last), plus edge cases."""
    texts = toy.stdlib_texts(include_tests=False)[-6:]
    return texts + [
        "def f(x):\n    return x + 1234567890  # digits\n",
        "\n\n\t  mixed\t whitespace  \n   ",
        " leading space", "trailing space ", "a  b   c",
        "unicode: é ü ß € 漢字 😀\n",
        "literal specials <s> </s> <unk> stay text",
        "",
    ]


def test_stdlib_texts_selection():
    texts = toy.stdlib_texts()
    assert toy.stdlib_texts() == texts  # deterministic
    assert toy.stdlib_texts(max_files=5) == texts[:5]
    # a module's own source file is in the corpus; site-packages files are not
    argparse_source = Path(importlib.util.find_spec("argparse").origin).read_text(encoding="utf-8")
    assert argparse_source in texts
    site = Path(sysconfig.get_paths()["stdlib"]) / "site-packages"
    foreign = [p for p in sorted(site.rglob("*.py"))[:200] if p.stat().st_size > 2000] if site.is_dir() else []
    for path in foreign[:5]:
        assert path.read_text(encoding="utf-8", errors="replace") not in texts
    long_ = toy.stdlib_texts(min_chars=20_000)
    assert long_ and all(len(t) >= 20_000 for t in long_)
    assert long_ == [t for t in texts if len(t) >= 20_000]
    sliced = toy.stdlib_texts(max_chars=50_000)
    assert sum(map(len, sliced[:-1])) < 50_000 <= sum(map(len, sliced))
    # test suites are optional
    support = Path(importlib.util.find_spec("test.support").origin).read_text(encoding="utf-8")
    assert support in texts
    assert support not in toy.stdlib_texts(include_tests=False)
    with pytest.raises(ValueError, match="max_files"):
        toy.stdlib_texts(max_files=-1)


def test_tokenizer_matches_sentencepiece_and_round_trips(tok_dir, held_out):
    wrapper = load_tokenizer(Path(tok_dir))
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    assert len(wrapper._tokenizer) == sp.get_piece_size() == 512
    assert (wrapper.unk_token_id, wrapper.bos_token_id, wrapper.eos_token_id) == (0, 1, 2)
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    for text in held_out:
        ids = wrapper.encode(text)
        assert ids == sp.encode(text), text[:60]
        assert wrapper.decode(ids) == text, text[:60]
        detok = wrapper.detokenizer  # the streaming path mlx_lm.generate uses
        for i in ids:
            detok.add_token(i)
        detok.finalize()
        assert detok.text == text, text[:60]


def test_tokenizer_pieces(tok_dir):
    wrapper = load_tokenizer(Path(tok_dir))
    newline = wrapper.encode("\n")
    assert len(newline) == 1 and wrapper.encode("a\nb").count(newline[0]) == 1
    # split digits: every piece of a number holds at most one digit
    pieces = wrapper.convert_ids_to_tokens(wrapper.encode("x = 31415926535 + 27182818"))
    assert all(sum(c.isdigit() for c in p) <= 1 for p in pieces)
    # byte fallback: an unseen character becomes its UTF-8 bytes, never <unk>
    ids = wrapper.encode("\U0001F600")
    assert 0 not in ids and wrapper.convert_ids_to_tokens(ids) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    # encoding adds nothing (no BOS/EOS)
    assert wrapper.encode("x")[0] != wrapper.bos_token_id and wrapper.encode("") == []


def test_tokenizer_training_is_deterministic(tok_dir, tmp_path):
    again = toy.train_tokenizer(toy.stdlib_texts(max_chars=TRAIN_CHARS), tmp_path, vocab_size=512)
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert (again / "tokenizer.model").read_bytes() == (tok_dir / "tokenizer.model").read_bytes()


def test_make_model_folder_loads_with_mlx_lm(tok_dir, tmp_path):
    folder = toy.make_model_folder(tmp_path / "m", tokenizer_from=tok_dir, hidden_size=64, num_layers=2,
                                   num_heads=4, num_kv_heads=2, max_position_embeddings=256, rope_theta=500.0,
                                   seed=7, extra_config={"rms_norm_eps": 1e-6})
    config = json.loads((folder / "config.json").read_text())
    expected = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rope_theta=500.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    assert {k: config[k] for k in expected} == expected
    model, tokenizer = mlx_lm.load(str(folder))
    # independent rebuild: mlx-lm's llama with the written config and the same seed
    mx.random.seed(7)
    reference = llama.Model(llama.ModelArgs.from_dict(config))
    tokens = mx.array(np.random.default_rng(0).integers(0, 512, size=(2, 40)))
    np.testing.assert_allclose(np.array(model(tokens)), np.array(reference(tokens)), atol=1e-5, rtol=0)
    assert tokenizer.eos_token_ids == {2}


def test_save_model_folder_round_trip_and_generation(tok_dir, tmp_path):
    config = toy.model_config(512, hidden_size=32, num_layers=2, num_heads=2, rope_theta=300.0,
                              tie_word_embeddings=False)
    model = build_model(config, seed=3)
    folder = toy.save_model_folder(model, config, tok_dir, tmp_path / "saved")
    loaded, tokenizer = mlx_lm.load(str(folder))
    tokens = mx.array(np.random.default_rng(1).integers(0, 512, size=(1, 64)))
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), atol=1e-5, rtol=0)

    # greedy decoding through mlx-lm (KV cache) == argmax of full forward passes of the in-memory model
    prompt = tokenizer.encode("def main():\n    ")
    steps = 8
    cached = [int(t) for t, _ in generate_step(mx.array(prompt), loaded, max_tokens=steps)]
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    assert cached == seq[len(prompt):]
    # the text path generates the same tokens (its detokenizer is checked against the text in the tokenizer test)
    streamed = [r.token for r in mlx_lm.stream_generate(loaded, tokenizer, "def main():\n    ", max_tokens=steps)]
    assert streamed == cached[: len(streamed)] and streamed


def test_weights_are_seeded(tok_dir, tmp_path):
    def weights(name, seed):
        folder = toy.make_model_folder(tmp_path / name, tokenizer_from=tok_dir, seed=seed)
        return mx.load(str(folder / "model.safetensors"))

    a, b, c = weights("a", 0), weights("b", 0), weights("c", 1)
    assert a.keys() == b.keys() == c.keys() and "lm_head.weight" not in a  # tied embeddings
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not mx.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"]).item()


def test_make_model_folder_trains_its_own_tokenizer(tmp_path):
    texts = toy.stdlib_texts(max_chars=100_000)
    folder = toy.make_model_folder(tmp_path, texts=texts, vocab_size=400, hidden_size=16, num_heads=2)
    assert (folder / "tokenizer.model").is_file()
    model, tokenizer = mlx_lm.load(str(folder))
    assert model.args.vocab_size == 400 == len(tokenizer._tokenizer)
    assert model.args.intermediate_size >= 8 * 16 / 3


@pytest.mark.parametrize("kwargs, word", [
    (dict(hidden_size=30, num_heads=4), "num_heads"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(hidden_size=24, num_heads=8), "even"),
    (dict(num_layers=0), "num_layers"),
    (dict(texts=["x"]), "tokenizer_from or texts"),
])
def test_bad_arguments(tok_dir, tmp_path, kwargs, word):
    with pytest.raises(ValueError, match=word):
        toy.make_model_folder(tmp_path, tokenizer_from=tok_dir, **kwargs)


def test_bad_tokenizer_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        toy.train_tokenizer(["some text"], tmp_path, vocab_size=200)
    with pytest.raises(ValueError, match="texts"):
        toy.train_tokenizer([], tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        toy.make_model_folder(tmp_path / "m", tokenizer_from=tmp_path / "empty")
