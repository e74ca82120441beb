"""Files that appear whole or not at all: every artifact, output, result and cache entry halwatch writes."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

#: The process's umask at import: reading it by ``os.umask`` means setting it, which is not safe once threads
#: write, so :func:`umask` reads Linux's ``/proc/self/status`` and falls back to this where there is none.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def umask() -> int:
    """The process's umask now."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK


@contextmanager
def replaced(path: str | Path, binary: bool = False):
    """An open file (text in UTF-8, or ``binary``) whose contents replace ``path`` when the block ends without an
    error: written to a temporary file beside it, given the permissions any new file of the user gets (``0o666``
    less the umask: a temporary file alone would be readable by its owner only), then renamed over ``path``. On an
    error, or an interrupt, the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
