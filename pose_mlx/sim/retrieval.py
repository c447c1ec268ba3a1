"""Synthetic retrieval documents for the simulator's pre-training and fine-tuning, never in the passkey test's
wording (no "pass key", none of its sentences around the needle or question).

Three kinds, cycling through KINDS (half needles, a fifth tables, three tenths repeats):

- needle: "The {name} is {k}." in one of several phrasings, at a random depth among filler sentences, then a
  question about the name ("What is the {name}? The {name} is", ...) and the answer " {k}."; half of them open
  with an instruction of their own wording, half put preamble, filler, needle and question on lines of their own
  (the layout of a prompt), the others run them on as one paragraph. Names are one or two
  words of `pose_mlx.eval.haystack.word_pool()` (about 1,700 words; never "pass" or "key"), so what the model can learn
  is to find the phrase and copy what followed it, not a fixed name; keys are 5-digit numbers. The filler is the
  passkey test's own neutral sentences (`haystack.FILLER`).
- table: "word = k; word = k; ..." then "Lookup word: k.".
- repeat: a random run of words and numbers, then " | again: " and the same run (in-context copying, the skill
  behind induction heads).

Every document's first `length` tokens (BOS included) hold the task and its answer; a blank line and neutral
filler follow, so a document fills a whole block of `length` tokens.
"""

from __future__ import annotations

import numpy as np

from ..eval.haystack import FILLER, word_pool

KINDS = ("needle",) * 5 + ("table",) * 2 + ("repeat",) * 3
NEEDLES = ("The {name} is {key}.", "Remember: the {name} is {key}.", "Note it down, the {name} is {key}.",
           "The {name} is {key}. Do not forget it. {key} is the {name}.")
PREAMBLES = ("Read the text below and remember the numbers in it.",
             "A number is hidden in the following lines; you will be asked for it.",
             "Some of the lines below matter. Keep them in mind.")
QUESTIONS = ("What is the {name}? The {name} is", "Tell me the {name}. The {name} is",
             "Question: what was the {name}? Answer:", "So the {name} is")
EXCLUDED = frozenset({"pass", "key"})  # the passkey test's own words


class _Sizes:
    """Token counts of text pieces as they appear after a space (cached), and of whole texts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def piece(self, piece: str) -> int:
        if piece not in self.cache:
            self.cache[piece] = self.text("x " + piece) - self.text("x")
        return self.cache[piece]


def _fill(sizes: _Sizes, budget: int, make, grow, copies: int = 1, fixed: int = 0) -> str:
    """The longest `make(items)` within `budget` tokens, `items` grown one `grow()` at a time while `fixed` plus
    the pieces' sizes (`copies` times each) fit, then shrunk while the whole text is longer."""
    items, total = [], fixed
    while True:
        item = grow()
        if total + copies * sizes.piece(item) > budget:
            break
        items.append(item)
        total += copies * sizes.piece(item)
    while len(items) > 1 and sizes.text(make(items)) > budget:
        items.pop()
    return make(items)


def retrieval_documents(tokenizer, count: int, length: int, seed: int) -> list[str]:
    """`count` documents (kinds cycling through KINDS) whose first `length` tokens, BOS included, hold the task and
    its answer. Empty when `length` cannot hold the longest needle document without filler."""
    sizes = _Sizes(tokenizer)
    pool = [w for w in word_pool() if w not in EXCLUDED]
    rng = np.random.default_rng(seed)
    budget = length - 2  # BOS, and a token of slack for the merge of the answer with what follows
    longest = NEEDLES[3].format(name="w w", key=99_999) + " " + QUESTIONS[2].format(name="w w") + " 99999."
    if sizes.text(longest) + 8 > budget:
        return []
    tail = " ".join(FILLER[i % len(FILLER)] for i in range(length))  # >= length tokens

    def word():
        return pool[int(rng.integers(len(pool)))]

    def number():
        return str(int(rng.integers(10_000, 100_000)))

    docs = []
    for i in range(count):
        kind, u = KINDS[i % len(KINDS)], rng.uniform()
        if kind == "needle":
            name, key = " ".join(word() for _ in range(int(rng.integers(1, 3)))), number()
            needle = NEEDLES[int(rng.integers(len(NEEDLES)))].format(name=name, key=key)
            question = QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(name=name)
            preamble = PREAMBLES[int(rng.integers(len(PREAMBLES)))] if rng.uniform() < 0.5 else ""
            sep = "\n" if rng.uniform() < 0.5 else " "

            def make(sentences, needle=needle, question=question, key=key, preamble=preamble, sep=sep):
                cut = int(round(u * len(sentences)))
                parts = [preamble, " ".join(sentences[:cut]), needle, " ".join(sentences[cut:]), question]
                return sep.join(p for p in parts if p) + f" {key}."

            text = _fill(sizes, budget, make, lambda: FILLER[int(rng.integers(len(FILLER)))],
                         fixed=sizes.text(make([])))
        elif kind == "table":
            def make(pairs):
                word_, value = pairs[int(u * len(pairs))].rstrip(";").split(" = ")
                return " ".join(pairs) + f" Lookup {word_}: {value}."

            text = _fill(sizes, budget - 12, make, lambda: f"{word()} = {number()};")
        else:
            def make(run):
                return " ".join(run) + " | again: " + " ".join(run)

            text = _fill(sizes, budget - 4, make, lambda: word() if rng.uniform() < 0.5 else number()[:3], copies=2)
        docs.append(text + "\n\n" + tail)
    return docs


__all__ = ["KINDS", "retrieval_documents"]
