"""pose_mlx.training.data: reading, cached tokenization, length filter, example batches and resumable streams."""

import json
from pathlib import Path

import numpy as np
import pytest

from pose_mlx.training import positions
from pose_mlx.training.data import (DataError, ExampleStream, ReadStats, TokenWriter, collate,
                           read_documents, tokenize_corpus)


class ByteTokenizer:
    """Fake tokenizer: one id per UTF-8 byte (byte + offset); BOS = 1, EOS = 2. Counts encode calls."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self, offset=3):
        self.offset, self.calls = offset, 0

    def encode(self, text):
        self.calls += 1
        return [b + self.offset for b in text.encode("utf-8")]

    def get_vocab(self):
        return {f"<{i}>": i + self.offset for i in range(256)}


def _ids(text, offset=3):
    """Independent reference: the ids the cache must hold for `text` (BOS + bytes + EOS)."""
    return [1] + [b + offset for b in text.encode("utf-8")] + [2]


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second document, a bit longer than the first one")
    (root / "a.md").write_text("first doc")
    (root / "sub" / "c.jsonl").write_text(json.dumps({"text": "json one"}) + "\n\n"
                                          + json.dumps({"text": "json two é"}) + "\n")
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    (root / "empty.txt").write_text("  \n")
    (root / "nul.txt").write_bytes(b"abc\x00def")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return root


def test_read_file_jsonl_and_folder(folder):
    assert list(read_documents(folder / "b.txt")) == ["second document, a bit longer than the first one"]
    assert list(read_documents(folder / "sub" / "c.jsonl")) == ["json one", "json two é"]
    stats = ReadStats()
    docs = list(read_documents(folder, stats))
    # sorted by path: a.md, b.txt, (empty, latin1, nul skipped), sub/c.jsonl
    assert docs == ["first doc", "second document, a bit longer than the first one", "json one", "json two é"]
    assert (stats.files_read, stats.documents) == (3, 4)
    assert (stats.skipped_empty, stats.skipped_binary, stats.skipped_encoding) == (1, 1, 1)


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(read_documents(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*'text'"):
        list(read_documents(bad))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.txt").write_bytes(b"")
    (junk / "b.txt").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match="no readable document.*1 empty, 1 binary, 0 not UTF-8"):
        tokenize_corpus(junk, ByteTokenizer(), tmp_path / "cache", 1, progress=False)


def test_hub_unreachable_and_hub_folder(tmp_path, monkeypatch, folder):
    import huggingface_hub

    def offline(**kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DataError, match="hub cannot be reached"):
        list(read_documents("someone/some-data"))
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return str(folder / "sub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert list(read_documents("someone/some-data")) == ["json one", "json two é"]
    assert seen["repo_type"] == "dataset" and seen["repo_id"] == "someone/some-data"


def test_hub_dataset_with_a_closed_endpoint_fails_without_retries(tmp_path):
    """A real lookup against a closed loopback port (no mock): the probe fails, only the empty cache is read."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("from pose_mlx.training.data import DataError, read_documents\n"
            "try:\n    list(read_documents('someone/some-data'))\nexcept DataError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(root), "HF_ENDPOINT": "http://127.0.0.1:9",
                               "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr
    assert "--data someone/some-data: not a local path and the Hugging Face hub cannot be reached" in proc.stdout
    assert "Retry" not in proc.stderr


def test_cache_contents_hit_and_invalidation(tmp_path, folder):
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    corpus = tokenize_corpus(folder, tok, cache, min_length=12, progress=False)
    texts = list(read_documents(folder))
    expected = [_ids(t) for t in texts if len(_ids(t)) >= 12]  # "first doc" (11 ids) and "json one" (10) dropped
    assert len(expected) == 2 and corpus.num_docs == 2
    assert [corpus.doc(i).tolist() for i in range(2)] == expected
    assert corpus.lengths.tolist() == [len(e) for e in expected]
    assert corpus.total_tokens == sum(map(len, expected))
    assert isinstance(corpus.tokens, np.memmap) and corpus.doc(0).dtype == np.int32
    assert tok.calls == 4

    again = tokenize_corpus(folder, tok, cache, min_length=12, progress=False)
    assert tok.calls == 4 and again.fingerprint == corpus.fingerprint

    boundary = tokenize_corpus(folder, tok, cache, min_length=11, progress=False)
    assert boundary.num_docs == 3 and boundary.doc(0).tolist() == _ids("first doc")  # exactly 11 ids: kept
    changes = [lambda: tokenize_corpus(folder, ByteTokenizer(offset=4), cache, min_length=12, progress=False),
               lambda: tokenize_corpus(folder, tok, cache, min_length=12, eos=False, progress=False)]
    prints = {corpus.fingerprint, boundary.fingerprint}
    for change in changes:
        prints.add(change().fingerprint)
    (folder / "a.md").write_text("first doc, now edited to be long enough")
    edited = tokenize_corpus(folder, tok, cache, min_length=12, progress=False)
    prints.add(edited.fingerprint)
    assert len(prints) == 5 and edited.num_docs == 3
    assert edited.doc(0).tolist() == _ids("first doc, now edited to be long enough")
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_length_filter_error_message(tmp_path, folder):
    longest = max(len(_ids(t)) for t in read_documents(folder))  # 4 documents read
    with pytest.raises(DataError, match=rf"^no document has >= 500 tokens \(read 4 documents, longest has "
                                        rf"{longest} tokens\)$"):
        tokenize_corpus(folder, ByteTokenizer(), tmp_path / "cache", min_length=500, progress=False)
    assert not (tmp_path / "cache").exists()  # a failed first use leaves nothing behind


def test_writer_streams_in_chunks(tmp_path):
    """The writer never holds more than chunk_size + one document of ids, and flushes as it goes."""
    chunk, rng = 64, np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)).astype(np.int32) for n in rng.integers(1, 40, size=300)]
    produced = []
    writer = TokenWriter(tmp_path / "t.npy", chunk_size=chunk)
    for d in docs:
        produced.append(len(d))
        writer.append(d)
        writer.file.flush()
        assert writer.buffered < chunk  # flushed as soon as a chunk is full
        assert (tmp_path / "t.npy").stat().st_size >= 128 + 4 * (sum(produced) - chunk)  # the rest is on disk
    writer.close()
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy", mmap_mode="r"), np.concatenate(docs))


def test_tokenize_corpus_streams(tmp_path, monkeypatch):
    """tokenize_corpus pulls documents lazily from the reader and writes them in small chunks."""
    import pose_mlx.training.token_cache as token_cache

    pulled, flushed_at = [], []
    original_flush = TokenWriter.flush

    def lazy_docs(files, stats, render=None):
        for i in range(200):
            pulled.append(i)
            stats.documents += 1
            yield f"document number {i} " * 3

    def spy_flush(self):
        if self.buffer:
            flushed_at.append(len(pulled))
        original_flush(self)

    monkeypatch.setattr(token_cache, "read_files", lazy_docs)
    monkeypatch.setattr(TokenWriter, "flush", spy_flush)
    (tmp_path / "x.txt").write_text("placeholder")
    corpus = tokenize_corpus(tmp_path / "x.txt", ByteTokenizer(), tmp_path / "cache", 1, progress=False,
                             chunk_size=256)
    assert corpus.num_docs == 200 and corpus.doc(199).tolist() == _ids("document number 199 " * 3)
    assert len(flushed_at) > 20 and flushed_at[0] < 10  # first chunk written after a few documents


def _corpus(tmp_path, lengths, seed=0):
    """A corpus whose document k holds distinct, recognisable ids: 1000 * k + (0, 1, 2, ...)."""
    folder = tmp_path / "docs"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for k, n in enumerate(lengths):
        text = "".join(chr(c) for c in rng.integers(97, 123, size=n - 2))
        (folder / f"{k:03d}.txt").write_text(text)
    return tokenize_corpus(folder, ByteTokenizer(), tmp_path / "cache", 2, progress=False)


@pytest.mark.parametrize("sampler,content", [("pose", "uniform"), ("pose", "aligned"), ("randpos", "uniform"),
                                            ("full", "uniform"), ("pose-ref", "zero")])
def test_batches_follow_the_sampler(tmp_path, sampler, content):
    lengths = [30, 50, 200, 80, 300]
    corpus = _corpus(tmp_path, lengths)
    window, target, batch = 16, 64, 3
    stream = ExampleStream(corpus, window, target, sampler=sampler, chunks=2, content=content, batch_size=batch,
                           seed=5)
    need = target if sampler == "full" or content == "aligned" else window
    # independent replay of the documented draws: document index, then sample_example, with one generator
    rng = np.random.default_rng(5)
    eligible = [k for k, n in enumerate(lengths) if n >= need]
    length = target if sampler == "full" else window
    assert stream.tokens_per_batch == batch * (length - 1)
    batches = [next(iter(stream)) for _ in range(3)]
    for b in batches:
        assert b.inputs.shape == b.targets.shape == b.positions.shape == b.mask.shape == (batch, length - 1)
        assert b.inputs.dtype == np.int32 and b.mask.dtype == np.float32 and (b.mask == 1).all()
        for row in range(batch):
            doc = eligible[rng.integers(len(eligible))]
            ex = positions.sample_example(lengths[doc], window, target, sampler, 2, content, rng=rng)
            tokens = corpus.doc(doc)
            x = np.concatenate([tokens[s:s + n] for s, n in ex.spans])
            assert b.docs[row] == doc
            np.testing.assert_array_equal(b.inputs[row], x[:-1])
            np.testing.assert_array_equal(b.targets[row], x[1:])
            np.testing.assert_array_equal(b.positions[row], ex.position_ids[:-1])
            assert b.positions[row].max() < target
            # within a chunk, the target is the next token of the document
            pos = 0
            for s, n in ex.spans:
                np.testing.assert_array_equal(b.targets[row, pos:pos + n - 1], tokens[s + 1:s + n])
                pos += n


def test_collate_pads_and_masks():
    a = (np.array([5, 6, 7, 8]), np.array([0, 1, 9, 10]), np.ones(3, np.float32))
    b = (np.array([3, 4]), np.array([0, 7]), np.ones(1, np.float32))
    batch = collate([a, b], [0, 1], pad_id=-1)
    assert batch.inputs.tolist() == [[5, 6, 7], [3, -1, -1]]
    assert batch.targets.tolist() == [[6, 7, 8], [4, -1, -1]]
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.positions.tolist() == [[0, 1, 9], [0, 0, 0]]


def test_stream_resume_is_exact(tmp_path):
    corpus = _corpus(tmp_path, [40, 90, 150, 60])
    make = lambda: ExampleStream(corpus, 12, 48, batch_size=2, seed=3)  # noqa: E731
    reference = make()
    it = iter(reference)
    expected = [next(it) for _ in range(7)]
    first = make()
    it = iter(first)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert state["batches"] == 4
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for want in expected[4:]:
        got = next(it)
        for name in ("inputs", "targets", "positions", "mask", "docs"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert not np.array_equal(expected[0].inputs, expected[4].inputs)
    other = _corpus(tmp_path / "other", [40, 90])
    with pytest.raises(DataError, match="different data"):
        ExampleStream(other, 12, 48).load_state_dict(state)


def test_stream_eligibility_and_arguments(tmp_path):
    corpus = _corpus(tmp_path, [30, 200])
    stream = ExampleStream(corpus, 16, 100, sampler="full", batch_size=4, seed=0)
    assert set(next(iter(stream)).docs.tolist()) == {1}  # only the 200-token document fits 100 tokens
    with pytest.raises(DataError, match=r"no document has >= 500 tokens.*2 documents, longest has 200"):
        ExampleStream(corpus, 16, 500, sampler="full")
    with pytest.raises(ValueError, match="sampler"):
        ExampleStream(corpus, 16, 64, sampler="nope")
    with pytest.raises(ValueError, match="batch_size"):
        ExampleStream(corpus, 16, 64, batch_size=0)
    with pytest.raises(ValueError, match="chunks"):
        ExampleStream(corpus, 4, 64, chunks=5)


def test_split_by_document(tmp_path):
    corpus = _corpus(tmp_path, [20 + k for k in range(10)])
    train, held = corpus.split(0.2, seed=4)
    assert (train.num_docs, held.num_docs) == (8, 2)
    ids = lambda c: [c.doc(i)[:5].tobytes() for i in range(c.num_docs)]  # noqa: E731
    assert set(ids(train)).isdisjoint(ids(held)) and len(set(ids(train)) | set(ids(held))) == 10
    assert [d.tolist() for d in map(held.doc, range(2))] == [d.tolist() for d in map(corpus.split(0.2, 4)[1].doc,
                                                                                      range(2))]
    tiny_train, tiny_held = _corpus(tmp_path / "tiny", [20, 30]).split(0.01, 0)
    assert tiny_train.num_docs == tiny_held.num_docs == 1
    assert held.total_tokens + train.total_tokens == corpus.total_tokens


def test_real_toy_tokenizer(tmp_path):
    """With a trained sentencepiece tokenizer loaded by mlx-lm: ids equal the tokenizer's own encoding framed
    by BOS/EOS, and a second call hits the cache."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from pose_mlx.toy import train_tokenizer

    texts = [("def f%d(x):\n    return x * %d + 1\n" % (i, i)) * 20 for i in range(30)]
    folder = train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    tok = load_tokenizer(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:5]))
    corpus = tokenize_corpus(data, tok, tmp_path / "cache", min_length=8, progress=False)
    assert corpus.num_docs == 5
    raw = tok._tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert corpus.doc(0).tolist() == [tok.bos_token_id, *raw, tok.eos_token_id]
    assert tokenize_corpus(data, tok, tmp_path / "cache", min_length=8, progress=False).fingerprint == \
        corpus.fingerprint
    assert len(list((tmp_path / "cache").iterdir())) == 1
