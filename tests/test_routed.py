"""The routed detector: one fused part per task, fitted on that task's answers alone, each answer judged (score,
threshold, spans) by its task's part, tasks without a part sent to the fallback, and per-task recalibration."""

import numpy as np
import pytest

from halwatch.data.jsonl import sample_from_record, sample_record
from halwatch.data.shared import read_shared
from halwatch.detectors import create_detector, load_detector
from halwatch.sample import Sample, task_of

SETTINGS = {"C": 1.0, "token_C": 1e-3, "folds": 4}


def _short(name: str, per_label: int) -> list[Sample]:
    """The first ``per_label`` hallucinated and grounded answers of a shared set whose prompt fits the tests' cap."""
    found = [s for s in read_shared(name, per_source=None) if len(s.prompt) < 1200 and len(s.response) < 400]
    return [s for s in found if s.label == 1][:per_label] + [s for s in found if s.label == 0][:per_label]


@pytest.fixture(scope="module")
def summaries():
    return _short("xsum-hallucination", 12)


@pytest.fixture(scope="module")
def dialogue():
    return _short("faithdial", 4)  # too few for a part of their own


@pytest.fixture(scope="module")
def routed(scorer, probe, summaries, dialogue):
    return create_detector("routed", scorer, **SETTINGS).fit(probe + summaries + dialogue)


def test_task_of_each_kind_of_record(probe, summaries, dialogue):
    """RAGTruth's own prompts and context-with-question records are question answering; the shared sets' records
    carry their task; a context without a question is a summary; an explicit task wins."""
    assert task_of(probe[0]) == "qa" and probe[0].task is None and not probe[0].rendered
    assert {task_of(s) for s in summaries} == {"summary"} and {task_of(s) for s in dialogue} == {"dialogue"}
    assert task_of(Sample(context="The sky is blue.", question="What colour is the sky?", response="Blue.")) == "qa"
    assert task_of(Sample(context="The sky is blue.", response="The sky is blue.")) == "summary"
    assert task_of(Sample(prompt="Summarise: the sky is blue.", response="Blue sky.", task="summary")) == "summary"
    assert task_of(Sample(prompt="Summarise: the sky is blue.", response="Blue sky.")) == "qa"
    # a record written for another process (Ray's actors) or a file reads back with the same prompt and task
    for sample in (Sample(context="The sky is blue.", response="The sky is blue."), probe[0], dialogue[0],
                   Sample(context="The sky is blue.", question="Is it?", response="Yes.", task="dialogue"),
                   Sample(prompt="Summarise: the sky is blue.", response="Blue sky.", task="summary")):
        for record in (sample_record(sample), sample.to_dict()):
            back = sample_from_record(record, "test")
            assert (back.prompt, back.response, task_of(back)) == (sample.prompt, sample.response, task_of(sample))


def test_each_part_is_a_fused_fit_on_its_task_alone(scorer, probe, summaries, routed):
    """Two parts (the dialogue answers are too few and go to the fallback); the summary part is the same model,
    calibration and threshold as a fused detector fitted here on the summaries alone: nothing crosses tasks. A
    fallback task without answers of both labels is refused before anything is fitted."""
    from halwatch.errors import InputError

    with pytest.raises(InputError, match="fallback task 'dialogue' needs grounded and hallucinated"):
        create_detector("routed", scorer, fallback="dialogue", **SETTINGS).fit(probe + summaries)
    assert set(routed.parts) == {"qa", "summary"}
    assert routed.fitted_on["to_fallback"] == {"dialogue": {"n": 8, "n_hallucinated": 4}}
    assert routed.parts["qa"].fitted_on["n"] == len(probe)
    alone = create_detector("fused", scorer, **SETTINGS).fit(summaries)
    part = routed.parts["summary"]
    assert part.threshold == pytest.approx(alone.threshold)
    assert part.calibrator.to_dict() == pytest.approx(alone.calibrator.to_dict())
    assert part.columns == alone.columns
    assert part.coefficients() == pytest.approx(alone.coefficients(), abs=1e-3)


def test_every_answer_is_judged_by_its_part(scorer, probe, summaries, dialogue, routed, tmp_path):
    """Verdicts, scores and predictions of a mixed batch are each answer's part's own, with that part's threshold
    and name; a dialogue reply goes to the fallback; an artifact round trip gives the same verdicts; a prompt-only
    record with an explicit task routes by it although its signals come from the same cache entry."""
    samples = probe[:3] + summaries[:3] + dialogue[:2]
    views = [scorer.encode(s) for s in samples]
    signals = scorer.signals(samples, routed.request(), views=views)
    found = routed.verdicts(views, signals)
    assert [v["task"] for v in found] == ["qa"] * 3 + ["summary"] * 3 + ["qa"] * 2
    for k, v in enumerate(found):
        part = routed.parts[v["task"]]
        own = part.verdicts([views[k]], [signals[k]])[0]
        assert v["score"] == own["score"] and v["threshold"] == round(part.threshold, 4)
        assert v["spans"] == own["spans"] and v["detector"] == "routed"
    probs = routed.score(samples)
    np.testing.assert_allclose(probs, [v["score"] for v in found], atol=1e-4)
    np.testing.assert_allclose(routed.scores_and_ranking(signals)[0], probs, atol=1e-9)
    # answers of one part rank by that part's own (unclipped) ranking score, as the part alone would rank them
    np.testing.assert_allclose(routed.answer_scores(views[:3], signals[:3])[2],
                               routed.parts["qa"].answer_scores(views[:3], signals[:3])[2])
    _, probs, _, thresholds, _ = routed.answer_scores(views, signals)
    assert list(probs >= thresholds) == [v["hallucinated"] for v in found]

    routed.save(tmp_path / "routed.json")
    again = load_detector(str(tmp_path / "routed.json"), scorer=scorer)
    assert again.verdicts(views, signals) == found

    plain = Sample(prompt=summaries[0].prompt, response=summaries[0].response)
    told = Sample(prompt=summaries[0].prompt, response=summaries[0].response, task="summary")
    pair = [scorer.encode(s) for s in (plain, told)]
    assert pair[0].input_ids == pair[1].input_ids
    got = routed.verdicts(pair, scorer.signals([plain, told], routed.request(), views=pair))
    assert [v["task"] for v in got] == ["qa", "summary"]


def test_recalibrating_changes_only_the_parts_with_labels(scorer, probe, routed):
    """Recalibrating on question-answering answers alone refits the qa part's probabilities and threshold; the
    summary part keeps its fit."""
    det = type(routed).from_dict(routed.to_dict(), scorer=scorer)
    # the probe's views as it was fitted (one each, read from the session's white-box pass): windows are not what
    # this test is about (test_windows.py), and each would be a forward pass of its own
    views = [scorer.encode(s) for s in probe]
    views, raw = det.answer_outputs(views, scorer.signals(probe, det.request(), views=views))[:2]
    labels = [s.label for s in probe]
    summary = det.parts["summary"].to_dict()
    report = det.recalibrate(raw, labels, 0.2, "probe", tasks=[task_of(v.sample) for v in views])
    assert set(report["parts"]) == {"qa"} and report["kept"] == ["summary"]
    assert det.parts["summary"].to_dict() == summary
    assert det.parts["qa"].decision_rule == "conformal fpr=0.2"
    assert det.parts["qa"].threshold == report["parts"]["qa"]["threshold"] != routed.parts["qa"].threshold
    assert det.fitted_on["parts"]["qa"]["threshold"] == round(det.parts["qa"].threshold, 4)


def test_parts_fitted_alone_go_into_a_routed_artifact(scorer, probe, summaries, dialogue, routed, halwatch,
                                                      tmp_path):
    """`halwatch fit --detector routed --into A`: a summary part fitted on the summaries alone, put into an artifact
    that has only a qa part, gives the parts of the routed fit on both tasks at once (nothing crosses tasks), keeps
    the qa part as it was, and counts the answers of both. Other settings, another kind of artifact and a task with
    too few answers for a part are refused before anything is fitted."""
    import json

    from halwatch.errors import InputError

    qa_only = create_detector("routed", scorer, **SETTINGS).fit(probe)
    base = tmp_path / "qa.json"
    qa_only.save(base)
    data = tmp_path / "summaries.jsonl"
    data.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in summaries))
    out = tmp_path / "both.json"
    done = halwatch("fit", "--detector", "routed", "--into", base, "--input", data, "--output", out)
    assert "added summary" in done.stderr and "kept qa" in done.stderr, done.stderr
    both = load_detector(str(out), scorer=scorer)
    assert set(both.parts) == {"qa", "summary"} and both.settings == routed.settings
    assert both.parts["qa"].to_dict() == qa_only.parts["qa"].to_dict()
    part, whole = both.parts["summary"], routed.parts["summary"]
    assert part.threshold == pytest.approx(whole.threshold)
    assert part.calibrator.to_dict() == pytest.approx(whole.calibrator.to_dict())
    assert part.coefficients() == pytest.approx(whole.coefficients(), abs=1e-3)
    assert both.fitted_on["n"] == len(probe) + len(summaries)
    assert both.fitted_on["parts"]["summary"]["data"] == str(data)
    assert both.fitted_on["n_sources"] == len({s.source for s in probe + summaries})

    again = tmp_path / "again.json"
    for extra, message in ((["--set", "C=0.5"], "leave out --set"),
                           (["--detector", "fused"], "give --detector routed")):
        args = ["fit", "--detector", "routed", "--into", base, "--input", data, "--output", again, *extra]
        bad = halwatch(*args, check=False)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    bad = halwatch("fit", "--detector", "routed", "--into", "perplexity", "--input", data, "--output", again,
                   check=False)
    assert bad.returncode == 2 and "has no parts" in bad.stderr
    few = tmp_path / "dialogue.jsonl"
    few.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in dialogue))
    bad = halwatch("fit", "--detector", "routed", "--into", base, "--input", few, "--output", again, check=False)
    assert bad.returncode == 2 and "dialogue has 4 and 4" in bad.stderr, bad.stderr
    assert not again.exists()
    with pytest.raises(InputError, match="other settings"):
        qa_only.with_parts(create_detector("routed", scorer, **{**SETTINGS, "C": 0.5}).fit(probe))

    # replacing a part: the dialogue answers that had none stay counted (judged by the fallback), the recalibrated
    # list loses the replaced part, and n counts the new part's answers instead of the old one's
    into = type(routed).from_dict(routed.to_dict(), scorer=scorer)
    into.fitted_on["recalibrated"] = ["qa", "summary"]
    half = create_detector("routed", scorer, **{**SETTINGS, "fallback": "summary"})
    half.fit(summaries[:10] + summaries[12:22])  # 10 of each label
    assert into.with_parts(half, "half") == {"added": [], "replaced": ["summary"]}
    assert into.fitted_on["n"] == len(probe) + 20 + len(dialogue) and into.fitted_on["recalibrated"] == ["qa"]
    assert into.fitted_on["to_fallback"] == routed.fitted_on["to_fallback"]
    assert into.fitted_on["parts"]["summary"] == {"n": 20, "n_hallucinated": 10, "data": "half",
                                                  "threshold": round(float(half.parts["summary"].threshold), 4)}
    assert into.parts["summary"] is half.parts["summary"] and set(into.parts) == {"qa", "summary"}


def test_the_service_reports_each_items_part_and_threshold(smol, routed, probe_by_size, summaries, tmp_path):
    """A routed artifact served: one /v1/score list of question-answering items and summaries gives each item its
    part's threshold and names the part, as the library does; /v1/detectors lists the thresholds per task."""
    from halwatch.client import Client
    from halwatch.serve.common import Running
    from halwatch.serve.scoring import build_app

    path = tmp_path / "routed.json"
    routed.save(path)
    short = probe_by_size[:2]  # each fits the cap: no windows
    # the prompt as it is, and the part of it that is the context (where the command's features read it too)
    items = [{"id": s.id, "prompt": s.prompt, "context": s.context_text, "response": s.response} for s in short]
    items += [{"id": s.id, "context": s.context, "response": s.response, "task": "summary"} for s in summaries[:2]]
    running = Running(build_app([str(path)], models={"smollm2-135m": smol}))
    try:
        with Client(running.url) as client:
            got = client.score(items)
            listed = client.detectors()["detectors"][0]
    finally:
        running.stop()
    assert [r["task"] for r in got] == ["qa", "qa", "summary", "summary"]
    for r in got:
        assert r["threshold"] == round(routed.parts[r["task"]].threshold, 4) and r["detector"] == "routed"
    expected = routed.score(short + summaries[:2])
    assert [r["score"] for r in got] == pytest.approx(expected, abs=1e-3)
    assert listed["threshold"] is None and listed["thresholds"] == pytest.approx(routed.thresholds)
    # the share of hallucinated answers each part's probabilities assume: its training answers' share
    assert listed["priors"] == pytest.approx({t: p.fitted_on["n_hallucinated"] / p.fitted_on["n"]
                                              for t, p in routed.parts.items()})
