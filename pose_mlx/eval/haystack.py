"""Offline text for synthetic long-context tasks: haystacks (the text needles hide in) and word lists.

- The noise haystack is `FILLER` repeated (the passkey test's five sentences).
- The essay haystack is English prose available on every CPython install: the language reference that
  `pydoc` ships (`pydoc_data.topics.topics`, the topics in sorted order), or the .txt/.md/.rst files of a
  folder (`essay_text(folder)`). Whitespace is normalized to single spaces.
- `essay_units` cuts it into sentences (split after . ! or ? followed by a space) of at most `MAX_UNIT_WORDS`
  words (longer ones, e.g. grammar listings, are cut into pieces), the units between which needles go.
- `word_pool` is the sorted set of lowercase words of 4-12 letters of the language reference (seen twice or
  more), minus common function words: the vocabulary of needle keys and of the common-words task.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

from ..errors import UserError

HAYSTACK_SUFFIXES = (".txt", ".md", ".rst")
#: The noise haystack: five sentences repeated (the passkey test's filler, Mohtashami & Jaggi 2023).
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
MAX_UNIT_WORDS = 40

#: Function words kept out of `word_pool` (a model may write them whatever it read).
STOPWORDS = frozenset("""
about above after again against also always among another because been before being below between both
cannot could does doing done down during each either else every from further have having here into itself
just last like made make many more most must need never next only other otherwise over same should since
some such than that their them then there these they this those though through under until upon used uses
using very were what when where whether which while will with within without would your
""".split())


def _normalize(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=1)
def reference_text() -> str:
    """The language reference shipped with CPython (`pydoc_data.topics`), whitespace-normalized (~450 KB)."""
    from pydoc_data.topics import topics  # ~450 KB of text: read only when the default haystack is used

    return _normalize(" ".join(topics[name] for name in sorted(topics)))


def essay_text(folder: str | Path | None = None) -> str:
    """The essay haystack: the language reference, or every .txt/.md/.rst file under `folder` (sorted paths)."""
    if folder is None:
        return reference_text()
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"--haystack: {root} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in HAYSTACK_SUFFIXES)
    if not files:
        raise UserError(f"--haystack: {root} has no {'/'.join(HAYSTACK_SUFFIXES)} files")
    text = _normalize(" ".join(p.read_text(encoding="utf-8", errors="replace") for p in files))
    if len(text.split()) < 100:
        raise UserError(f"--haystack: the files under {root} hold only {len(text.split())} words (need >= 100)")
    return text


def essay_units(text: str) -> list[str]:
    """Sentences of `text` (split after . ! ? and a space), each cut into pieces of <= MAX_UNIT_WORDS words."""
    units = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        words = sentence.split()
        for start in range(0, len(words), MAX_UNIT_WORDS):
            units.append(" ".join(words[start : start + MAX_UNIT_WORDS]))
    return [u for u in units if u]


@functools.lru_cache(maxsize=1)
def word_pool() -> tuple[str, ...]:
    """Sorted lowercase words of the reference: 4-12 letters, not glued to code (no `_`, `.`, `(` around),
    seen at least twice (no one-off example strings), not in STOPWORDS."""
    counts = Counter(re.findall(r"(?<![\w.])[a-z]{4,12}(?![\w(])", reference_text()))
    return tuple(sorted(w for w, n in counts.items() if n >= 2 and w not in STOPWORDS))


__all__ = ["HAYSTACK_SUFFIXES", "MAX_UNIT_WORDS", "essay_text", "essay_units", "reference_text", "word_pool"]
