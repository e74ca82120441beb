"""On-disk cache of forward-pass signals, keyed by content.

The key covers everything that determines the signals: scoring model name and weights hash, input mode, the exact
token ids, the prompt/response boundary and the answer header, the signal request with the version of each reducer
it names (a changed signal definition never reuses old values), and a format version. Entries are written to a temporary
file and renamed into place, so an interrupted run leaves either a whole entry or none; an unreadable entry (e.g.
from a full disk) counts as missing and is replaced.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from halwatch.files import replaced
from halwatch.models.signal_types import SignalRequest, Signals

FORMAT_VERSION = 2


def signal_key(model_name: str, weights_hash: str, input_mode: str, input_ids, n_prompt: int,
               request: SignalRequest, n_header: int = 0, dtype: str = "float32") -> str:
    """The cache key of one sample's signals; the model's dtype is part of it unless float32 (the keys made before
    there was a choice)."""
    ids = np.asarray(input_ids, dtype=np.int64).tobytes()
    payload = json.dumps(
        {
            "v": FORMAT_VERSION,
            "model": model_name,
            "weights": weights_hash,
            "mode": input_mode,
            "ids": hashlib.sha256(ids).hexdigest(),
            "n_prompt": n_prompt,
            "n_header": n_header,
            "request": request.key(),
            **({"dtype": dtype} if dtype != "float32" else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def write_signals(file, signals: Signals) -> None:
    """One sample's signals as an ``.npz`` into a binary file object (a cache entry, or bytes sent between
    processes)."""
    np.savez(file, **signals.to_arrays())


def read_signals(file) -> Signals:
    """The signals that :func:`write_signals` wrote (a path or a binary file object)."""
    with np.load(file) as data:
        return Signals.from_arrays({k: data[k] for k in data.files})


class SignalCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.npz"

    def has(self, key: str) -> bool:
        """Whether an entry is there (not whether it reads)."""
        return self._path(key).exists()

    def get(self, key: str) -> Signals | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            return read_signals(path)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
            path.unlink(missing_ok=True)
            return None

    def put(self, key: str, signals: Signals) -> None:
        with replaced(self._path(key), binary=True) as f:
            write_signals(f, signals)
