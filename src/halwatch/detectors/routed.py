"""The routed detector: one fused detector per task, each with its own calibration and threshold.

One threshold cannot serve answers of every shape: fitted on question answering, dialogue replies and summaries
together, the fused detector's out-of-fold threshold for a false-positive rate of 0.2 flags 2 % of the grounded
SQuAD-built short answers and 82 % of the grounded XSum summaries (docs/results/README.md, "One threshold for seven
shapes"). This detector fits a :class:`~halwatch.detectors.fused.Fused` part on each task's answers alone
(:func:`halwatch.sample.task_of`: the record's ``task``, else question answering with a question or a prompt given
as it is, else a summary) and sends every answer to its task's part: the part's stacking, regularisation,
calibration, decision threshold, span rule and out-of-distribution reference are fitted on that task's held-out
scores only, so nothing crosses tasks. A task without a part (too few answers of it, or none: ``data2text`` in a fit
without such data) goes to the ``fallback`` part, and every verdict names the part that judged it (``task``).

Probabilities of different parts assume their own task's share of hallucinated answers; answers of several tasks are
ranked together by each part's calibrated log-odds.

This is halwatch's own arrangement, not a published method.
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors.base import ARTIFACT_FORMAT, Detector, groups_of, warn_precision
from halwatch.detectors.calibration import MIN_FOR_SHARE
from halwatch.detectors.fused import Fused
from halwatch.detectors.logistic import logit
from halwatch.errors import HalwatchError, InputError
from halwatch.models.signal_types import Signals
from halwatch.sample import TASKS, task_of
from halwatch.tokens import TokenView, window_groups

#: A task gets its own part when it has at least this many answers of each label; otherwise the fallback judges it.
MIN_PER_LABEL = 10


class Routed(Detector):
    name = "routed"
    citation = ("halwatch routed detector: one fused detector per task (question answering, dialogue, summaries, "
                "data-to-text), each with its own calibration and threshold")
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", decision: str = "f1", prior: float | None = None,
                 fallback: str = "qa", adapter_tasks=None, **settings):
        if fallback not in TASKS:
            raise ValueError(f"fallback: one of {', '.join(TASKS)}, not {fallback!r}")
        Fused(calibration=calibration, decision=decision, prior=prior, **settings)  # the parts' settings, checked now
        if adapter_tasks is not None:
            adapter_tasks = sorted(set(adapter_tasks.split("+") if isinstance(adapter_tasks, str) else adapter_tasks))
            if not settings.get("adapter") or not set(adapter_tasks) <= set(TASKS):
                raise ValueError(f"adapter_tasks: tasks ({', '.join(TASKS)}) whose parts stack the adapter, with "
                                 f"an adapter setting; not {adapter_tasks!r}")
        super().__init__(scorer=scorer, calibration=calibration, decision=decision, prior=prior, fallback=fallback,
                         **({"adapter_tasks": adapter_tasks} if adapter_tasks is not None else {}), **settings)
        self.parts: dict[str, Fused] = {}
        self._template: Fused | None = None  # an unfitted part, for the request

    @classmethod
    def setting_names(cls) -> set[str]:
        return super().setting_names() | Fused.setting_names()

    def _part_settings(self, task: str | None = None) -> dict:
        """The settings of ``task``'s part: every one but the routing's own; the ``adapter`` only where
        ``adapter_tasks`` names the task (or names none). With no task: those of the pass every part reads."""
        out = {k: v for k, v in self.settings.items() if k not in ("fallback", "adapter_tasks")}
        if task is not None and task not in self.settings.get("adapter_tasks", [task]):
            out.pop("adapter", None)
        return out

    # ---- routing ------------------------------------------------------------------------------------------------
    def route(self, task: str | None) -> str:
        """The part that judges answers of ``task`` (``None``: unknown, e.g. signals of token ids alone)."""
        return task if task in self.parts else self.settings["fallback"]

    def for_task(self, task: str) -> Detector:
        self._require_fitted()
        part = self.parts[self.route(task)]
        if part.scorer is None:
            part.scorer = self.get_scorer()  # one scorer (one model in memory) for every part
        return part

    def _routes(self, tasks) -> dict[str, np.ndarray]:
        """``{part: indices}`` of answers with these tasks, in order."""
        routes = np.array([self.route(t) for t in tasks], dtype=object)
        return {name: np.flatnonzero(routes == name) for name in sorted(set(routes.tolist()))}

    # ---- fitting ------------------------------------------------------------------------------------------------
    def request(self):
        """The pass every part reads (one: the parts share their settings), the adapter's among them."""
        if self._template is None:
            self._template = Fused(scorer=self.get_scorer(), **self._part_settings())
            self._template.adapter_sha = next((p.adapter_sha for p in self.parts.values() if p.adapter_sha), None)
        return self._template.request()

    def adapter_trained_on(self, views) -> list[int]:
        """:meth:`Fused.adapter_trained_on` for the adapter every part shares."""
        self.request()
        return self._template.adapter_trained_on(views)

    def fit_signals(self, signals: list[Signals], labels, views: list[TokenView] | None = None,
                    groups=None, scored=None) -> "Routed":
        """A fresh :class:`Fused` part fitted on each task's answers alone (the task from each view's sample, else
        from each signal's ``task``), given at least :data:`MIN_PER_LABEL` answers of each label; the others go to
        the fallback part, which is fitted on its own task's answers whenever they hold both labels. ``scored``:
        the answers as scoring sees them (:meth:`Detector.fit_signals`), each part given its own."""
        labels = np.asarray(labels, dtype=int)
        if len(labels) != len(signals):
            raise ValueError(f"{len(signals)} samples but {len(labels)} labels")
        tasks = [task_of(v.sample) for v in views] if views is not None else [s.task for s in signals]
        fallback = self.settings["fallback"]
        tasks = np.array([t or fallback for t in tasks], dtype=object)
        groups = np.asarray(groups) if groups is not None else groups_of(views)
        owned, skipped = {}, {}
        for task in sorted(set(tasks.tolist())):
            idx = np.flatnonzero(tasks == task)
            counts = np.bincount(labels[idx], minlength=2)
            # the fallback judges every answer without a part: fitted on whatever it has of both labels
            if counts.min() >= (1 if task == fallback else MIN_PER_LABEL):
                owned[task] = idx
            else:
                skipped[task] = {"n": int(len(idx)), "n_hallucinated": int(counts[1])}
        if fallback not in owned:  # refused before any part is fitted
            raise InputError(f"the fallback task {fallback!r} needs grounded and hallucinated answers to fit its "
                             f"part (tasks found: {', '.join(sorted(set(tasks.tolist())))}): give some, or another "
                             f"fallback (--set fallback=TASK)")
        windows = None if scored is None else window_groups(scored[0])
        self.parts = {}
        for task, idx in owned.items():
            part = Fused(scorer=self.scorer, calibration=self.calibrator.method, decision=self.decision_rule,
                         prior=self.prior, **self._part_settings(task))
            flat = None if windows is None else [k for i in idx for k in windows[i]]
            self.parts[task] = part.fit_signals([signals[i] for i in idx], labels[idx],
                                                None if views is None else [views[i] for i in idx],
                                                None if groups is None else groups[idx],
                                                None if flat is None else ([scored[0][k] for k in flat],
                                                                           [scored[1][k] for k in flat]))
        self.identity = dict(self.parts[fallback].identity)
        self.fitted_on = {"n": int(len(labels)), "n_hallucinated": int(labels.sum()),
                          "n_sources": int(len(np.unique(groups))) if groups is not None else None,
                          "decision": self.decision_rule,
                          "parts": {t: {"n": p.fitted_on["n"], "n_hallucinated": p.fitted_on["n_hallucinated"],
                                        "threshold": round(float(p.threshold), 4)} for t, p in self.parts.items()},
                          **({"to_fallback": skipped} if skipped else {})}
        return self

    def with_parts(self, fitted: "Routed", describe: str = "") -> dict:
        """Put ``fitted``'s parts into this detector in place of its parts of the same tasks, keeping the others:
        since each part is fitted on its own task's answers alone (:meth:`fit_signals`), this equals refitting the
        whole detector with the new answers in place of those tasks' old ones, without the other tasks' data.
        Both must be fitted with the same settings, scoring model, input mode, token cap and precision.
        ``fitted_on["n_sources"]`` becomes the sum of the parts' (sources are counted per part).
        ``describe``: what ``fitted`` was fitted on, recorded per part in ``fitted_on["parts"]``. Returns
        ``{"added": [tasks new here], "replaced": [tasks whose part was replaced]}``."""
        self._require_fitted()
        fitted._require_fitted()
        mine, theirs = ({k: v for k, v in d.settings.items() if k != "fallback"} for d in (self, fitted))
        same = (mine, self.calibrator.method, self.decision_rule, self.prior) == (
            theirs, fitted.calibrator.method, fitted.decision_rule, fitted.prior)
        if not same:
            raise InputError(f"the new parts were fitted with other settings ({theirs}, decision "
                             f"{fitted.decision_rule}) than the detector they go into ({mine}, decision "
                             f"{self.decision_rule})")
        # the scorer's identity; not the signal versions, which loading already holds to this halwatch's (a
        # reducer only one of the two computed, as the shipped qa part's old "sink", is no difference)
        differ = [k for k in sorted(set(self.identity) | set(fitted.identity))
                  if k != "signal_versions" and self.identity.get(k) != fitted.identity.get(k)]
        if differ:
            raise InputError("the new parts were fitted with another " + ", ".join(differ) + " than the detector "
                             "they go into: " + "; ".join(f"{k} {fitted.identity.get(k)} against "
                                                          f"{self.identity.get(k)}" for k in differ))
        found = {"added": sorted(set(fitted.parts) - set(self.parts)),
                 "replaced": sorted(set(fitted.parts) & set(self.parts))}
        self.parts = {**self.parts, **fitted.parts}
        rows = dict(self.fitted_on.get("parts", {}))
        for task, part in fitted.parts.items():
            rows[task] = {"n": part.fitted_on["n"], "n_hallucinated": part.fitted_on["n_hallucinated"],
                          "threshold": round(float(part.threshold), 4), **({"data": describe} if describe else {})}
        # answers counted in n for want of a part of their task (judged by the fallback) leave once it has one
        kept = {t: n for t, n in (self.fitted_on.get("to_fallback") or {}).items() if t not in fitted.parts}
        sources = [p.fitted_on.get("n_sources") for p in self.parts.values()]
        self.fitted_on = {**self.fitted_on, "parts": rows,
                          "n": sum(r["n"] for r in [*rows.values(), *kept.values()]),
                          "n_hallucinated": sum(r["n_hallucinated"] for r in [*rows.values(), *kept.values()]),
                          "n_sources": None if None in sources or kept else sum(sources)}
        if kept:
            self.fitted_on["to_fallback"] = kept
        else:
            self.fitted_on.pop("to_fallback", None)
        for how in ("recalibrated", "restated"):  # a new part carries its own fit's calibration
            if how in self.fitted_on:
                self.fitted_on[how] = [t for t in self.fitted_on[how] if t not in fitted.parts]
        self.identity = dict(self.parts[self.settings["fallback"]].identity)
        return found

    def _require_fitted(self):
        if not self.parts:
            raise HalwatchError(f"detector {self.name!r} is not fitted: call fit() or load a fitted artifact")

    @property
    def thresholds(self) -> dict[str, float]:
        """Each part's decision threshold, by task."""
        return {t: float(p.threshold) for t, p in self.parts.items()}

    # ---- scoring ------------------------------------------------------------------------------------------------
    def _per_part(self, tasks, run, n: int) -> list:
        """``run(part, indices)`` on each part's answers; the per-answer results put back in order."""
        out: list = [None] * n
        for name, idx in self._routes(tasks).items():
            for i, value in zip(idx, run(self.for_task(name), idx)):
                out[i] = value
        return out

    def _answer_groups(self, views):
        """Per answer (its windows: :func:`halwatch.tokens.window_groups`), its view indices and its task."""
        groups = window_groups(views)
        return groups, [task_of(views[g[-1]].sample) for g in groups]

    def _flat(self, groups, idx) -> list[int]:
        return [i for a in idx for i in groups[a]]

    def _ranking(self, tasks, probs, rankings) -> np.ndarray:
        """Answers judged by one part rank by that part's own ranking score (its raw score, unclipped); answers of
        several parts, whose raw scores are on different scales, by each part's calibrated log-odds."""
        if len(self._routes(tasks)) == 1:
            return np.asarray(rankings, dtype=float)
        return logit(probs)

    def answer_scores(self, views, signals):
        """Each answer scored by its task's part (ranking scores: :meth:`_ranking`)."""
        self._require_fitted()
        groups, tasks = self._answer_groups(views)

        def run(part, idx):
            flat = self._flat(groups, idx)
            found = part.answer_scores([views[i] for i in flat], [signals[i] for i in flat])
            return zip(found[0], found[1], found[2], found[3],
                       found[4] if found[4] is not None else [None] * len(idx))

        rows = self._per_part(tasks, run, len(groups))
        probs = np.array([r[1] for r in rows], dtype=float)
        tokens = [r[4] for r in rows]
        return ([r[0] for r in rows], probs, self._ranking(tasks, probs, [r[2] for r in rows]),
                np.array([r[3] for r in rows], dtype=float), None if any(t is None for t in tokens) else tokens)

    def answer_outputs(self, views, signals):
        """Each answer's part's :meth:`~Detector.answer_outputs`: the raw scores are on each part's own scale, and
        the OOD inputs (of different widths) a list."""
        self._require_fitted()
        groups, tasks = self._answer_groups(views)

        def run(part, idx):
            flat = self._flat(groups, idx)
            v, raw, tok, inputs = part.answer_outputs([views[i] for i in flat], [signals[i] for i in flat])
            return zip(v, raw, tok if tok is not None else [None] * len(idx), inputs)

        rows = self._per_part(tasks, run, len(groups))
        tokens = [r[2] for r in rows]
        return ([r[0] for r in rows], np.array([r[1] for r in rows], dtype=float),
                None if any(t is None for t in tokens) else tokens, [r[3] for r in rows])

    def scores_and_ranking(self, signals):
        self._require_fitted()

        def run(part, idx):
            return zip(*part.scores_and_ranking([signals[i] for i in idx]))

        tasks = [s.task for s in signals]
        rows = self._per_part(tasks, run, len(signals))
        probs = np.array([r[0] for r in rows], dtype=float)
        return probs, self._ranking(tasks, probs, [r[1] for r in rows])

    def raw_scores(self, signals):
        """Each answer's part's raw score (on that part's own scale)."""
        return np.array(self._per_part([s.task for s in signals],
                                       lambda part, idx: part.raw_scores([signals[i] for i in idx]), len(signals)))

    def token_scores(self, signals):
        found = self._per_part([s.task for s in signals],
                               lambda part, idx: part.token_scores([signals[i] for i in idx]) or [None] * len(idx),
                               len(signals))
        return None if any(t is None for t in found) else found

    def continuation_scores(self, signals, start):
        return np.array(self._per_part(
            [s.task for s in signals], lambda part, idx: part.continuation_scores([signals[i] for i in idx], start),
            len(signals)))

    def token_spans(self, view, tokens, prob, min_confidence: float = 0.0):
        return self.for_task(task_of(view.sample)).token_spans(view, tokens, prob, min_confidence)

    def verdicts(self, views, signals, min_span_confidence: float | None = None, sentences: bool = False
                 ) -> list[dict]:
        """:meth:`Detector.verdicts` of each answer's part, with the part's threshold, and ``task``: the part
        that judged it."""
        self._require_fitted()
        groups, tasks = self._answer_groups(views)
        confidence = self.min_span_confidence if min_span_confidence is None else min_span_confidence

        def run(part, idx):
            flat = self._flat(groups, idx)
            found = part.verdicts([views[i] for i in flat], [signals[i] for i in flat], confidence, sentences)
            return [{**v, "detector": self.name} for v in found]

        out = self._per_part(tasks, run, len(groups))
        return [{**v, "task": self.route(t)} for v, t in zip(out, tasks)]

    def recalibrate(self, raw, labels, target_fpr=None, describe: str = "", tasks=None) -> dict:
        """:meth:`Detector.recalibrate` of each part on the answers it judges (``tasks``: each answer's task; those
        of a task without a part go to the fallback's; ``raw`` on each part's own scale, as :meth:`answer_outputs`
        gives them), where they hold both labels; the other parts keep their fit. Returns ``{"parts": {part:
        report}, "kept": [parts not recalibrated]}``."""
        self._require_fitted()
        if tasks is None:
            raise InputError("a routed detector recalibrates each task's part on that task's answers: give the "
                             "answers' tasks")
        raw, labels = np.asarray(raw, dtype=float), np.asarray(labels, dtype=int)
        reports = {}
        for name, idx in self._routes(tasks).items():
            if len(np.unique(labels[idx])) == 2:
                reports[name] = self.for_task(name).recalibrate(raw[idx], labels[idx], target_fpr, describe)
        if not reports:
            raise InputError("no task has both grounded (0) and hallucinated (1) answers to calibrate on")
        return self._changed("recalibrated", reports)

    def restate_prior(self, prior: float | None = None, probs=None, describe: str = "", tasks=None) -> dict:
        """:meth:`Detector.restate_prior` of each part: with ``prior`` stated, for the parts of ``tasks`` (task
        names; every part when ``None``); else estimated from ``probs``, the probabilities of unlabelled answers
        with ``tasks`` their tasks, for each part that judges at least :data:`MIN_FOR_SHARE` of them (the others
        keep their prior). Returns ``{"parts": {part: report}, "kept": [parts not restated]}``."""
        self._require_fitted()
        reports = {}
        if prior is not None:
            for name in sorted({self.route(t) for t in tasks} if tasks else self.parts):
                reports[name] = self.parts[name].restate_prior(prior, describe=describe)
        else:
            if tasks is None:
                raise InputError("a routed detector estimates each task's share on that task's answers: give the "
                                 "answers' tasks")
            probs = np.asarray(probs, dtype=float)
            for name, idx in self._routes(tasks).items():
                if len(idx) >= MIN_FOR_SHARE:
                    reports[name] = self.parts[name].restate_prior(probs=probs[idx], describe=describe)
            if not reports:
                raise InputError(f"no task has the {MIN_FOR_SHARE} answers needed to estimate its share of "
                                 f"hallucinated ones")
        return self._changed("restated", reports)

    def _changed(self, how: str, reports: dict) -> dict:
        """After some parts were recalibrated or restated (``how``): their thresholds in ``fitted_on``, and the
        reports, ``{"parts": {part: report}, "kept": [parts left as they were]}``."""
        parts = {t: {**row, "threshold": round(float(self.parts[t].threshold), 4)}
                 for t, row in self.fitted_on.get("parts", {}).items()}
        self.fitted_on = {**self.fitted_on, "parts": parts, how: sorted(reports)}
        return {"parts": reports, "kept": sorted(set(self.parts) - set(reports))}

    # ---- artifacts ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._require_fitted()
        return {"format": ARTIFACT_FORMAT, "detector": self.name, "citation": self.citation, **self.identity,
                "settings": self.settings, "decision": self.decision_rule, "prior": self.prior,
                "calibration": {"method": self.calibrator.method}, "threshold": None,
                "thresholds": {t: round(v, 6) for t, v in self.thresholds.items()},
                "min_span_confidence": self.min_span_confidence,
                "parts": {t: p.to_dict() for t, p in self.parts.items()}, "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, d: dict, scorer=None) -> "Routed":
        det = cls(scorer=scorer, calibration=d.get("calibration", {}).get("method", "platt"),
                  decision=d.get("decision", "f1"), prior=d.get("prior"), **d.get("settings", {}))
        parts = d.get("parts") or {}
        unknown = sorted(set(parts) - set(TASKS))
        if unknown or det.settings["fallback"] not in parts:
            raise HalwatchError(f"routed artifact: parts {sorted(parts)} must be tasks ({', '.join(TASKS)}) and "
                                f"include the fallback {det.settings['fallback']!r}")
        det.parts = {t: Fused.from_dict(p, scorer=scorer, precision_warning=False) for t, p in parts.items()}
        det.identity = dict(det.parts[det.settings["fallback"]].identity)
        if scorer is not None and det.identity:  # one warning for the whole artifact, not one per part
            warn_precision(d["detector"], det.identity, scorer)
        det.min_span_confidence = d.get("min_span_confidence", 0.0)
        det.fitted_on = d.get("fitted_on", {})
        return det
