"""Counted nouns in messages and tables: `count(1, "rank")` is '1 rank', `count(2, "rank")` '2 ranks'.

    >>> count(1, "device"), count(960, "device"), count(2, "process"), count(0, "entry")
    ('1 device', '960 devices', '2 processes', '0 entries')
    >>> count(3, "micro-batch"), count(1, "staging folder"), count(2, "datum", "data")
    ('3 micro-batches', '1 staging folder', '2 data')
"""

from __future__ import annotations


def plural(noun: str) -> str:
    """English plural of a regular noun (the last word of `noun`): rank -> ranks, process ->
    processes, entry -> entries."""
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        return noun[:-1] + "ies"
    return noun + "s"


def count(number: int, noun: str, plural_form: str | None = None) -> str:
    """'<number> <noun>' with the noun in the plural unless the number is exactly one."""
    return f"{number} {noun if number == 1 else plural_form or plural(noun)}"
