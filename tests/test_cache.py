import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from halwatch.models import forward
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer

REQ = SignalRequest(token_stats=True, heads=((21, 6),), reducers=("mtopdiv",))


def _entries(root):
    return sorted(p for p in root.rglob("*.npz"))


def test_cache_hit_recomputes_nothing(smol, probe, tmp_path, monkeypatch):
    scorer = Scorer(model=smol, max_tokens=300, cache=tmp_path)
    first = scorer.signals(probe[:3], REQ)
    assert len(_entries(tmp_path)) == 3
    calls = []
    real_run = forward.run
    monkeypatch.setattr(forward, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    again = scorer.signals(probe[:3], REQ)
    assert calls == []
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.reduced["mtopdiv.d"], b.reduced["mtopdiv.d"])
    # a different setting is a different key
    Scorer(model=smol, max_tokens=300, input_mode="chat", cache=tmp_path).signals(probe[:1], REQ)
    assert len(_entries(tmp_path)) == 4


def test_corrupt_entry_is_recomputed(smol, probe, tmp_path):
    scorer = Scorer(model=smol, max_tokens=300, cache=tmp_path)
    good = scorer.signals(probe[:1], REQ)[0]
    entry = _entries(tmp_path)[0]
    entry.write_bytes(entry.read_bytes()[:100])  # truncated, as by a crash outside our atomic write
    again = scorer.signals(probe[:1], REQ)[0]
    np.testing.assert_array_equal(good.entropy, again.entropy)
    assert entry.stat().st_size > 100


def test_interrupted_run_resumes_without_recomputing(smol, probe, tmp_path):
    """Kill a scoring process mid-run; the next run computes only what is missing, and no entry is corrupt."""
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        from halwatch.data.ragtruth import read_ragtruth
        from halwatch.models.signal_types import SignalRequest
        from halwatch.scorer import Scorer
        samples = [s for s in read_ragtruth(split="train", generator="llama-2-7b-chat") if len(s.response) < 600][:12]
        req = SignalRequest(token_stats=True, heads=((21, 6),), reducers=("mtopdiv",))
        Scorer(max_tokens=256, cache={str(cache)!r}).signals(samples, req)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ})
    deadline = time.time() + 120
    while len(_entries(cache)) < 4 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done = _entries(cache)
    assert 4 <= len(done) < 12, "the process should have been killed mid-run"
    for entry in done:  # every entry that exists is whole (written to a temporary file, then renamed)
        with np.load(entry) as data:
            assert data["logprobs"].shape == (int(data["n_response"]),)

    from halwatch.data.ragtruth import read_ragtruth

    samples = [s for s in read_ragtruth(split="train", generator="llama-2-7b-chat") if len(s.response) < 600][:12]
    scorer = Scorer(model=smol, max_tokens=256, cache=cache)  # the process's cap: the same views, the same keys
    computed = []
    real_run = forward.run

    def counting(model, views, request):
        computed.extend(views)
        return real_run(model, views, request)

    forward.run = counting
    try:
        resumed = scorer.signals(samples, REQ)
    finally:
        forward.run = real_run
    assert len(computed) == 12 - len(done)
    fresh = Scorer(model=smol, max_tokens=256, cache=None).signals(samples, REQ)
    for a, b in zip(resumed, fresh):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.reduced["mtopdiv.d"], b.reduced["mtopdiv.d"], atol=1e-6)


def test_cached_whitebox_pass_serves_covered_requests(smol, probe, tmp_path, monkeypatch):
    from halwatch.models.forward import whitebox_request

    scorer = Scorer(model=smol, max_tokens=512, cache=tmp_path)
    full = scorer.signals(probe[:2], whitebox_request(smol))
    calls = []
    real_run = forward.run
    monkeypatch.setattr(forward, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    toha_like = SignalRequest(heads=((21, 6), (19, 0)), reducers=("mtopdiv",))
    views = [scorer.encode(s) for s in probe[:3]]
    assert scorer.cached(views, toha_like) == [True, True, False]  # what signals() will read, before it does
    served = scorer.signals(probe[:2], toha_like)
    assert calls == []
    for a, b in zip(full, served):
        np.testing.assert_array_equal(a.head_values("mtopdiv.d", [(19, 0)]), b.head_values("mtopdiv.d", [(19, 0)]))
    rows = SignalRequest(heads=((0, 0),), keep_attention=True)
    assert scorer.cached(views[:1], rows) == [False]
    scorer.signals(probe[:1], rows)  # not covered: computed
    assert calls == [1] and scorer.cached(views[:1], rows) == [True]


def test_a_changed_signal_definition_is_not_read_from_the_cache(smol, probe, tmp_path, monkeypatch):
    """The cache key carries the version of every reducer a request names: bump one (as a change to the lookback
    ratio or MTop-Div must) and its cached values are computed again, those of other reducers are still read."""
    from halwatch.signals import reducers

    scorer = Scorer(model=smol, max_tokens=300, cache=tmp_path)
    lookback = SignalRequest(heads=((21, 6),), reducers=("lookback",))
    scorer.signals(probe[:1], lookback)
    scorer.signals(probe[:1], REQ)
    calls = []
    real_run = forward.run
    monkeypatch.setattr(forward, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    old = reducers.REDUCERS["lookback"]
    monkeypatch.setitem(reducers.REDUCERS, "lookback", reducers.Reducer(old.fn, old.version + 1))
    scorer.signals(probe[:1], lookback)
    assert calls == [1]  # recomputed under the new version
    scorer.signals(probe[:1], REQ)
    assert calls == [1]  # MTop-Div's version did not change: read from the cache


def test_an_artifact_fitted_on_older_signal_definitions_is_refused(tmp_path):
    """An artifact records the version of every signal reducer it was fitted on; one made before a signal's
    definition changed (the lookback ratio's alignment, version 1 -> 2) is refused with a message to refit, never
    scored with features it was not trained on."""
    import json

    from halwatch.detectors import load_detector, read_artifact
    from halwatch.errors import HalwatchError
    from halwatch.signals.reducers import REDUCERS

    shipped = read_artifact("lookback-lens")
    assert shipped["signal_versions"] == {"lookback": REDUCERS["lookback"].version}
    load_detector("lookback-lens")  # current: loads
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**shipped, "signal_versions": {"lookback": 1}}))
    with pytest.raises(HalwatchError, match="older definitions of the signals.*lookback.*fit it again"):
        load_detector(str(old))
