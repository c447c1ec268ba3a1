"""Position-id samplers for context-window extension (NumPy only; never imports MLX).

Notation of the PoSE paper (Zhu et al., section 3.2): the training window has ``Lc`` tokens (``window``), the
target context ``Lt`` positions (``target``), a document ``Lx`` tokens (``doc_length``). PoSE splits the window
into N chunks of lengths l_i (sum = Lc) starting at st_i = l_0 + ... + l_{i-1} (eq. 3), gives chunk i the
positions u_i + st_i ... u_i + st_i + l_i - 1 (eq. 4) and the tokens x[v_i + st_i : v_i + st_i + l_i] (eq. 5).

Every sampler takes ``rng``: a ``np.random.Generator`` (used as is), an int seed, or None (fresh entropy).
``sample_example`` draws the positions first and the content offsets after, so for one seed its positions equal
those of ``pose_position_ids`` / ``randpos_position_ids`` whatever the content strategy.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

#: Every sampler `sample_example` draws. All but `contiguous` (positions 0..window-1 of the unextended model: the
#: reference of the coverage analysis) are fine-tuning samplers (`pose_mlx.settings.RUN_SAMPLERS`).
SAMPLERS = ("pose", "pose-ref", "pose-middle", "randpos", "full", "contiguous", "plain")
REFERENCE_SAMPLERS = ("contiguous",)
#: Standard deviation of the truncated Gaussian of ``pose-middle``, in units of the window (CREAM's sigma).
MIDDLE_SIGMA = 3.0
CONTENT = ("uniform", "zero", "aligned")

RngLike = np.random.Generator | np.random.SeedSequence | int | None


def _generator(rng: RngLike) -> np.random.Generator:
    """A Generator from a Generator (returned unchanged), a seed, or None."""
    return np.random.default_rng(rng)


def _integer(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``, else ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def _window_target(window, target) -> tuple[int, int]:
    window = _integer("window", window, 1)
    target = _integer("target", target, 1)
    if target < window:
        raise ValueError(f"target ({target}) must be >= window ({window})")
    return window, target


def _chunk_lengths(window: int, chunks: int, rng: np.random.Generator) -> np.ndarray:
    """Sequential draw of the paper's Figure 6: l_i ~ U{1 .. rest - (chunks still to come after i)}, the last
    chunk takes the rest, so every l_i >= 1 and sum l_i = window."""
    lengths = np.empty(chunks, dtype=np.int64)
    rest = window
    for i in range(chunks - 1):
        lengths[i] = rng.integers(1, rest - (chunks - 1 - i), endpoint=True)
        rest -= int(lengths[i])
    lengths[-1] = rest
    return lengths


def _skip_biases(chunks: int, room: int, rng: np.random.Generator) -> np.ndarray:
    """Eq. (4)'s skipping biases: u_0 = 0, u_i ~ U{u_{i-1} .. room} with room = Lt - Lc (both ends included)."""
    biases = np.zeros(chunks, dtype=np.int64)
    for i in range(1, chunks):
        biases[i] = rng.integers(biases[i - 1], room, endpoint=True)
    return biases


def _chunked_positions(lengths: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """Eq. (3)+(4): token t of the window, in chunk i, gets position t + u_i (t = st_i + j)."""
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(biases, lengths)


def _pose_layout(window: int, target: int, chunks: int, rng: np.random.Generator):
    """Validated (chunk lengths, skip biases) of one PoSE sample."""
    window, target = _window_target(window, target)
    chunks = _integer("chunks", chunks, 1)
    if chunks > window:
        raise ValueError(f"chunks ({chunks}) must be <= window ({window}): every chunk holds at least one token")
    lengths = _chunk_lengths(window, chunks, rng)
    return lengths, _skip_biases(chunks, target - window, rng)


def pose_position_ids(window: int, target: int, chunks: int = 2, rng: RngLike = None) -> np.ndarray:
    """PoSE position ids (paper eqs. 3-4, chunk lengths as in Figure 6): int64 array of shape (window,).

    Starts at 0, strictly increasing, < target, contiguous inside each of the ``chunks`` chunks (so at most
    chunks - 1 skips). ``chunks=1`` or ``target == window`` gives 0 .. window - 1.
    """
    return _chunked_positions(*_pose_layout(window, target, chunks, _generator(rng)))


def randpos_position_ids(window: int, target: int, rng: RngLike = None) -> np.ndarray:
    """RandPos (Ruoss et al. 2023; PoSE paper Figure 6): ``window`` distinct positions drawn uniformly without
    replacement from {0 .. target - 1}, sorted. int64, shape (window,); unlike PoSE the first need not be 0."""
    window, target = _window_target(window, target)
    rng = _generator(rng)
    return np.sort(rng.choice(target, size=window, replace=False, shuffle=False)).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Example:
    """One training example: ``position_ids[k]`` is the position of the k-th token, and the tokens are the
    document slices ``spans`` = [(start, length), ...] concatenated in order (lengths sum to len(position_ids)).
    For the PoSE samplers span i is chunk i, so chunk boundaries are at the cumulative span lengths."""

    position_ids: np.ndarray
    spans: list[tuple[int, int]]
    doc_length: int

    def token_index(self) -> np.ndarray:
        """Indices into the document of the example's tokens, int64 of shape (len(position_ids),)."""
        starts = np.array([s for s, _ in self.spans], dtype=np.int64)
        lengths = np.array([n for _, n in self.spans], dtype=np.int64)
        firsts = np.cumsum(lengths) - lengths  # index in the example of each span's first token
        return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - firsts, lengths)

    def gather(self, tokens) -> np.ndarray:
        """The example's token ids from the document ``tokens`` (any array-like of length ``doc_length``)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or len(tokens) != self.doc_length:
            raise ValueError(f"tokens must be 1-D with doc_length={self.doc_length} entries, got shape {tokens.shape}")
        return tokens[self.token_index()]


def _content_offsets(content: str, biases: np.ndarray, slack: int, rng: np.random.Generator) -> np.ndarray:
    """Eq. (5)'s offsets v_i, slack = Lx - Lc. uniform: v_0 = 0 (the paper sets u_0 = v_0 = 0), then
    v_i ~ U{v_{i-1} .. slack}; zero: v_i = 0; aligned: v_i = u_i (caller ensures Lx >= Lt)."""
    if content == "aligned":
        return biases.copy()
    offsets = np.zeros(len(biases), dtype=np.int64)
    if content == "uniform":
        for i in range(1, len(offsets)):
            offsets[i] = rng.integers(offsets[i - 1], slack, endpoint=True)
    return offsets


def _pose_ref_layout(window: int, target: int, chunks: int, rng: np.random.Generator):
    """The authors' released code: N = 2, l_0 ~ U{1 .. ceil(Lc/2)}, u_0 = 0, u_1 ~ U{0 .. Lt - Lc}."""
    if chunks != 2:
        raise ValueError(f"chunks must be 2 for sampler='pose-ref', got {chunks}")
    if window < 2:
        raise ValueError(f"window must be >= 2 for sampler='pose-ref', got {window}")
    first = int(rng.integers(1, (window + 1) // 2, endpoint=True))
    lengths = np.array([first, window - first], dtype=np.int64)
    biases = np.array([0, rng.integers(0, target - window, endpoint=True)], dtype=np.int64)
    return lengths, biases


def truncated_normal(mean: float, sigma: float, low: float, high: float, rng: np.random.Generator) -> float:
    """One draw of N(mean, sigma^2) conditioned on [low, high] (rejection: normal draws, 256 at a time, until one
    lands inside; the first that does is returned, so the draw has exactly the truncated law)."""
    if not (sigma > 0 and low <= high):
        raise ValueError(f"need sigma > 0 and low <= high, got sigma={sigma}, [{low}, {high}]")
    if low == high:
        return float(low)
    while True:
        draws = rng.normal(mean, sigma, size=256)
        inside = draws[(draws >= low) & (draws <= high)]
        if len(inside):
            return float(inside[0])


def _middle_layout(window: int, target: int, rng: np.random.Generator):
    """Middle-focused PoSE (after CREAM: Wu, Zhao and Zheng, "Never Miss A Beat: An Efficient Recipe for Context
    Window Extension of Large Language Models with Consistent 'Middle' Enhancement", arXiv 2406.07138).

    The window is cut into a head of k = floor(Lc / 3) tokens, a middle of m = Lc - 2k tokens and a tail of k
    tokens. The head keeps positions 0 .. k - 1 and the tail takes the last positions of the target window,
    Lt - k .. Lt - 1 (skip bias Lt - Lc), so both ends of the target window are trained in every example. The
    middle's skip bias is u = round((alpha - 1) * Lc), alpha ~ N(mu, sigma^2) truncated to [1, s], s = Lt / Lc,
    mu = (1 + s) / 2, sigma = ``MIDDLE_SIGMA``: u lies in [0, Lt - Lc] with mean (Lt - Lc) / 2 (the law is
    symmetric about mu), so the middle chunk sits around the middle of the target window more often than under
    PoSE's uniform bias, and the distances from the head to the middle and from the middle to the tail, both
    near Lt / 2, are trained more. k = floor(Lc / 3) and sigma are fixed choices of this implementation.
    Returns (lengths [k, m, k], biases [0, u, Lt - Lc])."""
    if window < 3:
        raise ValueError(f"window must be >= 3 for sampler='pose-middle' (head, middle and tail), got {window}")
    head = window // 3
    ratio = target / window
    alpha = truncated_normal((1 + ratio) / 2, MIDDLE_SIGMA, 1.0, ratio, rng)
    middle_bias = min(int(round((alpha - 1) * window)), target - window)
    lengths = np.array([head, window - 2 * head, head], dtype=np.int64)
    return lengths, np.array([0, middle_bias, target - window], dtype=np.int64)


def sample_example(
    doc_length: int,
    window: int,
    target: int,
    sampler: str = "pose",
    chunks: int = 2,
    content: str = "uniform",
    rng: RngLike = None,
) -> Example:
    """Sample position ids and the document spans that fill them, for a document of ``doc_length`` tokens.

    sampler: ``pose`` (paper, any ``chunks``), ``pose-ref`` (authors' code, 2 chunks), ``pose-middle`` (three
    chunks: head at 0, middle placed by a truncated Gaussian, tail at the end of the target window; see
    ``_middle_layout``; ``chunks`` is ignored), ``randpos``, ``full``
    (positions 0 .. target - 1 over the first ``target`` tokens; ``window`` is only checked), ``contiguous``
    (0 .. window - 1 over the first ``window`` tokens) or ``plain`` (ordinary fine-tuning: 0 .. window - 1 over
    ``window`` consecutive tokens at offset v ~ U{0 .. doc_length - window} with content ``uniform``, the document
    prefix otherwise). ``chunks`` is used by ``pose``/``pose-ref`` only.
    content (PoSE samplers): ``uniform``, ``zero`` or ``aligned`` offsets v_i (see ``_content_offsets``);
    ``aligned`` needs doc_length >= target. The other one-span samplers take the document prefix (v_0 = 0), so
    content has no effect there, except that ``aligned`` is rejected for ``randpos`` (its positions are not contiguous).
    Needs doc_length >= window (>= target for ``full`` and for ``aligned``).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if content not in CONTENT:
        raise ValueError(f"content must be one of {CONTENT}, got {content!r}")
    window, target = _window_target(window, target)
    doc_length = _integer("doc_length", doc_length, 1)
    if sampler == "full" and doc_length < target:
        raise ValueError(f"doc_length ({doc_length}) must be >= target ({target}) for sampler='full'")
    if content == "aligned" and sampler in ("pose", "pose-ref", "pose-middle") and doc_length < target:
        raise ValueError(f"doc_length ({doc_length}) must be >= target ({target}) for content='aligned' "
                         "(chunk i's tokens are read at the document indices of its positions)")
    if doc_length < window:
        raise ValueError(f"doc_length ({doc_length}) must be >= window ({window})")
    if sampler == "randpos" and content == "aligned":
        raise ValueError("content='aligned' is undefined for sampler='randpos' (positions are not contiguous)")
    rng = _generator(rng)

    if sampler in ("pose", "pose-ref", "pose-middle"):
        if sampler == "pose":
            lengths, biases = _pose_layout(window, target, chunks, rng)
        elif sampler == "pose-middle":
            lengths, biases = _middle_layout(window, target, rng)
        else:
            lengths, biases = _pose_ref_layout(window, target, _integer("chunks", chunks, 1), rng)
        position_ids = _chunked_positions(lengths, biases)
        offsets = _content_offsets(content, biases, doc_length - window, rng)
        firsts = np.cumsum(lengths) - lengths
        spans = [(int(v + st), int(n)) for v, st, n in zip(offsets, firsts, lengths)]
        return Example(position_ids, spans, doc_length)
    if sampler == "randpos":
        return Example(randpos_position_ids(window, target, rng), [(0, window)], doc_length)
    if sampler == "plain":
        start = int(rng.integers(0, doc_length - window, endpoint=True)) if content == "uniform" else 0
        return Example(np.arange(window, dtype=np.int64), [(start, window)], doc_length)
    length = target if sampler == "full" else window
    return Example(np.arange(length, dtype=np.int64), [(0, length)], doc_length)
