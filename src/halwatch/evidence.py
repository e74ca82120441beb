"""Evidence: for every sentence of an answer, the context sentences it rests on, read from the pass halwatch already
runs (issue 76).

- ``attention`` (the default mode): the attention rows of the response tokens, summed over a few heads
  (:func:`evidence_heads`: the heads that look back at the context most, Lookback Lens' lookback ratio, section 2.1,
  chosen on grounded training answers), captured inside the one forward pass (``SignalRequest.evidence_heads``).
- ``relevance``: LRP4RAG's relevance matrix ``R*`` (eq. 7, one row per response token; AttnLRP's rules), exact but
  a backward pass per response token.

An answer sentence's weight on a context sentence is the share of the mass of its content words' tokens on the
context (the prompt when no context is marked) that lands in that sentence; its sources are the heaviest sentences,
up to :data:`TOP_K`, those with at least :data:`MIN_WEIGHT`. Over the windows of a long context, each context
sentence keeps its highest weight. A sentence the detector flags (one of its spans lies in it) gets no sources: it
says so instead of pointing at the least bad one. halwatch's own rule: the papers score answers, not their sources;
ContextCite (Cohen-Wang et al., 2024) ablates context sentences instead, at tens of passes per answer.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from halwatch.errors import InputError
from halwatch.models.relevance import RelevanceRequest
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.sentences import sentence_ranges
from halwatch.signals.support import STOPWORDS
from halwatch.tokens import WORD, TokenView, window_groups

MODES = ("attention", "relevance")
#: The most context sentences an answer sentence points at.
TOP_K = 3
#: The least weight a context sentence needs to be a source (the top one always is, where the answer sentence is
#: supported and has any mass on the context).
MIN_WEIGHT = 0.1
#: The share of heads chosen as evidence heads (:func:`choose_heads`): the top 10 % by mean lookback ratio, the head
#: set the dev probe measured (docs/results/smollm2-135m-evidence-dev).
HEAD_SHARE = 0.1
#: The heads chosen for the shipped scoring models, by weights hash (made by ``python -m halwatch.evidence``).
HEADS_FILE = Path(__file__).resolve().parent / "artifacts" / "evidence" / "heads.json"


@lru_cache(maxsize=None)
def _shipped() -> dict:
    return json.loads(HEADS_FILE.read_text()) if HEADS_FILE.exists() else {}


def evidence_heads(model) -> tuple[tuple[int, int], ...]:
    """The heads whose attention gives a scoring model's evidence: those chosen for it (:data:`HEADS_FILE`, keyed
    by its weights' hash), else every head of the last third of its layers (0.852 top-1 on the dev probe's short
    answers, against 0.918 for chosen heads)."""
    chosen = _shipped().get(model.weights_hash)
    if chosen is not None:
        return tuple((int(layer), int(head)) for layer, head in chosen["heads"])
    return tuple(h for h in model.all_heads() if h[0] >= 2 * model.n_layers // 3)


def choose_heads(scorer, samples, share: float = HEAD_SHARE) -> list[tuple[int, int]]:
    """The top ``share`` of the scoring model's heads by mean lookback ratio (Lookback Lens, eq. 1) over the
    response tokens of ``samples`` (grounded answers: no label is read)."""
    heads = scorer.model.all_heads()
    request = SignalRequest(heads=heads, reducers=("lookback",))
    ratios = [s.head_values("lookback.ratio", heads).mean(axis=1) for s in scorer.signals(samples, request)]
    top = np.argsort(-np.mean(ratios, axis=0), kind="stable")[: max(1, int(round(len(heads) * share)))]
    return sorted(heads[i] for i in top)


def check_mode(mode) -> None:
    """Refuse an evidence mode that is not one of :data:`MODES` (``None``: no evidence, accepted)."""
    if mode is not None and mode not in MODES:
        raise InputError(f"unknown evidence mode {mode!r}: choose one of {', '.join(MODES)}")


def request(model, mode: str) -> SignalRequest:
    """What the pass must return for evidence in ``mode`` (:data:`MODES`)."""
    check_mode(mode)
    if mode == "attention":
        return SignalRequest(evidence_heads=evidence_heads(model))
    return SignalRequest(relevance=RelevanceRequest(rows=-1))


def token_mass(signals: Signals, mode: str) -> np.ndarray:
    """``[R, n_prompt]``: how much each response token draws on each prompt token (relevance: its positive part)."""
    if mode == "attention":
        return np.asarray(signals.evidence, dtype=np.float64)
    return np.clip(np.asarray(signals.relevance["rows"], dtype=np.float64), 0.0, None)


def prompt_offsets(view: TokenView, tokenizer) -> np.ndarray:
    """``[n_prompt, 2]``: each prompt token's characters in ``view.sample.prompt`` (``-1`` for a token of the chat
    template or a special token), from the text the view's prompt was tokenized from (:meth:`TokenView.prompt_text`:
    a window holds a part of the context)."""
    text = view.prompt_text()
    if view.input_mode == "chat":
        full = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        shift = full.find(text)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    else:
        shift, enc = 0, tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(view.input_ids[:view.n_prompt]) or shift < 0:
        raise ValueError("the prompt's tokens could not be matched to its characters")
    spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) - shift
    outside = (spans[:, 1] <= spans[:, 0]) | (spans[:, 0] < 0) | (spans[:, 1] > len(text))
    if view.kept is not None:  # positions in the window's text -> positions in the whole prompt
        ctx_start, ctx_end = view.sample.context_span or (0, len(view.sample.prompt))
        held = view.kept[1] - view.kept[0]
        shift_of = np.where(spans[:, 0] < ctx_start, 0,
                            np.where(spans[:, 0] < ctx_start + held, view.kept[0] - ctx_start,
                                     ctx_end - ctx_start - held))
        spans = spans + shift_of[:, None]
    spans[outside] = -1
    return spans


def content_tokens(view: TokenView) -> np.ndarray:
    """``[R]`` bool: the response tokens that overlap a content word (one not in
    :data:`halwatch.signals.support.STOPWORDS`): the tokens whose attention evidence reads, chosen on the dev split
    (docs/results/smollm2-135m-evidence-dev, variants: 0.941 top-1 on restated answers against 0.898 with every
    token, copied answers unchanged)."""
    text = view.sample.response
    return np.array([any(w.lower() not in STOPWORDS for w in WORD.findall(text[a:b])) for a, b in view.offsets],
                    dtype=bool)


def context_units(sample) -> tuple[str, int, list[tuple[int, int]]]:
    """``(field, its start in the prompt, its sentences)``: the context's sentences, or the prompt's."""
    if sample.context_span is not None:
        start, end = sample.context_span
        return "context", start, sentence_ranges(sample.prompt[start:end])
    return "prompt", 0, sentence_ranges(sample.prompt)


def sentence_rows(view: TokenView, sentences: list[dict]) -> list[np.ndarray]:
    """Per answer sentence, ``[R]`` bool: the response tokens evidence reads for it, those of its content words
    (:func:`content_tokens`), or all of its tokens where it has none. The same for every window of an answer."""
    offsets = np.asarray(view.offsets, dtype=np.int64).reshape(-1, 2)
    content = content_tokens(view)
    out = []
    for s in sentences:
        rows = (offsets[:, 0] < s["end"]) & (offsets[:, 1] > s["start"])
        out.append(rows & content if (rows & content).any() else rows)
    return out


def unit_weights(view: TokenView, mass: np.ndarray, tokenizer, base: int, units, rows_of: list[np.ndarray]
                 ) -> np.ndarray:
    """``[answer sentences, units]``: each answer sentence's share of the mass of its tokens (``rows_of``,
    :func:`sentence_rows`) on the units (:func:`context_units`)."""
    spans = prompt_offsets(view, tokenizer)
    starts = np.where(spans[:, 1] > 0, spans[:, 1] - 1 - base, -1)  # a token's last character: " It" is in "It ..."
    unit_starts = np.array([a for a, _ in units], dtype=np.int64)
    unit_ends = np.array([b for _, b in units], dtype=np.int64)
    unit = np.searchsorted(unit_starts, starts, side="right") - 1
    inside = (starts >= 0) & (unit >= 0) & (starts < unit_ends[np.clip(unit, 0, None)]) if len(units) else \
        np.zeros(len(starts), dtype=bool)
    out = np.zeros((len(rows_of), len(units)))
    for j, rows in enumerate(rows_of):
        per_token = mass[rows].sum(axis=0)[: view.n_prompt]
        total = per_token[inside].sum()
        if total > 0:
            out[j] = np.bincount(unit[inside], weights=per_token[inside], minlength=len(units)) / total
    return out


def attach(verdicts: list[dict], views: list[TokenView], signals: list[Signals], tokenizer, mode: str,
           top_k: int = TOP_K) -> None:
    """Give each verdict's answer sentences (``evidence``, from :meth:`Detector.verdicts` with ``sentences``) their
    ``supported`` flag and ``sources`` (``start``, ``end``, ``text``, ``weight``, ``field``), from the signals of
    the answer's views (an answer's windows come together, :func:`halwatch.tokens.window_groups`)."""
    for verdict, group in zip(verdicts, window_groups(views)):
        sample = views[group[0]].sample
        field, base, units = context_units(sample)
        sentences = verdict["evidence"]
        rows_of = sentence_rows(views[group[0]], sentences)
        weights = np.zeros((len(sentences), len(units)))
        for i in group:
            found = unit_weights(views[i], token_mass(signals[i], mode), tokenizer, base, units, rows_of)
            weights = np.maximum(weights, found)
        text = sample.prompt[base:]  # the context from its start (base 0: the prompt)
        for j, sentence in enumerate(sentences):
            flagged = any(sp["start"] < sentence["end"] and sentence["start"] < sp["end"] for sp in verdict["spans"])
            sentence["supported"] = not flagged
            order = [u for u in np.argsort(-weights[j], kind="stable")[:top_k] if weights[j, u] > 0]
            keep = [u for k, u in enumerate(order) if k == 0 or weights[j, u] >= MIN_WEIGHT]
            sentence["sources"] = [] if flagged else [
                {"start": units[u][0], "end": units[u][1], "text": text[units[u][0]:units[u][1]],
                 "weight": round(float(weights[j, u]), 4), "field": field} for u in keep]


def main(argv=None) -> None:
    """Choose a scoring model's evidence heads on the grounded SQuAD-built answers of the train split and write
    them to :data:`HEADS_FILE` (the command that made the shipped file)."""
    import argparse

    from halwatch.data.shapes import build_squad_shapes
    from halwatch.data.splits import split_of
    from halwatch.eval.protocols import source_commit
    from halwatch.scorer import Scorer

    parser = argparse.ArgumentParser(prog="python -m halwatch.evidence", description=main.__doc__)
    parser.add_argument("--model", default=None, help="a registered scoring model or a local folder")
    parser.add_argument("--answers", type=int, default=120, help="grounded train answers to choose on")
    args = parser.parse_args(argv)
    scorer = Scorer.from_options(model=args.model, cache=None, dtype="float32")
    found = [s for s in build_squad_shapes() if split_of(s) == "train" and s.meta["shape"] in ("phrase", "sentence")]
    pick = np.random.default_rng(0).choice(len(found), size=min(args.answers, len(found)), replace=False)
    heads = choose_heads(scorer, [found[i] for i in sorted(pick)])
    shipped = dict(_shipped())
    shipped[scorer.model.weights_hash] = {
        "scoring_model": scorer.model.name, "heads": [list(h) for h in heads], "share": HEAD_SHARE,
        "chosen_on": f"{len(pick)} grounded squad-shapes train answers (phrase, sentence), float32",
        "commit": source_commit(), "command": "python -m halwatch.evidence" + (
            f" --model {args.model}" if args.model else "") + f" --answers {args.answers}"}
    HEADS_FILE.write_text(json.dumps(shipped, indent=1) + "\n")
    print(f"{len(heads)} heads for {scorer.model.name}: {heads}")


if __name__ == "__main__":
    main()
