"""Files that appear whole or not at all: every artifact, output, result and cache entry halwatch writes."""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path


def _fresh(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path``, created as ``open()`` creates files (``0o666``, less the umask the
    kernel applies), where ``tempfile.mkstemp`` would make it readable by its owner only."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue


@contextmanager
def replaced(path: str | Path, binary: bool = False):
    """An open file (text in UTF-8, or ``binary``) whose contents replace ``path`` when the block ends without an
    error: written to a temporary file beside it with the permissions any new file of the user gets, then renamed
    over ``path``. On an error, or an interrupt, the temporary file is removed and ``path`` is left as it was.

    A ``path`` that exists and is no regular file (``/dev/null``, a named pipe, a terminal) is written in place:
    renaming over it would replace the device or pipe itself with a plain file (as root, ``--output /dev/null`` made
    ``/dev/null`` a root-only file), and a stream has no "as it was" to keep."""
    path = Path(path)
    mode, text = ("wb", {}) if binary else ("w", {"encoding": "utf-8"})
    if path.exists() and not path.is_file():
        with open(path, mode, **text) as f:
            yield f
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _fresh(path)
    try:
        with os.fdopen(fd, mode, **text) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
