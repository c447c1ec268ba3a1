"""Pre-training the simulator's base model from scratch at window Lc with `pose_mlx.training.loop.train`.

The model is a random mlx-lm llama (`pose_mlx.toy`), patched with `pose_mlx.extend(model, "none", Lc, Lc)`
(the raw RoPE frequencies, so explicit position ids work) and trained with the fine-tuning loop on
contiguous positions 0..Lc-1. Documents are cut into consecutive blocks of Lc tokens, each BOS + Lc - 1 tokens
of text (`block_corpus`), one block per "document" of the data stream (its 'contiguous' method takes a
document's prefix, so every part of a file is trainable); each example is one block drawn at random. With
`retrieval_fraction` f > 0, K = f / (1 - f) x (text blocks) synthetic retrieval documents
(`pose_mlx.sim.retrieval`: needles, lookup tables, repeated runs; never the passkey test's wording; one block each)
join them, so a share f of the sequences drawn are retrieval tasks with their answers (none when Lc cannot hold
one). Checkpoints live in `<folder>.partial/`, so an interrupted pre-training
resumes; the finished model is written to `<folder>`.

A base records what made it (`made_with`: the settings in BASE_SETTINGS and `corpus_fingerprint` of the corpus
stage's folder) in its pretrain.json; `reuse_base` copies a base made with the same settings on the same corpus
into place of the pre-training, so a base pre-trained once (the one shipped in `pose_mlx/sim/pretrained`) serves
every later run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
from pathlib import Path

import numpy as np

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load

from .. import toy
from ..files import replace_dir
from ..model.patch import extend, use_positions
from ..training.data import ExampleStream, TokenizedCorpus, tokenize_corpus
from ..training.loop import TrainConfig, evaluate, train
from .corpus import write_jsonl
from .retrieval import retrieval_documents


def block_corpus(corpora: list[TokenizedCorpus], window: int, max_blocks: list[int | None] | None = None,
                 bos: int | None = None) -> TokenizedCorpus:
    """One corpus whose documents are the consecutive, non-overlapping `window`-token blocks of every
    document of `corpora` (a document's last partial block is dropped; at most `max_blocks[k]` blocks per
    document of corpus k, None: all). With `bos`, every block starts with it, as every sequence the model will
    be asked about does: a document's own leading BOS is dropped and its text cut into `window - 1`-token
    pieces, each after a BOS."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    max_blocks = max_blocks or [None] * len(corpora)
    if len(max_blocks) != len(corpora):
        raise ValueError(f"max_blocks must have one entry per corpus ({len(corpora)}), got {len(max_blocks)}")
    piece = window if bos is None else window - 1
    pieces, starts, base = [], [], 0
    for corpus, limit in zip(corpora, max_blocks):
        for i in range(corpus.num_docs):
            doc = np.asarray(corpus.doc(i))
            if bos is not None and len(doc) and doc[0] == bos:
                doc = doc[1:]
            n = len(doc) // piece if limit is None else min(len(doc) // piece, limit)
            if n:
                body = doc[: n * piece].reshape(n, piece)
                if bos is not None:
                    body = np.concatenate([np.full((n, 1), bos, body.dtype), body], axis=1)
                pieces.append(body.reshape(-1))
                starts.append(base + window * np.arange(n))
                base += n * window
    if not pieces:
        raise ValueError(f"no document has >= {piece} tokens")
    tokens = np.concatenate(pieces).astype(np.int32)
    offsets = np.append(np.concatenate(starts), base).astype(np.int64)
    key = hashlib.sha256(("|".join(c.fingerprint for c in corpora) + f"|blocks{window}|bos{bos}").encode()
                         ).hexdigest()[:16]
    return TokenizedCorpus(tokens, offsets, np.arange(len(offsets) - 1), key, {"window": window, "bos": bos})


#: SimConfig settings (`to_dict()` keys) that decide the pre-trained base, besides the corpus itself.
BASE_SETTINGS = ("window", "base", "hidden", "layers", "heads", "ffn", "pretrain_steps", "pretrain_batch",
                 "pretrain_lr", "retrieval_fraction", "seed")


def corpus_fingerprint(data: Path) -> str:
    """sha256 over every file of the corpus stage's folder `data` (its path relative to `data`, then its bytes):
    the training text, the splits and the tokenizer a base was made with."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(data).rglob("*") if p.is_file()):
        digest.update(path.relative_to(data).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def made_with(settings: dict, data: Path) -> dict:
    """What decides a base: the BASE_SETTINGS of `settings` (a SimConfig.to_dict()) and the corpus fingerprint."""
    return {"settings": {k: settings[k] for k in BASE_SETTINGS}, "corpus": corpus_fingerprint(data)}


def reuse_base(source: Path, folder: Path, wanted: dict, name: str | None = None) -> str | None:
    """Copy the finished base `source` to `folder` if its pretrain.json's `made_with` equals `wanted` (the copy's
    pretrain.json adds `reused_from`: `name`, or the source's path); returns None when copied, else why not (the
    first setting that differs, or the corpus)."""
    record = Path(source) / "pretrain.json"
    if not record.is_file():
        return f"{source} is not a pre-trained base (no pretrain.json)"
    have = json.loads(record.read_text()).get("made_with")
    if have is None:
        return f"{source}/pretrain.json does not record what made it ('made_with')"
    for key, value in wanted["settings"].items():
        if have["settings"].get(key) != value:
            return f"it was made with {key} = {have['settings'].get(key)}, this run has {value}"
    if have["corpus"] != wanted["corpus"]:
        return "it was made on another corpus (the corpus stage's files differ)"
    temp = Path(folder).with_name(Path(folder).name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    shutil.copytree(source, temp)
    copied = {**json.loads(record.read_text()), "reused_from": name or str(source)}
    (temp / "pretrain.json").write_text(json.dumps(copied, indent=1) + "\n")
    replace_dir(temp, folder)
    return None


def pretrain(folder: Path, tokenizer_dir: Path, train_dir: Path, val_dir: Path, cache_dir: Path, *,
             retrieval_fraction: float, window: int, base: float, hidden: int, layers: int, heads: int, ffn: int,
             steps: int, batch: int, lr: float, seed: int, progress: bool = False, made: dict | None = None) -> dict:
    """Pre-train and write the model folder `folder` (loads with mlx_lm.load); returns pretrain.json's record,
    which holds `made` (`made_with`'s record) when given."""
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    init = partial / "init"
    if not (init / "config.json").is_file():
        toy.make_model_folder(init, tokenizer_from=tokenizer_dir, hidden_size=hidden, num_layers=layers,
                              num_heads=heads, intermediate_size=ffn, max_position_embeddings=window,
                              rope_theta=base, seed=seed)
    model, tokenizer = load(str(init))
    config = json.loads((init / "config.json").read_text())
    extend(model, "none", window, window)
    text = tokenize_corpus(train_dir, tokenizer, cache_dir, window, progress=progress)
    bos = tokenizer.bos_token_id
    text_blocks = block_corpus([text], window, bos=bos).num_docs
    # K retrieval blocks among text_blocks + K: a retrieval_fraction share of the sequences drawn
    count = round(retrieval_fraction / (1 - retrieval_fraction) * text_blocks)
    retrieval_texts = retrieval_documents(tokenizer, count, window, seed)
    sources = [text]
    if retrieval_texts:
        retrieval_file = write_jsonl(partial / "retrieval.jsonl", retrieval_texts)
        sources.append(tokenize_corpus(retrieval_file, tokenizer, cache_dir, window, progress=progress))
    blocks = block_corpus(sources, window, [None, 1][: len(sources)], bos=bos)
    pad = tokenizer.eos_token_id or 0
    stream = ExampleStream(blocks, window, window, sampler="contiguous", batch_size=batch, seed=seed, pad_id=pad)
    resume = (partial / "checkpoint").exists()
    tconfig = TrainConfig(steps=steps, lr=lr, warmup=max(1, steps // 20), save_every=max(1, steps // 10),
                          progress=progress)
    last = train(model, stream, tconfig, partial, use_positions, resume=resume)
    val = block_corpus([tokenize_corpus(val_dir, tokenizer, cache_dir, window, progress=progress)], window,
                       bos=bos)
    val_stream = ExampleStream(val, window, window, sampler="contiguous", batch_size=batch, seed=seed + 1,
                               pad_id=pad)
    val_loss = evaluate(model, itertools.islice(iter(val_stream), 10), use_positions)
    log = [json.loads(line) for line in (partial / "log.jsonl").read_text().splitlines() if line.strip()]
    record = {"steps": steps, "batch": batch, "window": window, "lr": lr, "rope_base": base,
              "train_tokens": int(sum(r["tokens"] for r in log)), "blocks": blocks.num_docs,
              "retrieval_blocks": blocks.num_docs - text_blocks, "final_loss": last["loss"], "val_loss": val_loss,
              "val_ppl": float(np.exp(val_loss)), "seconds": float(sum(r["seconds"] for r in log)),
              "parameters": int(sum(v.size for _, v in tree_flatten(model.parameters())))}
    if made is not None:
        record["made_with"] = made
    mx.eval(model.parameters())
    temp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    toy.save_model_folder(model, config, tokenizer_dir, temp)
    (temp / "pretrain.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.copyfile(partial / "log.jsonl", temp / "train_log.jsonl")
    replace_dir(temp, folder)
    shutil.rmtree(partial, ignore_errors=True)
    return record
