"""Training data: read a corpus, tokenize it once into an on-disk cache, and stream PoSE training batches.

Pipeline (NumPy only; never imports MLX):

    source ──read_documents──▶ str documents ──tokenize_corpus──▶ cache (tokens.npy + offsets.npy + meta.json)
           ──TokenizedCorpus (memory-mapped)──▶ ExampleStream ──▶ Batch(inputs, targets, positions, mask)

Each step lives in its own module: `reading` (sources, files, documents), `token_cache` (the tokenized cache and
the corpus over it), `batches` (examples, streams, padded batches). This module builds a run's data from its
settings (`training_data`) and is where the names of all three are imported from.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from .batches import FUSED_ATTENTION_ROWS, Batch, ExampleStream, collate, required_length, row_multiple
from .reading import (OWN_MARKS, SPLITS, SUFFIXES, DataError, ReadStats, chat_renderer, check_readable,
                      decode_text, read_documents, read_files, resolve_files)
from .token_cache import CACHE_VERSION, TokenizedCorpus, TokenWriter, tokenize_corpus, tokenizer_fingerprint


@dataclass
class TrainingData:
    """The data of a fine-tuning run: the training stream (this rank's rows), the held-out batches (or None) and
    the corpus fingerprint recorded in the exported metadata."""

    stream: ExampleStream
    eval_batches: object  # () -> iterable of Batch, or None
    probe: Batch  # one batch of a separate stream (held-out data when there is some), for checks
    fingerprint: str
    skipped: ReadStats


def training_data(settings, tokenizer, window: int, target: int, world, row_multiple: int = 1) -> TrainingData:
    """Tokenize `settings.data` (rank 0 first; the other ranks then read its cache) and build the streams.

    `settings` is a `pose_mlx.settings.RunSettings`. Documents shorter than `settings.min_length` (default: the
    example length) are dropped. Held-out batches (for `eval_every`) come from mlx-lm's valid.jsonl when the data
    has one, else from a seeded `heldout` fraction of the documents. Rows are padded to a multiple of `row_multiple`
    (the run plan's `memory.TrainSettings.row_multiple`, so that the trainer pads exactly as the memory plan predicted)."""
    length = target if settings.sampler == "full" else window
    min_length = settings.min_length or length
    cache = Path(settings.cache_dir).expanduser()

    def tokenize(split: str) -> TokenizedCorpus:
        return tokenize_corpus(settings.data, tokenizer, cache, min_length, split=split,
                               progress=settings.progress and world.is_main)

    corpus = tokenize("train") if world.is_main else None
    world.barrier()  # the other ranks find rank 0's cache instead of tokenizing the corpus again
    corpus = corpus or tokenize("train")
    heldout = None
    if settings.eval_every:
        if resolve_files(settings.data, "valid"):
            heldout = tokenize("valid")
        else:
            corpus, heldout = corpus.split(settings.heldout, settings.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def stream(c: TokenizedCorpus, seed: int, sharded: bool) -> ExampleStream:
        """Global batches of batch_size * ranks rows; `sharded`: only this rank's batch_size rows of each."""
        rank, ranks = (world.rank, world.size) if sharded else (0, 1)
        return ExampleStream(c, window, target, sampler=settings.sampler, chunks=settings.chunks,
                             content=settings.content, batch_size=settings.batch_size * world.size // ranks,
                             seed=seed, pad_id=pad_id, rank=rank, world=ranks,
                             short_share=settings.short_share, row_multiple=row_multiple)

    eval_batches = None
    if heldout is not None:
        def eval_batches():  # rank 0 evaluates whole global batches
            return itertools.islice(iter(stream(heldout, settings.seed + 1, sharded=False)), settings.eval_batches)

    probe = stream(heldout or corpus, settings.seed + 2, sharded=False).next_batch()
    return TrainingData(stream(corpus, settings.seed, sharded=True), eval_batches, probe, corpus.fingerprint,
                        ReadStats(**corpus.meta.get("stats", {})))


__all__ = ["Batch", "CACHE_VERSION", "DataError", "ExampleStream", "FUSED_ATTENTION_ROWS", "OWN_MARKS", "ReadStats",
           "SPLITS", "SUFFIXES", "TokenWriter", "TokenizedCorpus", "TrainingData", "chat_renderer", "check_readable",
           "collate", "decode_text", "read_documents", "read_files", "required_length", "resolve_files",
           "row_multiple", "tokenize_corpus", "tokenizer_fingerprint", "training_data"]
