"""Dev-split check of sentence-level alignment flags for the token model (issue 33): the `fused` detector fitted on
RAGTruth's training answers and read on its dev answers, with the lexical support flags as shipped and with five
more per word: its (crudely stemmed) content word absent from the context sentence that shares the most content
words with the answer sentence holding it, absent from the best window of three context sentences, absent from the
whole context, and per answer sentence the share of its content words absent from the context and one minus its
best context sentence's overlap. A prototype: the flags live in this script, not in `halwatch.signals.support`,
and are appended to each answer's token support flags, so the token model (and nothing else) reads them.

    .venv/bin/python docs/results/smollm2-135m-local-dev/dev_check.py [--variants local,plain]

Prints one JSON row per variant: answer AUROC, F1, FPR and TPR at the fitted threshold (`decision=fpr=0.2`),
character span precision, recall and F1, and the share of grounded dev answers without a span.
"""

import argparse
import copy
import json
import re
import time

import numpy as np

from halwatch.data.splits import split_of
from halwatch.detectors import create_detector
from halwatch.detectors.fused import signal_request
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import evaluate, span_scores
from halwatch.models.forward import tail_start
from halwatch.scorer import Scorer
from halwatch.signals import support
from halwatch.tokens import WORD, words

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
SUFFIXES = (("ies", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("ly", ""), ("s", ""))


def stem(word: str) -> str:
    for suffix, repl in SUFFIXES:
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[:len(word) - len(suffix)] + repl
    return word


def sentences(text: str) -> list[tuple[int, int]]:
    """Character ranges of the sentences of ``text`` (split after . ! ? and white space, or at line breaks)."""
    out, start = [], 0
    for m in SENTENCE_END.finditer(text):
        out.append((start, m.start()))
        start = m.end()
    return [r for r in out + [(start, len(text))] if r[1] > r[0]]


def content_stems(text: str) -> set:
    return {stem(w.lower()) for w in WORD.findall(text) if w.lower() not in support.STOPWORDS}


def local_word_flags(context: str, response: str) -> tuple[list, np.ndarray]:
    """Per response word: the five flags of the module's docstring."""
    ctx = [content_stems(context[a:b]) for a, b in sentences(context)] or [set()]
    windows = [set().union(*ctx[i:i + 3]) for i in range(max(len(ctx) - 2, 1))]
    whole = set().union(*ctx)
    found = words(response)
    flags = np.zeros((len(found), 5), dtype=np.float32)
    for a, b in sentences(response):
        inside = [k for k, (_, start, _) in enumerate(found) if a <= start < b]
        stems = {k: stem(found[k][0]) for k in inside if found[k][0] not in support.STOPWORDS}
        if not stems:
            continue
        own = set(stems.values())
        best = max(ctx, key=lambda c: len(own & c))
        best3 = max(windows, key=lambda c: len(own & c))
        novel_share = np.mean([s not in whole for s in stems.values()])
        for k in inside:
            if k in stems:
                flags[k, :3] = stems[k] not in best, stems[k] not in best3, stems[k] not in whole
            flags[k, 3:] = novel_share, 1 - len(own & best) / len(own)
    return [(start, end) for _, start, end in found], flags


def token_flags(view) -> np.ndarray:
    """``[R, 5]``: per response token the maximum of the flags of the words it overlaps (as the shipped flags)."""
    context = view.sample.context_text
    spans, flags = local_word_flags(context[tail_start(context, support.MAX_CONTEXT_CHARS):], view.sample.response)
    width = len(support.TOKEN_FEATURES)  # the shipped mapping from words to tokens, one block of its width at a time
    blocks = []
    for j in range(0, flags.shape[1], width):
        block = np.zeros((len(flags), width), dtype=np.float32)
        block[:, :flags[:, j:j + width].shape[1]] = flags[:, j:j + width]
        blocks.append(support._token_features(spans, block, view.offsets)[:, :flags[:, j:j + width].shape[1]])
    return np.concatenate(blocks, axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="local,plain")
    args = parser.parse_args()
    scorer = Scorer(batch_size=None)
    samples = [s for s in load_dataset("ragtruth:all")[0] if split_of(s) in ("train", "dev")]
    views = [scorer.encode(s) for s in samples]
    signals = scorer.signals(samples, signal_request(scorer.model), views=views, progress=True)
    train = [i for i, s in enumerate(samples) if split_of(s) == "train"]
    dev = [i for i, s in enumerate(samples) if split_of(s) == "dev"]
    labels = np.array([s.label for s in samples])
    y = labels[dev]
    for variant in args.variants.split(","):
        sigs = signals
        if variant == "local":
            sigs = [copy.copy(s) for s in signals]
            for s, v in zip(sigs, views):
                s.support = np.concatenate([s.support, token_flags(v)], axis=1)
        start = time.time()
        detector = create_detector("fused", scorer=scorer, decision="fpr=0.2")
        detector.fit_signals([sigs[i] for i in train], labels[train], [views[i] for i in train])
        verdicts = detector.verdicts([views[i] for i in dev], [sigs[i] for i in dev])
        p = np.array([v["score"] for v in verdicts])
        answers = evaluate(y, p, detector.threshold)
        row = {"variant": variant, **{k: answers[k] for k in ("auroc", "f1", "fpr", "tpr")},
               **span_scores([v["spans"] for v in verdicts], [samples[i].spans for i in dev]),
               "grounded_without_span": np.mean([not v["spans"] for v, label in zip(verdicts, y) if label == 0]),
               "seconds": time.time() - start}
        print(json.dumps({k: x if isinstance(x, str) else round(float(x), 4) for k, x in row.items()}), flush=True)


if __name__ == "__main__":
    main()
