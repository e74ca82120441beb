"""Sentences of a text, as character ranges: the units that evidence (:mod:`halwatch.evidence`) is given for in an
answer and points at in a context."""

from __future__ import annotations

import re

#: A sentence ends after ``.``, ``!`` or ``?`` (and a closing quote or bracket) followed by white space and an
#: upper-case letter, a digit, a quote or a bracket (as :func:`halwatch.data.shapes.sentence_around` cuts SQuAD
#: passages), or at a line break.
CUT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])|\s*\n\s*")
HAS_WORD = re.compile(r"\w")


def sentence_ranges(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every sentence of ``text`` that holds a word, white space trimmed from both ends."""
    out = []
    start = 0
    for cut in [*CUT.finditer(text), None]:
        stop = len(text) if cut is None else cut.start()
        piece = text[start:stop]
        if HAS_WORD.search(piece):
            lead = len(piece) - len(piece.lstrip())
            out.append((start + lead, start + len(piece.rstrip())))
        if cut is not None:
            start = cut.end()
    return out
