"""Shared fixtures: the real default scoring model (pulled by `make test`), real data from ../shared/data, and a
signal cache private to the test session."""

from __future__ import annotations

import pytest

from halwatch.data.ragtruth import read_ragtruth
from halwatch.models.loader import load_model
from halwatch.scorer import Scorer


@pytest.fixture(scope="session")
def smol():
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def signal_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("signals")


@pytest.fixture(scope="session")
def scorer(smol, signal_cache):
    return Scorer(model=smol, input_mode="raw", max_tokens=512, cache=signal_cache)


@pytest.fixture(scope="session")
def ragtruth_train():
    return read_ragtruth(split="train", generator="llama-2-7b-chat")


@pytest.fixture(scope="session")
def probe(ragtruth_train):
    """20 hallucinated + 20 grounded llama-2-7b-chat training answers (the first of each in file order whose
    response is under 700 characters, so that every one fits the tests' 512-token cap)."""
    short = [s for s in ragtruth_train if len(s.response) < 700]
    pos = [s for s in short if s.label == 1][:20]
    neg = [s for s in short if s.label == 0][:20]
    return pos + neg
