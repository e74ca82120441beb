"""Shared fixtures: the real default scoring model (pulled by `make test`), real data from ../shared/data, and a
signal cache private to the test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from halwatch.data.ragtruth import read_ragtruth
from halwatch.models.loader import load_model
from halwatch.scorer import Scorer

_TEST_HOME: Path | None = None


def pytest_configure(config):
    """Tests never write into the user's ``HALWATCH_HOME``: the session (and every process it starts) gets a
    temporary one, in which only the pulled models and downloads are links to the real ones."""
    global _TEST_HOME
    from halwatch.models import registry

    real = registry.home()
    _TEST_HOME = Path(tempfile.mkdtemp(prefix="halwatch-test-home-"))
    for name in ("models", "downloads"):
        if (real / name).is_dir():
            (_TEST_HOME / name).symlink_to(real / name, target_is_directory=True)
    os.environ["HALWATCH_HOME"] = str(_TEST_HOME)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers (pytest-xdist): one core each
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config):
    if _TEST_HOME is not None:
        shutil.rmtree(_TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def smol():
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def signal_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("signals")


@pytest.fixture(scope="session")
def scorer(smol, signal_cache, probe):
    """The session's raw-input scorer, its cache holding the shared white-box pass of the probe answers: every
    white-box detector fitted on the probe reads it instead of running its own pass."""
    from halwatch.models.forward import whitebox_request

    scorer = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=signal_cache)
    scorer.signals(probe, whitebox_request(smol))
    return scorer


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
