"""Shared fixtures: the real default scoring model (pulled by `make test`), real data from ../shared/data, and a
signal cache private to the test session."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from halwatch.data.ragtruth import read_ragtruth
from halwatch.models.loader import load_model
from halwatch.scorer import Scorer

_TEST_HOME: Path | None = None
_OWNS_HOME = False


def pytest_configure(config):
    """Tests never write into the user's ``HALWATCH_HOME``: the session (and every process it starts) gets a
    temporary one, in which only the pulled models and downloads are links to the real ones. The two pytest-xdist
    workers of `make test` share the one their controller made (its signal cache among it): an answer's forward
    pass that one worker cached, the other reads."""
    global _TEST_HOME, _OWNS_HOME
    from halwatch.models import registry

    shared = os.environ.get("HALWATCH_TEST_HOME")
    if shared:
        _TEST_HOME = Path(shared)
    else:
        real = registry.home()
        _TEST_HOME, _OWNS_HOME = Path(tempfile.mkdtemp(prefix="halwatch-test-home-")), True
        for name in ("models", "downloads"):
            if (real / name).is_dir():
                (_TEST_HOME / name).symlink_to(real / name, target_is_directory=True)
        os.environ["HALWATCH_TEST_HOME"] = str(_TEST_HOME)
    os.environ["HALWATCH_HOME"] = str(_TEST_HOME)
    # every figure the tests compare (NumPy references at 1e-5, batched against one-by-one at 1e-4, fitted
    # artifacts) is float32's; `auto` would pick bfloat16 on a CPU that has it (tests/test_device.py checks that)
    os.environ["HALWATCH_DTYPE"] = "float32"
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers (pytest-xdist): one core each
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config):
    if _OWNS_HOME:
        shutil.rmtree(_TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def spans_of():
    """``spans_of(detector, sample)``: the spans `halwatch score` reports for one answer with this detector (the one
    scoring path, :class:`halwatch.pipeline.Pipeline`), as dicts."""
    from halwatch.pipeline import Pipeline

    def find(detector, sample) -> list[dict]:
        pipeline = Pipeline(detector)
        return [s.model_dump() for s in pipeline.score(pipeline.encode([sample]))[0].spans]

    return find


@pytest.fixture(scope="session")
def smol():
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hw(smol):
    """The one face, ``halwatch.load()``, on the session's default model: the shipped default, float32."""
    import halwatch

    return halwatch.load(model=smol)


@pytest.fixture(scope="session")
def signal_cache():
    """The test home's signal cache: the one `halwatch` commands run by the tests use too."""
    return _TEST_HOME / "signals"


@pytest.fixture(scope="session")
def scorer(smol, signal_cache, probe):
    """The session's raw-input scorer, its cache holding the shared white-box pass of the probe answers: every
    white-box detector fitted on the probe reads it instead of running its own pass."""
    from halwatch.models.forward import whitebox_request

    scorer = Scorer(model=smol, input_mode="raw", max_tokens=512, cache=signal_cache)
    request = whitebox_request(smol)
    # the two pytest-xdist workers fill the shared cache from opposite ends, four answers at a time, each reading
    # what the other has written: when both need the pass at once, each runs about half of it (instead of one
    # waiting, its core idle, for the other's), and an answer is computed twice at most in the chunk where they meet
    order = probe[::-1] if os.environ.get("PYTEST_XDIST_WORKER") == "gw1" else probe
    for start in range(0, len(order), 4):
        scorer.signals(order[start:start + 4], request)
    return scorer


@pytest.fixture(scope="session")
def ragtruth_train():
    return read_ragtruth(split="train", generator="llama-2-7b-chat")


@pytest.fixture(scope="session")
def probe(ragtruth_train):
    """20 hallucinated + 20 grounded llama-2-7b-chat training answers (the first of each in file order whose
    response is under 600 characters and prompt under 2,000, so that most fit the tests' 512-token cap in one view;
    12 longer ones are scored in 2 windows each)."""
    short = [s for s in ragtruth_train if len(s.response) < 600 and len(s.prompt) < 2000]
    pos = [s for s in short if s.label == 1][:20]
    neg = [s for s in short if s.label == 0][:20]
    return pos + neg


@pytest.fixture(scope="session")
def probe_by_size(probe):
    """The probe's answers, shortest first (prompt and response characters): tests that need only a few forward
    passes take them from the front."""
    return sorted(probe, key=lambda s: len(s.prompt) + len(s.response))


@pytest.fixture(scope="session")
def short_answers():
    """``(fit, held_out)``: SQuAD-built answers for the detectors whose own pass costs several forward passes per
    answer (relevance, every token's attention rows, sampling). Each is a passage's sentence holding a SQuAD answer
    (grounded) or the same sentence with that answer swapped for another of its type (hallucinated; the swapped
    words are its span), rendered as a question over the passage. ``fit``: both answers of the 4 questions with the
    shortest passages, one question per article (so that folds by source have 4 sources); ``held_out``: the grounded
    answer of the 5th and the swapped one of the 6th. 110-180 tokens each, a third of the probe's answers."""
    from halwatch.data.shapes import build_squad_shapes

    pairs: dict[str, dict] = {}
    for s in build_squad_shapes(n_questions=400, n_unanswerable=0, seed=0):
        if s.meta["shape"] in ("sentence", "sentence-swap"):
            pairs.setdefault(s.meta["question_id"], {})[s.label] = s
    size = lambda pair: len(pair[0].context) + len(pair[0].question) + len(pair[0].response)  # noqa: E731
    chosen, titles = [], set()
    for pair in sorted((p for p in pairs.values() if len(p) == 2), key=size):
        if pair[0].meta["title"] not in titles:
            chosen.append(pair)
            titles.add(pair[0].meta["title"])
    fit = [p[1] for p in chosen[:4]] + [p[0] for p in chosen[:4]]
    return fit, [chosen[4][0], chosen[5][1]]


@pytest.fixture
def halwatch(capsys):
    """Run a `halwatch` command in this process, as `halwatch.cli.main` does for the installed command: returns a
    ``CompletedProcess`` (exit status, standard output and error as text); ``check`` asserts the status is 0.

    A separate process costs 13-18 s before it does anything (importing torch and transformers, loading the model);
    tests that need one of their own (the entry point, signals, kills, resumes) start it themselves."""
    from halwatch.cli import main

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's refusals and --help
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        if check:
            assert code == 0, err
        return subprocess.CompletedProcess(["halwatch", *args], code, out, err)

    return run


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium, headless, driven by Playwright."""
    playwright = pytest.importorskip("playwright.sync_api")
    path = "/usr/bin/chromium"
    assert os.path.exists(path), "Debian's chromium package is needed (make test installs it)"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()
