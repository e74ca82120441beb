"""Scale-out on Ray: a real local Ray cluster (2 CPUs, loopback, its files in a temporary folder), started by the
module and shut down with it. Ray scoring equals local scoring on real RAGTruth answers; an interrupted run resumes
without duplicates; a failing record is reported with its id and the others are kept; ``halwatch bench --ray`` fills
the same signal cache as a local pass."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

# Ray's single-machine mode, read when ray is imported: the cluster's servers listen on 127.0.0.1 only (and the
# `halwatch score --ray` commands started here inherit it)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="the Ray extra (pip install -e '.[ray]'; make test installs it)")

import halwatch  # noqa: E402
from halwatch.data.jsonl import sample_record, write_jsonl  # noqa: E402
from halwatch.sample import Sample  # noqa: E402
from halwatch.scale import finished_ids, score_records  # noqa: E402

DEMO = os.path.join(os.path.dirname(__file__), os.pardir, "src", "halwatch", "examples", "demo.jsonl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The address of a local Ray cluster that this module starts on 127.0.0.1 and stops."""
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                       _temp_dir=str(tmp_path_factory.mktemp("ray")), configure_logging=False)
    address = context.address_info["gcs_address"]
    assert address.startswith("127.0.0.1:")
    yield address
    ray.shutdown()


@pytest.fixture(scope="module")
def records(short_answers):
    """Eight real answers (conftest's SQuAD-built answers of short passages), as JSONL records."""
    return [sample_record(s) for s in short_answers[0]]


@pytest.fixture(scope="module")
def local(records, smol):
    """The same records scored in this process by the shipped default, as `halwatch score` does."""
    return {r.id: r.to_dict() for r in halwatch.load(model=smol).check_many(records)}


def _same(got: dict, expected: dict) -> None:
    assert got["id"] == expected["id"] and got["hallucinated"] == expected["hallucinated"]
    assert got["score"] == pytest.approx(expected["score"], abs=1e-4)
    assert [(s["start"], s["end"]) for s in got["spans"]] == [(s["start"], s["end"]) for s in expected["spans"]]


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_ray_scores_equal_local_scores_in_input_order(cluster, records, local, tmp_path):
    out = tmp_path / "out.jsonl"
    stats = score_records(records, out, address=cluster, actors=2, batch_size=3, progress=False)
    assert stats == {"scored": len(records), "skipped": 0, "failed": []}
    got = _read(out)
    assert [g["id"] for g in got] == [r["id"] for r in records]
    for g in got:
        _same(g, local[g["id"]])
    again = score_records(records, out, address=cluster, progress=False)  # everything is there: nothing to do
    assert again == {"scored": 0, "skipped": len(records), "failed": []} and len(_read(out)) == len(records)


def test_the_drivers_precision_choice_reaches_the_actors(cluster, records, local, tmp_path, monkeypatch):
    """`HALWATCH_DTYPE` set where `halwatch score --ray` runs reaches the actors (this cluster's processes were
    started with the session's float32 pin): they score in bfloat16, as this process does with the same choice, and
    return exactly its results (on a CPU every answer has a pass of its own, so no batch-mate's padding moves a
    bfloat16 score)."""
    monkeypatch.setenv("HALWATCH_DTYPE", "bfloat16")
    out = tmp_path / "out.jsonl"
    score_records(records[:3], out, scorer_options={"dtype": "auto", "batch_size": None}, address=cluster,
                  batch_size=3, progress=False)
    here = halwatch.load()  # auto: bfloat16 here too
    assert here.pipeline.scorer.identity()["dtype"] == "bfloat16"
    half = {r.id: r.to_dict() for r in here.check_many(records[:3])}
    assert {g["id"]: g for g in _read(out)} == half
    assert max(abs(half[i]["score"] - local[i]["score"]) for i in half) > 1e-4  # float32's scores differ


def _command(input_path, output, address, *extra) -> list[str]:
    return [sys.executable, "-m", "halwatch", "score", "--input", str(input_path), "--output", str(output),
            "--ray", address, "--ray-batch", "1", *extra]


def test_an_interrupted_run_resumes_without_duplicates(cluster, records, local, tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, records)
    out = tmp_path / "out.jsonl"
    first = subprocess.Popen(_command(path, out, cluster), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # killed mid-run
    first.wait()
    partial = finished_ids(out)
    assert 2 <= len(partial) < len(records), "the run was not interrupted part-way"
    with open(out, "ab") as f:  # as if it had died in the middle of writing a line
        f.write(b'{"id": "cut sh')
    done = subprocess.run(_command(path, out, cluster), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "half-written last line" in done.stderr and f"{len(partial)} already in" in done.stderr
    got = _read(out)
    assert [g["id"] for g in got] == [r["id"] for r in records]  # each once, in the input's order
    for g in got:
        _same(g, local[g["id"]])


def test_the_task_option_reaches_ray(cluster, smol, tmp_path):
    """``--task dialogue`` renders contexts without a question as dialogue on the Ray path too: the scores equal
    this process's with the dialogue template and differ from the default (summary) rendering."""
    from halwatch.data.jsonl import read_jsonl

    demo = [s for s in read_jsonl(DEMO) if s.question is None]  # the summary pair: a context and no question
    here = halwatch.load(model=smol)

    def scores(task):
        samples = [Sample(context=s.context, response=s.response, id=s.id, task=task) for s in demo]
        return {r.id: r.score for r in here.check_many(samples)}

    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, [{"id": s.id, "context": s.context, "response": s.response} for s in demo])
    done = subprocess.run(_command(path, out, cluster, "--task", "dialogue"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    got = {g["id"]: g["score"] for g in _read(out)}
    dialogue, summary = scores("dialogue"), scores(None)
    assert got == pytest.approx(dialogue, abs=1e-4)
    assert all(abs(dialogue[k] - summary[k]) > 1e-3 for k in got)


def test_a_failing_record_is_reported_with_its_id_and_the_others_kept(cluster, records, tmp_path):
    """A response longer than the token cap cannot be scored (it is never cut): that record fails on its actor,
    is named with its id, and every other record is written."""
    long_answer = {"id": "too-long", "prompt": records[0]["prompt"], "response": "word " * 300}
    path = tmp_path / "in.jsonl"
    write_jsonl(path, records[:3] + [long_answer] + records[3:5])
    out = tmp_path / "out.jsonl"
    done = subprocess.run(_command(path, out, cluster, "--max-tokens", "256"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1
    assert [g["id"] for g in _read(out)] == [r["id"] for r in records[:5]]
    errors = _read(f"{out}.errors.jsonl")
    assert [e["id"] for e in errors] == ["too-long"] and "token" in errors[0]["error"]
    assert "1 failed" in done.stderr and "too-long" in done.stderr


def test_bench_signals_from_ray_equal_a_local_pass(cluster, smol, short_answers, tmp_path):
    """The signals Ray actors compute for the benchmark harness (``halwatch bench --ray``) equal this process's
    own pass, and land in the scorer's cache."""
    from halwatch.models.forward import whitebox_request
    from halwatch.scale import ray_signals
    from halwatch.scorer import Scorer

    samples = short_answers[0][:3]
    scorer = Scorer(model=smol, max_tokens=512, cache=tmp_path / "signals",
                    remote=lambda me, todo, req: ray_signals(me, todo, req, address=cluster, actors=1))
    request = whitebox_request(smol)
    remote = scorer.signals(samples, request)
    assert len(list((tmp_path / "signals").rglob("*.npz"))) == len(samples)
    mine = Scorer(model=smol, max_tokens=512, cache=None).signals(samples, request)
    for a, b in zip(remote, mine):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.reduced["lookback.ratio"], b.reduced["lookback.ratio"], atol=1e-5)
        np.testing.assert_allclose(a.reduced["mtopdiv.d"], b.reduced["mtopdiv.d"], atol=1e-5)
    # the windows of a long context: each gets its own window's signals, not the left-cut view's
    small = Scorer(model=smol, max_tokens=128, cache=tmp_path / "windows",
                   remote=lambda me, todo, req: ray_signals(me, todo, req, address=cluster, actors=1))
    long = Sample(context=" ".join(f"Fact {i} is {i * 3}." for i in range(40)), question="Fact 0?", response="0.")
    views = small.encode_windows(long)
    got = small.signals([long] * len(views), request, views=views)
    here = Scorer(model=smol, max_tokens=128, cache=None).signals([long] * len(views), request, views=views)
    assert len(views) > 1
    for a, b in zip(got, here):
        np.testing.assert_allclose(a.reduced["lookback.ratio"], b.reduced["lookback.ratio"], atol=1e-5)


def test_ray_signals_are_made_in_the_drivers_precision(cluster, smol, short_answers):
    """The driver caches actor-made signals under its own key, precision included: the actors compute in the
    driver's precision even where their own `auto` would pick another (here: this cluster's processes were started
    with the session's float32 pin, the driver's model is in bfloat16)."""
    from halwatch.models.forward import whitebox_request
    from halwatch.models.loader import load_model
    from halwatch.scale import ray_signals
    from halwatch.scorer import Scorer

    samples = short_answers[0][:1]
    half = Scorer(model=load_model("smollm2-135m", device="cpu", dtype="bfloat16"), max_tokens=512, cache=None)
    request = whitebox_request(smol)
    (remote,) = ray_signals(half, samples, request, address=cluster, actors=1)
    (here,) = half.signals(samples, request)
    (full,) = Scorer(model=smol, max_tokens=512, cache=None).signals(samples, request)
    assert np.abs(full.logprobs - here.logprobs).max() > 1e-3  # the precisions differ where the test looks
    np.testing.assert_allclose(remote.logprobs, here.logprobs, atol=1e-2)  # threads may round bfloat16 apart


def test_an_address_where_nothing_listens_fails_at_once(records, tmp_path):
    """Nothing listens on the address: one line saying so, within a minute, and nothing written (Ray alone retries
    for many minutes)."""
    import socket

    with socket.socket() as free:  # a loopback port that nobody listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    path = tmp_path / "in.jsonl"
    write_jsonl(path, records[:1])
    started = time.monotonic()
    done = subprocess.run(_command(path, tmp_path / "out.jsonl", f"127.0.0.1:{port}"), capture_output=True,
                          text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert done.returncode != 0 and f"cannot join the Ray cluster at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.jsonl").exists()


def test_gpus_the_cluster_lacks_fail_at_once(cluster, records, tmp_path):
    """``--device cuda`` asks each actor for a GPU; this cluster has none: one line naming them, within a minute,
    instead of Ray waiting for the resources forever."""
    path = tmp_path / "in.jsonl"
    write_jsonl(path, records[:1])
    started = time.monotonic()
    done = subprocess.run(_command(path, tmp_path / "out.jsonl", cluster, "--device", "cuda"), capture_output=True,
                          text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert done.returncode != 0 and "0 GPUs" in done.stderr and "Traceback" not in done.stderr
    too_many = subprocess.run(_command(path, tmp_path / "out.jsonl", cluster, "--ray-actors", "3", "--ray-cpus", "1"),
                              capture_output=True, text=True, timeout=120)
    assert too_many.returncode != 0 and "can place 2 of the 3 actors" in too_many.stderr
