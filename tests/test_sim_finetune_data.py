"""The simulator's fine-tuning data (`pose_mlx.sim.finetune_data`), its seed statistics and its per-position NLL
curves, against hand-computed values and independent computations."""

import json

import mlx.core as mx
import numpy as np
import pytest

from pose_mlx.sim import claims, finetune_data, position_nll
from pose_mlx.training.data import ExampleStream, tokenize_corpus
from pose_mlx.training.positions import sample_example


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A toy model folder with a trained sentencepiece tokenizer, and a training folder of text files."""
    from mlx_lm.utils import load_tokenizer

    from pose_mlx import toy
    from pose_mlx.sim.corpus import build_corpus

    root = tmp_path_factory.mktemp("ftdata")
    build_corpus(root / "corpus", None, 300_000, 1, 300, 0.02, 400, 0, None)
    toy.make_model_folder(root / "model", tokenizer_from=root / "corpus" / "tokenizer", hidden_size=32,
                          num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64,
                          rope_theta=200.0, seed=0)
    return root, load_tokenizer(root / "model")


@pytest.mark.parametrize("length", [128, 256])
def test_retrieval_documents_have_exactly_the_example_length_and_the_share(small, tmp_path, length):
    root, tokenizer = small
    folder = finetune_data.build(tmp_path / "data", root / "corpus" / "train", tokenizer, tmp_path / "cache", length,
                                 0.2, seed=0)
    train_files = sorted(p.name for p in (root / "corpus" / "train").iterdir())
    assert sorted(p.name for p in folder.iterdir() if p.is_symlink()) == train_files
    docs = [json.loads(line)["text"] for line in (folder / finetune_data.RETRIEVAL_FILE).read_text().splitlines()]
    text_docs = tokenize_corpus(root / "corpus" / "train", tokenizer, tmp_path / "cache", length, progress=False)
    assert len(docs) == round(0.25 * text_docs.num_docs) > 0  # K = f / (1 - f) x eligible documents
    mixed = tokenize_corpus(folder, tokenizer, tmp_path / "cache", length, progress=False)
    lengths = np.asarray(mixed.lengths)
    assert mixed.num_docs == text_docs.num_docs + len(docs)
    assert (lengths == length).sum() >= len(docs)  # every retrieval document: BOS + text + EOS = length tokens
    # the share of documents drawn uniformly: f, up to the rounding of K
    assert abs(len(docs) / mixed.num_docs - 0.2) <= 0.5 / mixed.num_docs
    for doc in docs:
        assert finetune_data.framed_length(tokenizer, doc) == length
        assert "pass key" not in doc and "passkey" not in doc


def test_a_pose_example_of_an_exact_length_document_is_the_whole_document():
    """No slack: every content offset v_i is 0, so needle, question and answer stay in the example."""
    for seed in range(50):
        example = sample_example(128, 128, 1024, "pose", 2, "uniform", rng=seed)
        assert example.token_index().tolist() == list(range(128))
        assert example.position_ids[-1] >= 127


def test_stream_draws_the_retrieval_share(small, tmp_path):
    root, tokenizer = small
    folder = finetune_data.build(tmp_path / "data", root / "corpus" / "train", tokenizer, tmp_path / "cache", 128,
                                 0.25, seed=1)
    corpus = tokenize_corpus(folder, tokenizer, tmp_path / "cache", 128, progress=False)
    retrieval = set(np.flatnonzero(np.asarray(corpus.lengths) == 128))
    for sampler, target in (("pose", 1024), ("randpos", 1024), ("full", 128)):  # every method draws among the same
        stream = ExampleStream(corpus, 128, target, sampler=sampler, batch_size=1, seed=0)  # eligible documents
        share = np.mean([d in retrieval for d in stream.eligible])
        assert abs(share - 0.25) <= 0.5 / corpus.num_docs


def test_mean_ci95_by_hand():
    assert claims.mean_ci95([3.0]) == (3.0, None)
    mean, ci = claims.mean_ci95([1.0, 3.0])  # s = sqrt(2), t_{0.975, 1} = 12.706: 12.706 * sqrt(2) / sqrt(2)
    assert mean == 2.0 and ci == pytest.approx(12.706)
    mean, ci = claims.mean_ci95([1.0, 2.0, 3.0])  # s = 1, t_{0.975, 2} = 4.303
    assert mean == 2.0 and ci == pytest.approx(4.303 / 3 ** 0.5)
    table = claims.seed_statistics({"a": {"ppl": {"4": 2.0}}, "b": {"ppl": {"4": 5.0}}},
                                   {"a": {0: {"4": 2.0}, 1: {"4": 4.0}}})
    assert table["a"]["4"] == {"mean": 3.0, "ci95": pytest.approx(12.706), "values": [2.0, 4.0]}
    assert table["b"]["4"] == {"mean": 5.0, "ci95": None, "values": [5.0]}
    # claim (b) reads the means
    results = {"config": {"lengths": [4], "seeds": [0, 1]}, "runs": {}, "ppl": {
        f"{m}-{s}": {"4": {"mean": 10.0 + (m == "pose") * 0.4, "ci95": 0.1, "values": []}}
        for m in ("pose", "full") for s in ("linear", "ntk", "yarn")}}
    b = claims.claim_b(results, [4])
    assert b["held"] is True and "PoSE 10.4 +- 0.1 vs Full 10 +- 0.1 (+4.0%)" in b["detail"]


def test_binned_by_hand():
    nll = np.array([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.0]])
    assert position_nll.binned(nll, 2) == {"positions": [1, 3, 5], "nll": [2.5, 4.5, 6.0], "windows": 2}
    with pytest.raises(ValueError, match="^bin_width must be >= 1, got 0$"):
        position_nll.binned(nll, 0)


def test_window_nll_matches_a_full_forward(small):
    root, tokenizer = small
    from mlx_lm import load

    model, _ = load(str(root / "model"))
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 300, size=100), rng.integers(5, 300, size=70)]
    got = position_nll.window_nll(model, docs, 32, bos=1)
    assert got.shape == (3 + 2, 31)  # floor(100 / 31) + floor(70 / 31) windows
    expected = []
    for doc in docs:
        for start in range(0, len(doc) - 30, 31):
            ids = np.concatenate([[1], doc[start:start + 31]])
            logp = np.array(mx.log(mx.softmax(model(mx.array(ids[None]))[0].astype(mx.float32), axis=-1)))
            expected.append(-logp[np.arange(31), ids[1:]])
    np.testing.assert_allclose(got, np.stack(expected), rtol=1e-4, atol=1e-4)


def test_rewriting_the_same_documents_keeps_the_corpus_fingerprint(small, tmp_path):
    """An interrupted pre-training regenerates its retrieval documents on rerun; the data stream may only resume
    if the tokenized corpus keeps its fingerprint, which hashes the file's mtime."""
    from pose_mlx.sim.corpus import write_jsonl

    _, tokenizer = small
    path = tmp_path / "docs" / "retrieval.jsonl"
    texts = ["The alpha is 12345. What is the alpha? 12345."] * 3
    first = tokenize_corpus(write_jsonl(path, texts), tokenizer, tmp_path / "cache", 1, progress=False)
    mtime = path.stat().st_mtime_ns
    again = tokenize_corpus(write_jsonl(path, list(texts)), tokenizer, tmp_path / "cache", 1, progress=False)
    assert path.stat().st_mtime_ns == mtime and again.fingerprint == first.fingerprint
    other = tokenize_corpus(write_jsonl(path, texts[:2]), tokenizer, tmp_path / "cache", 1, progress=False)
    assert other.fingerprint != first.fingerprint and other.num_docs == 2
