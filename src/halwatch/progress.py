"""What a command tells the user on standard error besides errors, progress bars for long work and one-line
status notes, all made here, so that ``halwatch -q`` can silence them."""

from __future__ import annotations

import logging
import sys

_quiet = False


class _CurrentStderr(logging.StreamHandler):
    """Writes each record to whatever ``sys.stderr`` is when it is emitted (as :data:`logging.lastResort` does), so
    that a command run in a process whose stderr is replaced later (a test capturing it, ``main()`` called twice)
    writes where that call's output goes, with no handler to swap."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ and setStream assign it: the current stderr always wins
        pass


def configure_logging(quiet: bool) -> None:
    """The command's log lines on standard error as ``halwatch: message``: warnings, or only errors when quiet.
    Adds one handler to the root logger the first time, leaves the others (a host's, a test runner's) in place."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _CurrentStderr)), None)
    if handler is None:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("halwatch: %(message)s"))
        root.addHandler(handler)
    handler.setLevel(logging.ERROR if quiet else logging.WARNING)
    if root.level > logging.WARNING:  # a record must reach the handler to be written or filtered there
        root.setLevel(logging.WARNING)


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
    if not _quiet:
        print(message, file=sys.stderr)
