"""What a command tells the user on standard error besides errors, progress bars for long work and one-line
status notes, all made here, so that ``halwatch -q`` can silence them."""

from __future__ import annotations

_quiet = False


def set_quiet(quiet: bool) -> None:
    """``True``: no progress bar or note anywhere (``halwatch -q``: only errors on standard error)."""
    global _quiet
    _quiet = bool(quiet)


def progress(iterable=None, disable: bool = False, **kwargs):
    """A tqdm bar (``desc``, ``total``, ``unit`` ...), disabled when asked or when quiet."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=disable or _quiet, dynamic_ncols=True, **kwargs)


def note(message: str) -> None:
    """A status line on standard error (what was written where), unless quiet."""
    import sys

    if not _quiet:
        print(message, file=sys.stderr)
