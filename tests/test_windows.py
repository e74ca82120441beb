"""A context longer than the token cap is scored in windows with the real model and the shipped default: the answer
is judged against the window that supports it, not against whatever part of the context survived a cut."""

import dataclasses

import numpy as np

from halwatch.detectors import create_detector, load_detector
from halwatch.sample import Sample
from halwatch.scorer import Scorer

FACT = "The Eiffel Tower in Paris was completed in 1889 and was designed by the company of Gustave Eiffel. "
FILLER = " ".join(f"The town hall of village {i} was painted {colour} in the spring of {1900 + i}."
                  for i, colour in zip(range(28), ["red", "blue", "green", "white"] * 7))
QUESTION = "When was the Eiffel Tower completed, and who designed it?"
GROUNDED = "The Eiffel Tower was completed in 1889."
MADE_UP = "The Eiffel Tower was completed in 1925 and was designed by Napoleon Bonaparte."


def _verdicts(det, samples):
    views = [v for s in samples for v in det.scorer.encode_windows(s)]
    return det.verdicts(views, det.scorer.signals([v.sample for v in views], det.request(), views=views)), views


def test_the_supporting_window_decides_where_a_cut_loses_the_fact(smol, tmp_path):
    samples = [Sample(id=i, context=FACT + FILLER, question=QUESTION, response=r)
               for i, r in (("grounded", GROUNDED), ("made-up", MADE_UP))]
    # one cache: the signals of a window are computed once, whichever way it is scored
    windowed = load_detector("default", scorer=Scorer(model=smol, cache=tmp_path, max_tokens=256, batch_size=None))
    cut = load_detector("default", scorer=Scorer(model=smol, cache=tmp_path, max_tokens=256, windows=1))
    (grounded, made_up), views = _verdicts(windowed, samples)
    (grounded_cut, _), _ = _verdicts(cut, samples)
    assert grounded_cut["truncated"] > 0 and grounded_cut["windows"] == 1  # the fact was cut away ...
    assert grounded_cut["hallucinated"]  # ... and the grounded answer looked made up
    assert grounded["windows"] >= 3 and grounded["truncated"] == 0
    assert not grounded["hallucinated"] and grounded["spans"] == []
    assert made_up["hallucinated"] and any("Napoleon" in s["text"] for s in made_up["spans"])
    # the answer's score is its most supportive window's: each window scored alone as an answer of its own
    mine = [v for v in views if v.sample.id == "grounded"]
    alone = windowed.verdicts([dataclasses.replace(v, window=(0, 1)) for v in mine],
                              windowed.scorer.signals([v.sample for v in mine], windowed.request(), views=mine))
    assert grounded["score"] == min(r["score"] for r in alone)
    assert np.argmin([r["score"] for r in alone]) == 0  # the window that holds the fact
    # an answer scored in a batch with another gets the verdict it gets alone (a pass of its own, no cache)
    alone_det = load_detector("default", scorer=Scorer(model=smol, cache=None, max_tokens=256, batch_size=1))
    (single,), _ = _verdicts(alone_det, samples[1:])
    assert single["spans"] == made_up["spans"] and abs(single["score"] - made_up["score"]) < 1e-3


def test_the_calibration_reads_long_answers_as_scoring_does(scorer, probe):
    """A supervised detector is fitted on one view of each answer, but calibrated on the held-out scores of the
    answers as scoring sees them: an answer whose context the cap cut is scored, by the fold model that did not
    see it, in each of its windows, and its most supportive window counts. Reference: the folds refitted here with
    scikit-learn's logistic regression, each long answer's windows scored by hand."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedGroupKFold

    det = create_detector("linear-probe", scorer, C=1.0).fit(probe)
    windows = [scorer.encode_windows(s) for s in probe]
    long = [i for i, w in enumerate(windows) if len(w) > 1]
    assert len(long) >= 5 and det.fitted_on["windowed"] == len(long)

    def features(views):
        found = scorer.signals([v.sample for v in views], det.request(), views=views)
        return np.stack([s.hidden[s.hidden_layers.index(det._layer()), 0] for s in found]).astype(float)

    y = np.array([s.label for s in probe])
    x = features([scorer.encode(s) for s in probe])
    one_view, as_scored = np.zeros(len(y)), np.zeros(len(y))
    for train, held in StratifiedGroupKFold(5, shuffle=True, random_state=0).split(x, y, [s.source for s in probe]):
        mean, std = x[train].mean(0), x[train].std(0) + 1e-8
        lr = LogisticRegression(C=1.0, max_iter=10000, tol=1e-10).fit((x[train] - mean) / std, y[train])
        one_view[held] = as_scored[held] = lr.decision_function((x[held] - mean) / std)
        for i in set(held) & set(long):
            as_scored[i] = lr.decision_function((features(windows[i]) - mean) / std).min()
    assert (as_scored[long] < one_view[long] - 1e-3).any()  # a window supports it better than the cut view did
    reference = det.ood_reference  # the held-out scores' mean and spread, which the calibration was fitted on
    np.testing.assert_allclose([reference["mean"][0], reference["std"][0]], [as_scored.mean(), as_scored.std()],
                               rtol=1e-3, atol=2e-3)
    assert not np.allclose([one_view.mean(), one_view.std()], [as_scored.mean(), as_scored.std()], atol=2e-3)
