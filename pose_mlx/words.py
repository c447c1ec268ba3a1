"""How a count reads in the commands' messages: `counted(1, "document")` is "1 document", `counted(3, "document")`
"3 documents"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, singular for exactly 1 (`plural`: the noun's plural when it does not just take an s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


__all__ = ["counted"]
