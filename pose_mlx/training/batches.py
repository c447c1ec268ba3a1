"""Training batches: PoSE examples drawn from a `TokenizedCorpus` (`ExampleStream`, seeded and resumable) and
collated into padded, masked `Batch`es (NumPy only; never imports MLX).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .positions import CONTENT, SAMPLERS, Example, sample_example
from .reading import DataError
from .token_cache import TokenizedCorpus
from ..words import counted

# ---------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """B examples of T = L - 1 next-token predictions (L = window, or target for sampler 'full').

    inputs[b, t] = x[t], targets[b, t] = x[t + 1], positions[b, t] = p[t] (position id of input t), where x, p
    are the example's tokens and position ids; mask[b, t] = 1.0 for a real target, 0.0 for padding.
    docs[b] = document index. short[b] (mixed-window training only, else None) = True when row b is a
    short-context row: positions 0 .. window - 1, read with the model's original RoPE."""

    inputs: np.ndarray  # int32 (B, T)
    targets: np.ndarray  # int32 (B, T)
    positions: np.ndarray  # int32 (B, T)
    mask: np.ndarray  # float32 (B, T)
    docs: np.ndarray  # int64 (B,)
    short: np.ndarray | None = None  # bool (B,)


#: Inputs per row that MLX's CUDA attention needs to differentiate through cuDNN's fused kernel (its backward
#: falls back to the unfused attention for other query lengths; see docs/memory.md).
FUSED_ATTENTION_ROWS = 128


def row_multiple(align_rows: str, backend: str) -> int:
    """What training rows are padded to a multiple of (finetune's --align-rows): `FUSED_ATTENTION_ROWS` for "on",
    and for "auto" on CUDA (the one backend whose training attention is fused); 1 (no padding) otherwise."""
    if align_rows not in ("auto", "on", "off"):
        raise ValueError(f"align_rows must be auto, on or off, got {align_rows!r}")
    aligned = align_rows == "on" or (align_rows == "auto" and backend == "cuda")
    return FUSED_ATTENTION_ROWS if aligned else 1


def collate(examples: list[tuple[np.ndarray, np.ndarray, np.ndarray]], docs, pad_id: int = 0, short=None,
            multiple: int = 1) -> Batch:
    """Batch (tokens x, positions p, mask over targets) triples of possibly different lengths: shorter rows
    are padded at the end with ``pad_id`` (positions repeat the last real one) and mask 0, and every row to a
    width that is a multiple of ``multiple`` (masked padding changes neither the loss nor its gradient: the
    attention is causal, so no real token sees it). ``short``: the rows' short-context marks (see ``Batch``), or
    None."""
    width = max(len(x) for x, _, _ in examples) - 1
    width = -(-width // multiple) * multiple
    size = len(examples)
    inputs = np.full((size, width), pad_id, dtype=np.int32)
    targets = np.full((size, width), pad_id, dtype=np.int32)
    positions = np.zeros((size, width), dtype=np.int32)
    mask = np.zeros((size, width), dtype=np.float32)
    for b, (x, p, m) in enumerate(examples):
        n = len(x) - 1
        inputs[b, :n], targets[b, :n], mask[b, :n] = x[:-1], x[1:], m
        positions[b, :n], positions[b, n:] = p[:-1], p[n - 1] if n else 0
    return Batch(inputs, targets, positions, mask, np.asarray(docs, dtype=np.int64),
                 None if short is None else np.asarray(short, dtype=bool))


def required_length(window: int, target: int, sampler: str, content: str) -> int:
    """Fewest document tokens ``sample_example`` accepts: target for 'full' and for PoSE with 'aligned'
    content, else window."""
    if sampler == "full" or (content == "aligned" and sampler in ("pose", "pose-ref", "pose-middle")):
        return target
    return window


class ExampleStream:
    """An endless, seeded stream of ``Batch``es: each example draws a document uniformly at random among those
    long enough (``required_length``), then positions and content with ``pose_mlx.training.positions.sample_example``.

    All randomness comes from one ``np.random.Generator`` seeded with ``seed`` (and, with ``short_share``, a
    second one for the row marks, below); ``state_dict()`` / ``load_state_dict()`` save and restore them, so a
    resumed stream yields exactly the batches the original would have. Every target counts, including the first token of a later chunk, predicted across the position
    skip, as in the paper and the authors' code.

    Data-parallel shards: with ``world`` W > 1 each batch draws W * ``batch_size`` examples (the draws a
    single stream with batch W * ``batch_size`` makes) and keeps rows ``rank * batch_size`` to
    ``(rank + 1) * batch_size - 1``, so the W ranks together see exactly the single stream's batch.

    Mixed-window training (``short_share`` F > 0, after LongRoPE2's mixed context window training): example k
    of the stream is a short-context row when r_k < F, where r_0, r_1, ... are the uniform draws of a second
    generator ``np.random.default_rng([seed, 1])`` (one per example, in order), so the marks depend only on the
    seed and F. A short row takes positions 0 .. window - 1 over consecutive tokens (``sample_example``'s
    ``plain``) and is marked in ``Batch.short`` so that the model reads it with its original RoPE; the other
    rows come from ``sampler``. Every row has the same length, so memory does not change.
    """

    def __init__(self, corpus: TokenizedCorpus, window: int, target: int, sampler: str = "pose", chunks: int = 2,
                 content: str = "uniform", batch_size: int = 1, seed: int = 0, pad_id: int = 0,
                 rank: int = 0, world: int = 1, short_share: float = 0.0, row_multiple: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if content not in CONTENT:
            raise ValueError(f"content must be one of {CONTENT}, got {content!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not 0 <= short_share < 1:
            raise ValueError(f"short_share must be in [0, 1), got {short_share!r}")
        if short_share and sampler in ("full", "plain", "contiguous"):
            raise ValueError(f"short_share needs a sampler that skips positions, not {sampler!r}")
        self.corpus, self.window, self.target = corpus, window, target
        self.sampler, self.chunks, self.content = sampler, chunks, content
        self.batch_size, self.seed, self.pad_id = int(batch_size), seed, pad_id
        self.rank, self.world, self.row_multiple = rank, world, int(row_multiple)
        need = required_length(window, target, sampler, content)
        self.length = target if sampler == "full" else window  # tokens per example
        if self.length < 2:
            raise ValueError(f"an example needs >= 2 tokens (one input, one target), got {self.length}")
        sample_example(need, window, target, sampler, chunks, content, rng=0)  # validates the arguments
        self.doc_lengths = lengths = corpus.lengths
        self.eligible = np.flatnonzero(lengths >= need)
        if len(self.eligible) == 0:
            longest = int(lengths.max()) if len(lengths) else 0
            raise DataError(f"no document has >= {need} tokens, which sampler={sampler!r} content={content!r} "
                            f"needs (corpus has {counted(corpus.num_docs, 'document')}, longest has {longest} tokens)")
        self.rng = np.random.default_rng(seed)
        self.short_share = float(short_share)
        self.mix_rng = np.random.default_rng([seed, 1])
        self.batches = 0

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens per batch of this rank, batch_size * (L - 1) (before any boundary masking)."""
        return self.batch_size * (self.length - 1)

    def _draw(self) -> tuple[int, Example, bool]:
        """A document index, an example layout for it and whether it is a short-context row (consumes the
        generators; reads no tokens)."""
        short = bool(self.mix_rng.random() < self.short_share) if self.short_share else False
        doc = int(self.eligible[self.rng.integers(len(self.eligible))])
        sampler = "plain" if short else self.sampler
        return doc, sample_example(int(self.doc_lengths[doc]), self.window, self.target, sampler, self.chunks,
                                   self.content, rng=self.rng), short

    def _materialize(self, doc: int, example: Example) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, position ids, target mask) of one drawn example."""
        x = np.asarray(self.corpus.doc(doc)[example.token_index()], dtype=np.int32)
        return x, example.position_ids, np.ones(len(x) - 1, dtype=np.float32)

    def next_batch(self) -> Batch:
        drawn = [self._draw() for _ in range(self.batch_size * self.world)]
        mine = drawn[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.batches += 1
        return collate([self._materialize(d, e) for d, e, _ in mine], [d for d, _, _ in mine], self.pad_id,
                       [s for _, _, s in mine] if self.short_share else None, self.row_multiple)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable position of the stream: generator states and batches drawn so far."""
        return {"rng": self.rng.bit_generator.state, "mix_rng": self.mix_rng.bit_generator.state,
                "batches": self.batches, "seed": self.seed, "fingerprint": self.corpus.fingerprint,
                "num_docs": self.corpus.num_docs}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict``); DataError if it was saved on a different corpus."""
        if (state.get("fingerprint"), state.get("num_docs")) != (self.corpus.fingerprint, self.corpus.num_docs):
            raise DataError("cannot resume: the checkpoint's data stream was built on different data "
                            f"(fingerprint {state.get('fingerprint')}, this run {self.corpus.fingerprint})")
        self.rng.bit_generator.state = state["rng"]
        if "mix_rng" in state:  # absent from streams saved before mixed-window training, which never drew from it
            self.mix_rng.bit_generator.state = state["mix_rng"]
        self.batches = int(state["batches"])

