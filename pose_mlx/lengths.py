"""The length grammar every command shares: `8192`, `8k` / `8K` / `1.5k` (k = 1024 tokens), `8x` (times the
model's original window). `parse_length` reads one length (finetune's `--target`), `parse_lengths` a comma list
(the evaluators' `--lengths`; `check_lengths` its grammar before a model says what `x` is); all raise `UserError`
naming the flag. `tokens` is the argparse type of every other flag that counts tokens (`--window`, `--original`,
`--chunk`, `--max-new-tokens`, ...): the same grammar without `x`, whose meaning (times which window?) only a
target length has.
"""

from __future__ import annotations

import argparse
import re

from .errors import UserError

#: No model reads more: a length above this is a typo (10^12), refused before anything is allocated.
MAX_LENGTH = 1 << 24
_LENGTH = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKxX]?)\s*")


def _count(text, original: int | None, flag: str, relative: bool = True) -> float:
    """The whole number of tokens `text` names (k = 1024; `x` times `original`, where `relative`), unbounded."""
    match = _LENGTH.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or (unit == "x" and not relative):
        examples = "32768, 32k, 1.5k or 8x" if relative else "8192, 8k or 1.5k"
        raise UserError(f"{flag} {text!r} is not a {'length' if relative else 'number of tokens'}: use e.g. "
                        f"{examples}")
    number = float(match.group(1))
    if unit == "x":
        if original is None:
            raise UserError(f"{flag} {text!r} is relative but the original window is unknown; pass --original")
        number *= original
    elif unit == "k":
        number *= 1024
    if abs(number - round(number)) > 1e-6:
        raise UserError(f"{flag} {text!r} is not a whole number of tokens ({number:g})")
    return number


def tokens(text) -> int:
    """argparse type of a flag counting tokens: '8192' | '8k' | '8K' | '1.5k' -> int (no `x`; each command checks
    the range of its own flag). An `argparse.ArgumentTypeError` names the value; argparse adds the flag."""
    try:
        return int(round(_count(text, None, "", relative=False)))
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).strip()) from None


def parse_tokens(text, flag: str) -> int:
    """`tokens` for a value that does not come through argparse (a YAML key): UserError naming `flag`."""
    return int(round(_count(text, None, flag, relative=False)))


def parse_length(text, original: int | None = None, flag: str = "--target") -> int:
    """'32768' | '32k' | '32K' | '1.5k' | '8x' (times `original`) -> a whole number of tokens in [2, MAX_LENGTH]."""
    number = _count(text, original, flag)
    if not 2 <= number <= MAX_LENGTH:
        raise UserError(f"{flag} {text!r} = {number:g} tokens is outside [2, {MAX_LENGTH}]")
    return int(round(number))


def _items(text, flag: str) -> list[str]:
    """The items of a comma list of lengths, none of them empty."""
    items = str(text).split(",")
    if not any(item.strip() for item in items):
        raise UserError(f"{flag}: no length given (expected e.g. 2k,4k,8192)")
    if not all(item.strip() for item in items):
        raise UserError(f"{flag}: empty item in {text!r} (expected e.g. 2k,4k,8192)")
    return items


def parse_lengths(text, original: int | None = None, flag: str = "--lengths") -> list[int]:
    """A comma list of `parse_length` items ('2k,4k,8192' or '1x,2x,4x'), sorted and unique."""
    return sorted({parse_length(item, original, flag) for item in _items(text, flag)})


def check_lengths(text, flag: str = "--lengths") -> None:
    """The grammar of a comma list of lengths before the model's window is known: each item a length, `x` items
    only read (what `8x` is depends on that window; `parse_lengths` checks their range once it is known)."""
    for item in _items(text, flag):
        match = _LENGTH.fullmatch(item)
        if not (match and match.group(2).lower() == "x"):
            parse_length(item, None, flag)


def default_lengths(original: int, maximum: int) -> list[int]:
    """Doubling from half the original window up to `maximum` (which is always included)."""
    lengths, length = [], max(2, original // 2)
    while length <= maximum:
        lengths.append(length)
        length *= 2
    if not lengths or lengths[-1] != maximum:
        lengths.append(maximum)
    return lengths


__all__ = ["MAX_LENGTH", "check_lengths", "default_lengths", "parse_length", "parse_lengths", "parse_tokens", "tokens"]
