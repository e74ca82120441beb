"""Template invariance: the same (context, question, answer) rendered several ways should get the same verdict.

A detector whose score moves with the prompt's template, length or the order of the passages rather than with the
answer's support has learnt a shortcut (the attention-sink feature was one). For RAGTruth answers this renders each
one through:

- ``ragtruth``: RAGTruth's own prompt (the question first, then the passages, then ``output:``);
- ``qa``: :data:`halwatch.sample.QA_TEMPLATE` (the passages as context, then the question, then ``Answer:``);
- ``chat``: RAGTruth's prompt inside the scoring model's chat template (user turn and assistant header), as a
  chat front end would send it;
- ``shuffled``: RAGTruth's prompt with its passages in another (seeded) order, renumbered;
- ``inst``: RAGTruth's prompt in the ``[INST] ... [/INST]`` wrapping of Llama-2-chat and Mistral-Instruct (the
  generators of RAGTruth's answers), as text: a template no training set of the default is rendered in, where
  ``qa`` and ``chat`` are (``ragtruth-qa``, ``ragtruth-chat``).

and reports, for each rendering against RAGTruth's own, the median absolute change of the probability, the share of
verdicts that flip, and each rendering's AUROC; and, per input of the detector's last step (for the fused detector:
each family's log-odds, the pooled token scores, the log length), the median absolute change in units of that
input's spread over the training answers, which tells which family moves with the template.
"""

from __future__ import annotations

import random
import re

import numpy as np

from halwatch.sample import Sample

RENDERINGS = ("ragtruth", "qa", "chat", "shuffled", "inst")


def shuffled_passages(sample: Sample, seed: int = 0) -> Sample:
    """A RAGTruth sample with its passages (``passage N:...``) in another order, renumbered from 1."""
    start, end = sample.context_span
    passages = sample.prompt[start:end]
    parts = [p.strip() for p in re.split(r"passage \d+:", passages) if p.strip()]
    rng = random.Random(f"{seed}/{sample.id}")
    order = list(range(len(parts)))
    while len(parts) > 1 and order == sorted(order):
        rng.shuffle(order)
    text = "\n\n".join(f"passage {k + 1}:{parts[i]}" for k, i in enumerate(order))
    return Sample(prompt=sample.prompt[:start] + text + sample.prompt[end:], response=sample.response, id=sample.id,
                  label=sample.label, spans=sample.spans, context_span=(start, start + len(text)),
                  meta={**sample.meta, "template": "shuffled"})


def in_inst_wrapping(sample: Sample) -> Sample:
    """``sample``'s prompt as ``[INST] PROMPT [/INST]`` (Llama-2-chat's and Mistral-Instruct's user turn without a
    system message), the context span moved with it."""
    from halwatch.eval.datasets import wrapped_prompt

    return wrapped_prompt(sample, "[INST] ", " [/INST]", "inst")


def render(sample: Sample, how: str, tokenizer=None, seed: int = 0) -> Sample:
    """One RAGTruth sample in rendering ``how`` (:data:`RENDERINGS`)."""
    from halwatch.eval.datasets import as_qa_template, in_chat_template

    if how == "ragtruth":
        return sample
    if how == "qa":
        return as_qa_template(sample)
    if how == "chat":
        return in_chat_template(sample, tokenizer)
    if how == "shuffled":
        return shuffled_passages(sample, seed)
    if how == "inst":
        return in_inst_wrapping(sample)
    raise ValueError(f"unknown rendering {how!r}: choose from {', '.join(RENDERINGS)}")


def invariance(detector, samples: list[Sample], progress: bool = True, seed: int = 0) -> dict:
    """Score every sample in every rendering with a fitted ``detector``; per rendering: ``median_abs_change`` and
    ``mean_abs_change`` of the probability against ``ragtruth``, ``flips`` (share of verdicts that differ),
    ``auroc``, ``flagged`` (share of answers called hallucinated) and ``n``; and the per-answer probabilities.
    Every rendering is question answering: a detector with one part per task is judged by its ``qa`` part. A scoring
    model whose tokenizer has no chat template (a base model) skips ``chat``, listed under ``skipped``."""
    from halwatch.eval.metrics import evaluate

    detector = detector.for_task("qa")
    scorer = detector.get_scorer()
    tokenizer = scorer.model.tokenizer
    hows = [how for how in RENDERINGS if how != "chat" or getattr(tokenizer, "chat_template", None)]
    labels = np.array([s.label for s in samples])
    probs, ranking, inputs = {}, {}, {}
    for how in hows:
        rendered = [render(s, how, tokenizer, seed) for s in samples]
        views = [scorer.encode(s) for s in rendered]
        signals = scorer.signals(rendered, detector.request(), progress=progress, views=views)
        probs[how], ranking[how] = detector.scores_and_ranking(signals)
        inputs[how] = np.asarray(detector.ood_inputs(signals), dtype=float)
    base = probs["ragtruth"]
    out = {"n": len(samples), "threshold": float(detector.threshold), "dtype": scorer.model.dtype, "renderings": {},
           "skipped": [how for how in RENDERINGS if how not in hows]}
    for how, p in probs.items():
        change = np.abs(p - base)
        flips = (p >= detector.threshold) != (base >= detector.threshold)
        found = evaluate(labels, p, detector.threshold, ranking[how])
        out["renderings"][how] = {"median_abs_change": round(float(np.median(change)), 4),
                                  "mean_abs_change": round(float(change.mean()), 4),
                                  "flips": round(float(flips.mean()), 4), "auroc": round(found["auroc"], 4),
                                  "flagged": round(float((p >= detector.threshold).mean()), 4)}
        if detector.ood_reference:
            spread = np.array(detector.ood_reference["std"])
            moved = np.median(np.abs(inputs[how] - inputs["ragtruth"]) / spread, axis=0)
            names = getattr(detector, "columns", None) or [f"input{k}" for k in range(len(moved))]
            out["renderings"][how]["inputs_median_abs_change_sd"] = {n: round(float(m), 3)
                                                                     for n, m in zip(names, moved)}
    out["probabilities"] = {how: [round(float(x), 5) for x in p] for how, p in probs.items()}
    out["ids"] = [s.id for s in samples]
    return out


def run_invariance(detector: str = "default", dataset: str = "ragtruth:all", split: str = "dev", n: int = 150,
                   seed: int = 0, out=None, scorer_options: dict | None = None) -> dict:
    """``halwatch bench invariance``: :func:`invariance` on ``n`` answers (seeded, stratified by label) of a
    RAGTruth ``dataset``'s ``split``; prints a table and writes ``out`` (JSON) when given."""
    import json
    from pathlib import Path

    from halwatch.data.splits import split_of
    from halwatch.detectors import load_detector
    from halwatch.errors import InputError
    from halwatch.eval.datasets import load_dataset
    from halwatch.eval.folds import subset

    if not dataset.startswith("ragtruth:"):
        raise InputError("the invariance benchmark renders RAGTruth answers: give --datasets ragtruth:GENERATOR")
    det = load_detector(detector, **(scorer_options or {"cache": True}))
    samples = [s for s in load_dataset(dataset)[0] if split_of(s) == split]
    labels = np.array([s.label for s in samples])
    picked = [samples[i] for i in subset(np.arange(len(samples)), labels, n, seed)]
    result = {"detector": detector, "dataset": dataset, "split": split, "seed": seed, **invariance(det, picked,
                                                                                                  seed=seed)}
    print(f"template invariance of {detector} on {result['n']} answers of {dataset} ({split} split), against "
          f"RAGTruth's own prompt; threshold {result['threshold']:.3f}; scored in {result['dtype']}")
    print("| rendering | median abs. change | mean abs. change | verdict flips | flagged | AUROC |")
    print("| --- | --- | --- | --- | --- | --- |")
    for how, r in result["renderings"].items():
        print(f"| {how} | {r['median_abs_change']:.3f} | {r['mean_abs_change']:.3f} | {r['flips']:.3f} | "
              f"{r['flagged']:.3f} | {r['auroc']:.3f} |")
    for how in result["skipped"]:
        print(f"| {how} | skipped: the scoring model's tokenizer has no chat template |")
    for how, r in result["renderings"].items():
        if how != "ragtruth" and "inputs_median_abs_change_sd" in r:
            moved = ", ".join(f"{k} {v:.2f}" for k, v in r["inputs_median_abs_change_sd"].items())
            print(f"{how}: median change of each input, in training standard deviations: {moved}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result
