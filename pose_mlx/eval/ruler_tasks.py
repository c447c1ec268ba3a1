"""RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv 2404.06654), generated offline and sized in the evaluated model's tokens.

Task families (the templates are this project's own wording; the task definitions follow the paper):

- needle in a haystack (`niah_*`): "A special magic number for <key> is <value>." sentences hidden in a
  haystack of filler sentences (noise), of English prose (essay, `pose_mlx.eval.haystack`), or of distractor
  needles only; asked for the value(s) of one or several keys. Keys are word pairs ("lambda-iterator") or
  UUIDs, values 7-digit numbers or UUIDs.
- variable tracking (`vt`): chains "VAR ABCDE = 12345.", "VAR FGHIJ = VAR ABCDE.", ... (4 hops) in a noise
  haystack, among distractor chains; asked for every variable that holds the first chain's value.
- common words extraction (`cwe`): a numbered list where 10 words appear many times and the others a few.
- frequent words extraction (`fwe`): coded words with Zipf(2) counts, count(rank k) = floor(N k^-2 / zeta(2));
  rank 1 is the noise "..." and ranks 2-4 are the answer.

Sizing: a prompt for length L (chat template and BOS included) has at most L tokens and, where the task's
granularity allows (always for L >= 1024 here), at least 0.98 L. The haystack is read word by word; the
number of words is the largest that fits (secant steps on the token count, then bisection: a few full
tokenizations per prompt; the search depends on the sample alone), and when that falls short of 0.98 L the
next word is cut to the characters that still fit. Needles go between haystack units (sentences, or lines of
the all-needle haystack): a needle of depth d in a haystack of k complete units follows floor(d k + 1/2) of
them. Depths are spread evenly (sample i of N: needle j of n at (j + i/(N-1))/n) or seeded uniform.

Determinism: sample i of task T at length L draws from numpy streams seeded [seed, crc32(T), L, i, tag];
prompts do not depend on which other tasks run. Within a task and length the haystack text is the same for
every sample (for the all-needle haystack: the same distractors), so prompts differ from their first needle
on, which is what lets an evaluator reuse the KV cache of the shared prefix.
"""

from __future__ import annotations

import bisect
import difflib
import math
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import haystack as hay
from ..errors import UserError

NOISE = hay.FILLER
DEPTH_MODES = ("spread", "uniform")
TOLERANCE = 0.02  # a prompt for length L has between (1 - TOLERANCE) L and L tokens

NIAH_PREAMBLE = ("Some special magic values are hidden in the text below. Memorize them: you will be asked "
                 "about them at the end.")
NIAH_NEEDLE = "A special magic {noun} for {key} is {value}."
VT_PREAMBLE = ("The text below hides chains of variable assignments: a line like VAR NAME = 12345. gives NAME a "
               "value, and VAR OTHER = VAR NAME. copies it. Follow every chain.")
CWE_PREAMBLE = ("Below is a numbered list of words. A few words are repeated many times; every other word "
                "appears only a few times.")
FWE_PREAMBLE = ("Below is a text of coded words. Count how often each coded word appears, and ignore the "
                "dots '...'.")
NIAH_QUESTION = "Question: what {verb} {what} in the text above?"
NIAH_ANSWER = "Answer: the {what} {be}"
VT_QUESTION = ("Question: which variables are assigned the value {value}, directly or through other variables, "
               "in the text above?")
VT_ANSWER = "Answer: following the assignments, the {n} variables that hold the value {value} are:"
CWE_QUESTION = "Question: which 10 words appear most often in the list above?"
CWE_ANSWER = "Answer: the 10 words that appear most often in the list are:"
FWE_QUESTION = ("Question: which three coded words appear most often in the text above? Give no explanation and "
                "ignore the dots.")
FWE_ANSWER = "Answer: the three most frequent coded words in the text are:"
#: Every fixed word of the prompts: keys, variable names and answer words are drawn so as not to occur in it.
FIXED_TEXT = " ".join([NIAH_PREAMBLE, NIAH_NEEDLE, NIAH_QUESTION, NIAH_ANSWER, VT_PREAMBLE, VT_QUESTION, VT_ANSWER,
                       CWE_PREAMBLE, CWE_QUESTION, CWE_ANSWER, FWE_PREAMBLE, FWE_QUESTION, FWE_ANSWER, *NOISE]).lower()
ZETA2 = math.pi ** 2 / 6  # sum of k^-2: normalizes the Zipf(2) counts of fwe


@dataclass(frozen=True)
class Task:
    """One synthetic task: its family (`kind`) and that family's parameters."""

    name: str
    kind: str  # "niah", "vt", "cwe" or "fwe"
    summary: str
    max_new_tokens: int
    haystack: str = ""  # niah, vt: "noise", "essay" or "needles" (the haystack is distractor needles)
    key_type: str = "words"  # niah: "words" (word pairs) or "uuids"
    value_type: str = "numbers"  # niah: "numbers" (7 digits) or "uuids"
    keys: int = 1  # niah: needles with distinct keys ...
    values: int = 1  # niah: ... each with this many values ...
    queries: int = 1  # niah: ... of which the first `queries` keys are asked for
    chains: int = 2  # vt: chains of variables (the first is asked for, the others distract)
    hops: int = 4  # vt: assignments copying a variable, per chain

    @property
    def needles(self) -> int:
        if self.kind == "niah":
            return self.keys * self.values
        return self.chains * (self.hops + 1) if self.kind == "vt" else 0


def _niah(name, summary, **kw) -> Task:
    return Task(name, "niah", summary, 128, **kw)


TASKS: dict[str, Task] = {t.name: t for t in [
    _niah("niah_single_1", "one needle (word key, 7-digit value) in a noise haystack", haystack="noise"),
    _niah("niah_single_2", "one needle in an essay haystack", haystack="essay"),
    _niah("niah_single_3", "one needle with a UUID value in an essay haystack", haystack="essay",
          value_type="uuids"),
    _niah("niah_multikey_1", "4 needles with different keys in an essay, one asked for", haystack="essay", keys=4),
    _niah("niah_multikey_2", "one needle among a haystack of distractor needles", haystack="needles"),
    _niah("niah_multikey_3", "one needle among distractor needles, UUID keys and values", haystack="needles",
          key_type="uuids", value_type="uuids"),
    _niah("niah_multivalue", "4 values for one key in an essay, all asked for", haystack="essay", values=4),
    _niah("niah_multiquery", "4 keys in an essay, all asked for at once", haystack="essay", keys=4, queries=4),
    Task("vt", "vt", "variable tracking: 2 chains of 4 hops in noise, the variables of one value asked for", 30,
         haystack="noise"),
    Task("cwe", "cwe", "common words: the 10 most repeated words of a numbered list", 120),
    Task("fwe", "fwe", "frequent words: the 3 most frequent coded words of a Zipf(2) text", 50),
]}


def task_code(name: str) -> int:
    return zlib.crc32(name.encode())


# --------------------------------------------------------------------------------------------- prompts


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


class PromptFormat:
    """Turns (body, answer prefix) into the prompt text and token ids the model reads.

    Chat (the tokenizer has a chat template): the body is the user turn, the answer prefix starts the
    assistant's turn; ids = encode(text) (BOS added unless the template's text starts with it). Plain:
    text = body + newline + answer prefix, ids = [BOS] + encode(text).
    """

    SENTINEL = "@@RULER-BODY@@"

    def __init__(self, tokenizer, chat: bool | None = None):
        from . import longctx  # imports MLX: the task generators stay NumPy-only until a prompt is framed

        self.tokenizer = tokenizer
        self.chat = has_chat_template(tokenizer) if chat is None else chat
        if self.chat:
            framed = tokenizer.apply_chat_template([{"role": "user", "content": self.SENTINEL}], tokenize=False,
                                                   add_generation_prompt=True)
            parts = framed.split(self.SENTINEL)
            if len(parts) != 2:
                raise UserError("--model: the tokenizer's chat template does not keep the user message as is; "
                                "pass --no-chat to use the plain prompt")
            self.head, self.tail = parts
            bos = getattr(tokenizer, "bos_token", None)
            self.add_special = not (bos and self.head.startswith(bos))
        else:
            self.head, self.tail = "", "\n"
            self.bos = longctx.bos_id(tokenizer)

    def text(self, body: str, answer_prefix: str) -> str:
        return self.head + body + self.tail + answer_prefix

    def encode(self, text: str) -> list[int]:
        if self.chat:
            return list(self.tokenizer.encode(text, add_special_tokens=self.add_special))
        return [self.bos] + list(self.tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------- samples


@dataclass
class Needle:
    """A sentence inserted in the haystack: requested depth, where it went, and where it is in the prompt."""

    text: str
    depth: float  # requested relative depth in [0, 1]
    unit: int  # complete haystack units before it
    units: int  # complete haystack units in the prompt
    char: int  # offset of its first character in the prompt text
    token: int  # prompt tokens before it (tokens of the prompt text up to the separator before it)


@dataclass
class Sample:
    """One prompt of a task at a length, with what a correct answer must contain."""

    task: str
    length: int
    index: int
    tokens: list[int]
    text: str
    answer_prefix: str
    references: list[str]
    needles: list[Needle] = field(default_factory=list)
    size: int = 0  # haystack words (niah, vt), uncommon words (cwe) or the Zipf total N (fwe)


class TooShort(Exception):
    """The fixed part of a prompt (template, needles) alone exceeds the budget."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.tokens = tokens


class PromptTooShort(UserError):
    """A length too short for a task's template and needles, which alone take `tokens` tokens."""

    def __init__(self, task: str, length: int, tokens: int):
        super().__init__(f"--lengths: {length} tokens is too short for {task} (its template and needles alone take "
                         f"{tokens} tokens); drop it from --tasks or use longer --lengths")
        self.task, self.length, self.tokens = task, length, tokens


def fit_size(count: Callable[[int], int], budget: int, low: int, guess: int | None = None) -> int:
    """The largest n >= low with count(n) <= budget, for a nondecreasing `count` that is close to linear.

    Secant steps through the last two evaluations aim at count = budget + 1/2 (kept inside the bracket of the
    largest fitting and smallest overflowing n seen); bisection, doubling while unbracketed, after 8 steps.
    First probe: `guess`, else low + max(64, budget // 16). The search path, hence the answer where `count`
    is not quite monotone, depends only on the arguments. Raises TooShort when count(low) > budget.
    """
    known: dict[int, int] = {}

    def c(n: int) -> int:
        if n not in known:
            known[n] = count(n)
        return known[n]

    if c(low) > budget:
        raise TooShort(c(low))
    lo, hi, previous = low, None, low
    probe = guess if guess is not None and guess > low else low + max(64, budget // 16)
    for step in range(1000):
        if c(probe) <= budget:
            lo = max(lo, probe)
        else:
            hi = probe if hi is None else min(hi, probe)
        if hi is not None and hi - lo <= 1:
            return lo
        rate = (c(probe) - c(previous)) / (probe - previous) if probe != previous else 0.0
        if step < 8 and rate > 0:
            target = probe + math.floor((budget + 0.5 - c(probe)) / rate)
        else:
            target = (lo + hi) // 2 if hi is not None else 2 * lo + 1
        previous, probe = probe, (max(target, lo + 1) if hi is None else min(max(target, lo + 1), hi - 1))
    raise RuntimeError("fit_size did not converge")  # pragma: no cover  (a bracket shrinks every step)


class _Stream:
    """A haystack read word by word: unit i (a sentence or a line) is `unit(i)`, units joined by `sep`."""

    def __init__(self, unit: Callable[[int], str], sep: str):
        self.unit, self.sep = unit, sep
        self.units: list[list[str]] = []
        self.ends: list[int] = []  # words in units 0..i

    def _grow(self, words: int) -> None:
        while not self.ends or self.ends[-1] <= words:
            self.units.append(self.unit(len(self.units)).split())
            self.ends.append((self.ends[-1] if self.ends else 0) + len(self.units[-1]))

    def cut(self, words: int, chars: int = 0) -> tuple[list[str], str, int]:
        """(complete units, the partial unit's text, length of the next word) of the first `words` words,
        plus the first `chars` characters of the next word."""
        self._grow(words)
        k = bisect.bisect_right(self.ends, words)
        start = self.ends[k - 1] if k else 0
        head = self.units[k][: words - start]
        next_word = self.units[k][words - start]
        partial = " ".join(head + ([next_word[:chars]] if chars > 0 else []))
        return [" ".join(u) for u in self.units[:k]], partial, len(next_word)


def _slot(depth: float, units: int) -> int:
    return int(math.floor(depth * units + 0.5))


def weave(units: list[str], partial: str, needles: list[tuple[float, str]], sep: str):
    """Join `units` with the needles (depth-sorted (depth, text)) after floor(d k + 1/2) of the k units, then
    the partial unit; returns (text, [(unit, char offset) per needle])."""
    parts, placed, offset, j = [], [], 0, 0
    for i in range(len(units) + 1):
        while j < len(needles) and _slot(needles[j][0], len(units)) == i:
            placed.append((i, offset))
            parts.append(needles[j][1])
            offset += len(needles[j][1]) + len(sep)
            j += 1
        if i < len(units):
            parts.append(units[i])
            offset += len(units[i]) + len(sep)
    if partial:
        parts.append(partial)
    return sep.join(parts), placed


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


@dataclass
class _Draft:
    """A sample's random content, fixed before sizing: render(size, chars) -> (body, answer prefix, needles)."""

    render: Callable[[int, int], tuple[str, str, list[tuple[str, float, int, int, int]]]]
    references: list[str]
    low: int  # the smallest size
    valid: Callable[[str], bool]  # the body has no accidental copies of keys / values / references
    top_up: bool  # the size is a haystack word count whose next word may be cut to fill the budget


class PromptBuilder:
    """Builds the samples of every task for one tokenizer (see the module docstring for the contract)."""

    def __init__(self, tokenizer, samples: int, seed: int = 0, depth_mode: str = "spread",
                 haystack_dir=None, chat: bool | None = None):
        if samples < 1:
            raise UserError(f"--samples: {samples} must be >= 1")
        if seed < 0:
            raise UserError(f"--seed: {seed} must be >= 0")
        if depth_mode not in DEPTH_MODES:
            raise UserError(f"--depths: {depth_mode!r} is not one of {', '.join(DEPTH_MODES)}")
        self.fmt = PromptFormat(tokenizer, chat)
        self.samples, self.seed, self.depth_mode = samples, seed, depth_mode
        self.essay = hay.essay_units(hay.essay_text(haystack_dir))
        self.words = tuple(w for w in hay.word_pool() if w not in FIXED_TEXT)
        self._common = self._maximal_words()
        self._streams: dict[tuple, _Stream] = {}

    # -- randomness

    def rng(self, task: str, length: int, index: int, tag: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, task_code(task), length, index, tag])

    def depths(self, task: str, length: int, index: int) -> list[float]:
        """Requested needle depths of sample `index`, ascending (empty for cwe/fwe)."""
        n = TASKS[task].needles
        if n == 0:
            return []
        if self.depth_mode == "uniform":
            return sorted(float(d) for d in self.rng(task, length, index, 1).uniform(size=n))
        t = index / (self.samples - 1) if self.samples > 1 else 0.5
        return [(j + t) / n for j in range(n)]

    def _maximal_words(self) -> list[str]:
        """Pool words that are part of no other pool word (common-word answers: a reference found in an
        output is then that word, not a part of another one)."""
        joined = "|".join(self.words)
        return [w for w in self.words if joined.count(w) == 1]

    def _key(self, kind: str, rng) -> str:
        if kind == "uuids":
            return str(uuid.UUID(bytes=rng.bytes(16), version=4))
        a, b = rng.choice(len(self.words), size=2, replace=False)
        return f"{self.words[a]}-{self.words[b]}"

    def _value(self, kind: str, rng) -> str:
        if kind == "uuids":
            return str(uuid.UUID(bytes=rng.bytes(16), version=4))
        return str(int(rng.integers(10**6, 10**7)))

    # -- haystacks

    def _stream(self, task: Task, length: int) -> _Stream:
        """The haystack of `task` at `length`: noise and essay are the same for all; distractor needles are
        drawn once per task and length (and shared by its samples)."""
        key = (task.name, length) if task.haystack == "needles" else (task.haystack,)
        if key not in self._streams:
            if task.haystack == "noise":
                self._streams[key] = _Stream(lambda i: NOISE[i % len(NOISE)], " ")
            elif task.haystack == "essay":
                self._streams[key] = _Stream(lambda i: self.essay[i % len(self.essay)], " ")
            else:
                rng, noun = self.rng(task.name, length, 2**31, 2), task.value_type[:-1]
                self._streams[key] = _Stream(lambda i: NIAH_NEEDLE.format(
                    noun=noun, key=self._key(task.key_type, rng), value=self._value(task.value_type, rng)), "\n")
        return self._streams[key]

    # -- task families

    def _niah(self, task: Task, length: int, index: int, rng) -> _Draft:
        noun = task.value_type[:-1]
        keys: list[str] = []
        while len(keys) < task.keys:
            key = self._key(task.key_type, rng)
            if key not in keys:
                keys.append(key)
        values = [self._value(task.value_type, rng) for _ in range(task.keys * task.values)]
        pairs = [(keys[i // task.values], v) for i, v in enumerate(values)]
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
        depths = self.depths(task.name, length, index)
        needles = [(d, NIAH_NEEDLE.format(noun=noun, key=k, value=v)) for d, (k, v) in zip(depths, pairs)]
        asked = keys[: task.queries]
        references = [v for k, v in pairs if k in asked]
        plural = len(references) > 1
        what = f"special magic {noun}{'s' if plural else ''} for {_join_keys(asked)}"
        question = NIAH_QUESTION.format(verb="are all the" if plural else "is the", what=what)
        answer = NIAH_ANSWER.format(what=what, be="are" if plural else "is")
        stream = self._stream(task, length)

        def render(size: int, chars: int):
            units, partial, _ = stream.cut(size, chars)
            context, placed = weave(units, partial, needles, stream.sep)
            body = f"{NIAH_PREAMBLE}\n{context}\n{question}"
            start = len(NIAH_PREAMBLE) + 1
            return body, answer, [(text, d, u, len(units), start + c) for (d, text), (u, c) in zip(needles, placed)]

        def valid(body: str) -> bool:
            low = body.lower()
            if len(set(values)) != len(values) or any(low.count(v.lower()) != 1 for v in values):
                return False
            return all(low.count(k.lower()) == task.values + (k in asked) for k in keys)

        return _Draft(render, references, 0, valid, True)

    def _vt(self, task: Task, length: int, index: int, rng) -> _Draft:
        letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
        names: list[str] = []
        while len(names) < task.chains * (task.hops + 1):
            name = "".join(rng.choice(letters, size=5))
            if name not in names and name.lower() not in FIXED_TEXT:
                names.append(name)
        values = [str(v) for v in rng.choice(np.arange(10_000, 100_000), size=task.chains, replace=False)]
        chains = []
        for c in range(task.chains):
            chain = names[c * (task.hops + 1) : (c + 1) * (task.hops + 1)]
            chains.append([f"VAR {chain[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])])
        order = rng.permutation(np.repeat(np.arange(task.chains), task.hops + 1))  # a random interleaving
        cursor = [0] * task.chains
        statements = []
        for c in order:
            statements.append(chains[c][cursor[c]])
            cursor[c] += 1
        needles = list(zip(self.depths(task.name, length, index), statements))
        references = names[: task.hops + 1]
        question = VT_QUESTION.format(value=values[0])
        answer = VT_ANSWER.format(n=task.hops + 1, value=values[0])
        stream = self._stream(task, length)

        def render(size: int, chars: int):
            units, partial, _ = stream.cut(size, chars)
            context, placed = weave(units, partial, needles, stream.sep)
            body = f"{VT_PREAMBLE}\n{context}\n{question}"
            start = len(VT_PREAMBLE) + 1
            return body, answer, [(text, d, u, len(units), start + c) for (d, text), (u, c) in zip(needles, placed)]

        def valid(body: str) -> bool:  # each name: its statement and the next hop's; values: statement (+ question)
            low = body.lower()
            for c, chain in enumerate(chains):
                for i, name in enumerate(names[c * (task.hops + 1) : (c + 1) * (task.hops + 1)]):
                    if low.count(name.lower()) != (1 if i == task.hops else 2):
                        return False
                if low.count(values[c]) != (2 if c == 0 else 1):
                    return False
            return True

        return _Draft(render, references, 0, valid, True)

    def _cwe(self, task: Task, length: int, index: int, rng) -> _Draft:
        common_reps, rare_reps = (30, 3) if length >= 4096 else (6, 1)
        common = [self._common[i] for i in rng.choice(len(self._common), size=10, replace=False)]
        rest = [self.words[i] for i in rng.permutation(len(self.words)) if self.words[i] not in common]
        extra = self.rng(task.name, length, index, 2)
        seen = set(rest)

        def rare(u: int) -> list[str]:  # the pool, then word pairs once the pool is used up
            while len(rest) < u:
                a, b = extra.choice(len(rest), size=2, replace=False)
                pair = f"{rest[a]}-{rest[b]}"
                if pair not in seen:
                    seen.add(pair)
                    rest.append(pair)
            return rest[:u]

        question, answer = CWE_QUESTION, CWE_ANSWER

        def render(size: int, chars: int):
            words = common * common_reps + rare(size) * rare_reps
            order = np.random.default_rng([self.seed, task_code(task.name), length, index, 3, size])
            listing = " ".join(f"{i + 1}. {words[j]}" for i, j in enumerate(order.permutation(len(words))))
            return f"{CWE_PREAMBLE}\n{listing}\n{question}", answer, []

        return _Draft(render, common, 0, lambda body: True, False)

    def _fwe(self, task: Task, length: int, index: int, rng) -> _Draft:
        size = max(length // 50, 8)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        vocab: list[str] = ["..."]
        while len(vocab) < size:
            word = "".join(rng.choice(letters, size=6))
            if word not in vocab and word not in FIXED_TEXT:
                vocab.append(word)
        ranks = np.arange(1, size + 1, dtype=np.float64)
        question, answer = FWE_QUESTION, FWE_ANSWER

        def render(n: int, chars: int):
            counts = np.floor(n * ranks**-2 / ZETA2).astype(int)
            counts[4:] = np.minimum(counts[4:], counts[3] - 1)  # the top three (ranks 2-4) are unique
            words = np.repeat(np.array(vocab, dtype=object), counts)
            order = np.random.default_rng([self.seed, task_code(task.name), length, index, 3, n])
            return f"{FWE_PREAMBLE}\n{' '.join(words[order.permutation(len(words))])}\n{question}", answer, []

        low = math.ceil(16 * ZETA2)  # the smallest N that gives rank 4 a count >= 1
        return _Draft(render, vocab[1:4], low, lambda body: True, False)

    # -- sizing

    def sample(self, task_name: str, length: int, index: int) -> Sample:
        """Sample `index` of `task_name` with a prompt of (1 - TOLERANCE) L .. L tokens for L = `length`
        (fewer only where one haystack word is more than TOLERANCE L tokens). Content that happens to collide
        (a key or value also in the essay or in a distractor) is drawn again."""
        task = TASKS[task_name]
        make = {"niah": self._niah, "vt": self._vt, "cwe": self._cwe, "fwe": self._fwe}[task.kind]
        rng = self.rng(task_name, length, index, 0)
        for _attempt in range(100):
            draft = make(task, length, index, rng)
            sample, body = self._fit(task, length, index, draft)
            if draft.valid(body):
                return sample
        raise RuntimeError(f"{task_name}: no valid sample in 100 draws")  # pragma: no cover

    def _fit(self, task: Task, length: int, index: int, draft: _Draft) -> tuple[Sample, str]:
        fmt, memo = self.fmt, {}

        def tokens(size: int, chars: int = 0) -> list[int]:
            if (size, chars) not in memo:
                body, answer, _ = draft.render(size, chars)
                memo[size, chars] = fmt.encode(fmt.text(body, answer))
            return memo[size, chars]

        try:
            size = fit_size(lambda n: len(tokens(n)), length, draft.low)
        except TooShort as short:
            raise PromptTooShort(task.name, length, short.tokens) from None
        chars = 0
        if draft.top_up and len(tokens(size)) < math.ceil((1 - TOLERANCE) * length):
            lo, hi = 0, self._stream(task, length).cut(size)[2] - 1  # (all of it would be size + 1 words)
            while lo < hi:  # the most characters of the next word that still fit
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if len(tokens(size, mid)) <= length else (lo, mid - 1)
            chars = lo
        body, answer, placed = draft.render(size, chars)
        text = fmt.text(body, answer)
        needles = []
        for needle_text, depth, unit, units, char in placed:
            at = len(fmt.head) + char
            before = text[: at - 1] if at > 0 and text[at - 1].isspace() else text[:at]
            needles.append(Needle(needle_text, depth, unit, units, at, len(fmt.encode(before))))
        sample = Sample(task.name, length, index, tokens(size, chars), text, answer, list(draft.references),
                        needles, size)
        return sample, body


def unknown_task_message(name: str) -> str:
    close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"--tasks: unknown task {name!r}{hint} (tasks: all, {', '.join(TASKS)})"


def parse_tasks(text: str) -> list[str]:
    """`all` or a comma list of task names (in TASKS order, duplicates dropped); UserError names the closest."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError("--tasks: empty (give `all` or task names)")
    if "all" in items:
        return list(TASKS)
    for item in items:
        if item not in TASKS:
            raise UserError(unknown_task_message(item))
    return [t for t in TASKS if t in items]


__all__ = ["DEPTH_MODES", "NOISE", "Needle", "PromptBuilder", "PromptFormat", "PromptTooShort", "Sample", "TASKS", "TOLERANCE", "Task",
           "TooShort", "fit_size", "has_chat_template", "parse_tasks", "weave"]
