"""Token view of a sample: the scoring model's input ids, the prompt/response boundary, and the character span in the
response of every response token, so that any per-token signal can be turned into character spans.

Two input modes build the model input (recorded with every result):

- ``raw``: the prompt's tokens (with the tokenizer's own special tokens, e.g. BOS) followed by the response's tokens,
  each tokenized on its own, as the TOHA reference code does.
- ``chat``: the scoring model's chat template with the prompt as the user turn and the generation prompt of the
  assistant turn, followed by the response's tokens as the assistant's answer.

In both modes the response is tokenized by itself, so its token offsets index ``sample.response`` directly.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from halwatch.errors import InputError
from halwatch.sample import Sample

INPUT_MODES = ("raw", "chat")
DEFAULT_MAX_TOKENS = 1024

log = logging.getLogger("halwatch")

#: A word: letters and digits, with inner ``.``, ``,`` and ``'`` kept (``1,250.5``, ``don't``). Spans start and end
#: on these, and the lexical support compares them with the context.
WORD = re.compile(r"\w+(?:[.,']\w+)*", re.UNICODE)


def words(text: str) -> list[tuple[str, int, int]]:
    """``(lower-cased word, start, end)`` of every word of ``text``."""
    return [(m.group(0).lower(), m.start(), m.end()) for m in WORD.finditer(text)]


def bridge_gaps(flagged: np.ndarray, gap: int, owner: np.ndarray | None = None) -> np.ndarray:
    """``flagged`` with every run of at most ``gap`` unflagged tokens between two flagged ones flagged too; with
    ``owner`` (the response of each token, for tokens of many responses end to end) only inside one response."""
    flagged = np.asarray(flagged, dtype=bool)
    if not gap or not flagged.any():
        return flagged
    n = len(flagged)
    idx = np.arange(n)
    prev = np.maximum.accumulate(np.where(flagged, idx, -1))  # the last flagged token at or before each
    nxt = np.minimum.accumulate(np.where(flagged, idx, n)[::-1])[::-1]  # the first at or after
    fill = (prev >= 0) & (nxt < n) & (nxt - prev - 1 <= gap)
    if owner is not None:
        fill &= (owner[np.clip(prev, 0, n - 1)] == owner) & (owner[np.clip(nxt, 0, n - 1)] == owner)
    return flagged | fill


@dataclass
class TokenView:
    """The model input of one sample. Positions ``n_prompt .. len(input_ids) - 1`` are the response tokens."""

    sample: Sample
    input_ids: list[int]
    n_prompt: int
    offsets: list[tuple[int, int]]  # character span in sample.response of each response token
    input_mode: str
    cut_chars: int = 0  # characters cut from the left of the context to fit the token cap
    cut_tokens: int = 0  # prompt tokens those characters took
    n_header: int = 0  # the last prompt tokens that form the answer header (see answer_header_length)
    window: tuple[int, int] = (0, 1)  # (index, count) of this view among the windows of a long context
    kept: tuple[int, int] | None = None  # the characters of the prompt's context that the view holds (None: all)

    @property
    def n_response(self) -> int:
        return len(self.input_ids) - self.n_prompt

    def prompt_text(self) -> str:
        """The prompt as the scoring model saw it: the context less what the token cap cut, or only this window."""
        prompt = self.sample.prompt
        if self.kept is None:
            return prompt
        ctx_start, ctx_end = self.sample.context_span or (0, len(prompt))
        return prompt[:ctx_start] + prompt[self.kept[0]:self.kept[1]] + prompt[ctx_end:]

    def word_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, ends, first, last)``: the character range of every word of the response (:data:`WORD`) and,
        per response token, the first and last word it overlaps (``first > last`` for a token of white space or
        punctuation alone; a token can hold the end of one word and the start of the next). Computed once per
        view."""
        return self._word_index

    def word_count(self, start: int, end: int) -> int:
        """How many words of the response lie in ``start .. end`` (a span's characters)."""
        starts = self._word_index[0]
        return int(np.searchsorted(starts, end, side="left") - np.searchsorted(starts, start, side="left"))

    @cached_property
    def _word_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        found = words(self.sample.response)
        starts = np.array([a for _, a, _ in found], dtype=np.int64)
        ends = np.array([b for _, _, b in found], dtype=np.int64)
        offsets = np.asarray(self.offsets, dtype=np.int64).reshape(-1, 2)
        first = np.searchsorted(ends, offsets[:, 0], side="right")  # the first word ending after the token starts
        last = np.searchsorted(starts, offsets[:, 1], side="left") - 1  # the last word starting before it ends
        return starts, ends, first, last

    def word_scores(self, token_scores) -> np.ndarray:
        """Per word of :meth:`word_index`, the highest score of the tokens it overlaps (a word split into several
        tokens is as suspect as its most suspect piece)."""
        scores = np.asarray(token_scores, dtype=float)
        if scores.shape != (self.n_response,):
            raise ValueError(f"expected {self.n_response} token scores, got shape {scores.shape}")
        starts, _, first, last = self.word_index()
        out = np.full(len(starts), -np.inf)
        one = first == last
        np.maximum.at(out, first[one], scores[one])
        for t in np.flatnonzero(first < last):
            out[first[t]:last[t] + 1] = np.maximum(out[first[t]:last[t] + 1], scores[t])
        return out

    def spans(self, token_scores, threshold: float, gap: int = 0) -> list[dict]:
        """Character spans of the words whose score (:meth:`word_scores`) is at least ``threshold``.

        Spans start and end on word boundaries: a flagged word is flagged whole, whatever its tokens, and a span
        never starts or ends on white space or punctuation. Consecutive flagged words merge into one span, and so do
        flagged runs at most ``gap`` words apart; a span's ``confidence`` is the highest word score inside it.
        """
        scores = self.word_scores(token_scores)
        starts, ends = self._word_index[:2]
        text = self.sample.response
        flagged = bridge_gaps(scores >= threshold, gap)
        spans: list[dict] = []
        edges = np.flatnonzero(np.diff(np.r_[0, flagged.astype(np.int8), 0]))
        for first, stop in zip(edges[::2], edges[1::2]):
            start, end = int(starts[first]), int(ends[stop - 1])
            spans.append({"start": start, "end": end, "text": text[start:end],
                          "confidence": float(scores[first:stop].max())})
        return spans

    @property
    def has_token_labels(self) -> bool:
        """Whether :meth:`token_labels` says which tokens are hallucinated: a grounded answer's tokens are all
        supported, and a hallucinated answer's are known only where it has gold spans (an answer labelled
        hallucinated without spans must be left out of any token-level loss)."""
        return self.sample.label != 1 or bool(self.sample.spans)

    def token_labels(self) -> np.ndarray:
        """1 for each response token that overlaps a gold span of the sample, else 0."""
        labels = np.zeros(self.n_response, dtype=np.int8)
        for span in self.sample.spans:
            for i, (start, end) in enumerate(self.offsets):
                if start < span["end"] and span["start"] < end:
                    labels[i] = 1
        return labels


def prompt_token_ids(tokenizer, prompt: str, input_mode: str) -> list[int]:
    if input_mode == "raw":
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if input_mode == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("the scoring model's tokenizer has no chat template: use input mode 'raw'")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    raise ValueError(f"unknown input mode {input_mode!r}: choose one of {', '.join(INPUT_MODES)}")


def _prompt_tokens(tokenizer, prompt: str, input_mode: str) -> tuple[list[int], list | None]:
    """:func:`prompt_token_ids`, and in raw mode the tokens' character offsets too (one tokenizer call, where the answer
    header would take a second: :func:`answer_header_length`)."""
    return _prompts_tokens(tokenizer, [prompt], input_mode)[0]


def _prompts_tokens(tokenizer, prompts: list[str], input_mode: str) -> list[tuple[list[int], list | None]]:
    """:func:`_prompt_tokens` of many prompts, in one tokenizer call in raw mode (a fast tokenizer encodes them in
    parallel, and the call's own cost is paid once)."""
    if input_mode != "raw":
        return [(prompt_token_ids(tokenizer, p, input_mode), None) for p in prompts]
    enc = tokenizer(prompts, add_special_tokens=True, return_offsets_mapping=True)
    return [(list(ids), offsets) for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"])]


#: The longest last prompt line (in characters) that counts as an answer header in raw mode.
MAX_HEADER_CHARS = 40


def answer_header_length(tokenizer, prompt: str, input_mode: str, prompt_ids: list[int], offsets=None) -> int:
    """How many of the last prompt tokens form the answer header: the tokens after which the answer begins and that
    belong to neither the context nor the question (Lookback Lens counts them as new tokens, as its reference code
    counts ``\n#Answer#:``).

    - ``chat``: the generation prompt of the chat template (the assistant header, e.g. ``<|im_start|>assistant\n``):
      the tokens that ``add_generation_prompt`` adds.
    - ``raw``: the prompt's last line, with its line break, when it is a short cue ending with a colon
      (``\nAnswer:`` of the SQuAD template, ``\noutput:`` of RAGTruth, at most :data:`MAX_HEADER_CHARS`
      characters); otherwise none.
    """
    if input_mode == "chat":
        bare = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=False)
        n_bare = len(tokenizer(bare, add_special_tokens=False)["input_ids"])
        return max(0, min(len(prompt_ids) - n_bare, len(prompt_ids) - 1))
    cut = prompt.rfind("\n")
    last = prompt[cut + 1 :].strip()
    if cut < 0 or not last.endswith(":") or len(last) > MAX_HEADER_CHARS:
        return 0
    if offsets is None:  # the character offsets of prompt_ids
        offsets = tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
    n = sum(1 for start, end in offsets if end > cut and end > start)
    return min(n, len(prompt_ids) - 1)


def _response_tokens(tokenizer, response: str) -> tuple[list[int], list[tuple[int, int]]]:
    return _responses_tokens(tokenizer, [response])[0]


def _responses_tokens(tokenizer, responses: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Each response's token ids and character offsets (inside the text), in one tokenizer call."""
    enc = tokenizer(responses, add_special_tokens=False, return_offsets_mapping=True)
    return [_inside(response, list(ids), offsets)
            for response, ids, offsets in zip(responses, enc["input_ids"], enc["offset_mapping"])]


def _inside(response: str, ids: list[int], offsets) -> tuple[list[int], list[tuple[int, int]]]:
    offsets = [tuple(o) for o in offsets]
    # Byte-level tokenizers may give a token that holds part of a multi-byte character the same span as its
    # neighbour; keep spans inside the text and non-decreasing so every token maps to real characters.
    fixed: list[tuple[int, int]] = []
    prev_end = 0
    for start, end in offsets:
        start, end = max(0, min(start, len(response))), max(0, min(end, len(response)))
        if end <= start:
            start, end = prev_end, max(prev_end, end)
        fixed.append((start, end))
        prev_end = max(prev_end, end)
    return ids, fixed


#: Characters kept per token of the cap before a very long context is tokenized (see :func:`encode`).
PRECUT_CHARS_PER_TOKEN = 64
#: The most windows a long context is scored in (:func:`encode_windows`).
MAX_WINDOWS = 8
#: The share of a window's context tokens that the next window holds too, so that a passage cut at one window's
#: edge is whole in its neighbour.
WINDOW_OVERLAP = 0.25


def tail_start(text: str, keep: int, start: int = 0, end: int | None = None) -> int:
    """Where the last ``keep`` characters of ``text[start:end]`` begin (``start`` when there are no more), moved to
    the next space if one comes within 64 characters, so that no word is split."""
    end = len(text) if end is None else end
    at = max(start, end - keep)
    if at > start:
        space = text.find(" ", at, min(end, at + 64))
        at = space if space >= 0 else at
    return at


def encode(sample: Sample, tokenizer, input_mode: str = "raw", max_tokens: int = DEFAULT_MAX_TOKENS) -> TokenView:
    """Tokenize ``sample`` for the scoring model, cutting the context from its left end to fit ``max_tokens``.

    The response is never cut: a response that alone does not fit, or does not fit beside the part of the prompt
    that is not context, raises :class:`InputError` for that record.
    """
    return _logged(_encode(sample, tokenizer, input_mode, max_tokens), max_tokens)


def encode_many(samples: list[Sample], tokenizer, input_mode: str = "raw", max_tokens: int = DEFAULT_MAX_TOKENS,
                max_windows: int = 1, keep_errors: bool = False) -> list:
    """:func:`encode_windows` of every sample (with ``max_windows=1``, :func:`encode`'s one view each): the same
    views, with the responses tokenized in one call and the prompts in another (raw mode), where each sample alone
    would take two or three calls. A prompt that does not fit is cut as :func:`encode` cuts it. Raises the first
    sample's :class:`InputError`, as encoding them one by one would; with ``keep_errors``, a failing sample gets
    its error in its place."""
    if input_mode not in INPUT_MODES:
        raise ValueError(f"unknown input mode {input_mode!r}: choose one of {', '.join(INPUT_MODES)}")
    if not samples:
        return []
    responses = _responses_tokens(tokenizer, [s.response for s in samples])
    precuts = [_precut(s, max_tokens) for s in samples]
    whole = [i for i, cut in enumerate(precuts) if not cut]  # the rest is cut before tokenizing
    prompts = dict(zip(whole, _prompts_tokens(tokenizer, [samples[i].prompt for i in whole], input_mode))) \
        if whole else {}  # (a tokenizer refuses an empty batch)
    out = []
    for i, sample in enumerate(samples):
        try:
            first = _encode(sample, tokenizer, input_mode, max_tokens, responses[i], prompts.get(i), precuts[i])
            out.append(_windows(sample, tokenizer, input_mode, max_tokens, max_windows, first) if max_windows > 1
                       else [_logged(first, max_tokens)])
        except InputError as exc:
            if not keep_errors:
                raise
            out.append(exc)
    return out


def _precut(sample: Sample, max_tokens: int) -> int:
    """Characters cut from the left of a context far longer than the cap before it is tokenized (:func:`_encode`)."""
    ctx_start, ctx_end = sample.context_span or (0, len(sample.prompt))
    return tail_start(sample.prompt, max_tokens * PRECUT_CHARS_PER_TOKEN, ctx_start, ctx_end) - ctx_start


def _logged(view: TokenView, max_tokens: int) -> TokenView:
    if view.cut_chars:
        log.warning("%s: prompt cut by %d context characters (from the left) to fit %d tokens",
                    view.sample.where or "sample", view.cut_chars, max_tokens)
    return view


def _encode(sample: Sample, tokenizer, input_mode: str, max_tokens: int, response=None, prompt=None,
            precut: int | None = None) -> TokenView:
    """:func:`encode` without its warning; ``response``: the response's tokens and offsets where they are at hand;
    ``prompt``: the whole prompt's tokens (and raw offsets), where they are at hand (only with no precut);
    ``precut``: :func:`_precut`, where it is at hand."""
    resp_ids, offsets = _checked_response(sample, tokenizer, input_mode, max_tokens, response)
    ctx_start, ctx_end = sample.context_span or (0, len(sample.prompt))
    # A context far longer than the cap loses its left part before it is tokenized (so that a megabyte of context
    # costs milliseconds): what is kept holds at least PRECUT_CHARS_PER_TOKEN characters per token of the cap, more
    # than any tokenizer's tokens span, so the cut below still happens inside it; the count of tokens dropped this
    # way is estimated from the characters per token of what is kept.
    precut = _precut(sample, max_tokens) if precut is None else precut
    view, n_first = _fit_context(sample, tokenizer, input_mode, max_tokens, resp_ids, offsets, ctx_start + precut,
                                 ctx_end, None if precut else prompt)
    view.cut_tokens += round(precut * n_first / max(1, len(sample.prompt) - precut))
    return view


def encode_windows(sample: Sample, tokenizer, input_mode: str = "raw", max_tokens: int = DEFAULT_MAX_TOKENS,
                   max_windows: int = MAX_WINDOWS) -> list[TokenView]:
    """The views of ``sample`` that together cover its context: :func:`encode`'s one view where the context fits the
    token cap; else windows of the context, left to right, each as long as fits beside the rest of the prompt and
    the whole response, each overlapping the next by :data:`WINDOW_OVERLAP` of its tokens, at most ``max_windows``
    of them (the last is :func:`encode`'s view, which ends where the context ends). A context longer than
    ``max_windows`` windows loses its left part, as with one window; every view's ``cut_tokens`` counts the context
    tokens that no window holds, and ``window`` is ``(index, count)``."""
    if max_windows <= 1:
        return [encode(sample, tokenizer, input_mode, max_tokens)]
    return _windows(sample, tokenizer, input_mode, max_tokens, max_windows,
                    _encode(sample, tokenizer, input_mode, max_tokens))


def _windows(sample: Sample, tokenizer, input_mode: str, max_tokens: int, max_windows: int,
             last: TokenView) -> list[TokenView]:
    """:func:`encode_windows` from ``last``, the sample's :func:`_encode` view (the last window)."""
    if not last.cut_chars:
        return [last]
    prompt = sample.prompt
    ctx_start, ctx_end = sample.context_span or (0, len(prompt))
    kept_from = ctx_start + last.cut_chars
    size = len(tokenizer(prompt[kept_from:ctx_end], add_special_tokens=False)["input_ids"])  # tokens of a window
    stride = max(1, int(size * (1 - WINDOW_OVERLAP)))
    needed = size + stride * (max_windows - 1)
    keep = needed * 8  # characters: enough for most text; more (up to the bound of encode's cut) where not
    while True:
        lo = tail_start(prompt, keep, ctx_start, ctx_end)
        found = tokenizer(prompt[lo:ctx_end], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if lo == ctx_start or len(found) >= needed or keep >= needed * PRECUT_CHARS_PER_TOKEN:
            break
        keep *= 4
    spans = [(lo + a, lo + b) for a, b in found]
    firsts = [len(spans) - size]
    while firsts[-1] > 0 and len(firsts) < max_windows:
        firsts.append(max(0, firsts[-1] - stride))
    if len(firsts) == 1:  # the cut context tokenizes into no more than one window after all
        log.warning("%s: prompt cut by %d context characters (from the left) to fit %d tokens",
                    sample.where or "sample", last.cut_chars, max_tokens)
        return [last]
    firsts.reverse()
    resp_ids, offsets = _response_tokens(tokenizer, sample.response)
    views = [_fit_context(sample, tokenizer, input_mode, max_tokens, resp_ids, offsets, spans[t][0],
                          spans[min(t + size, len(spans)) - 1][1])[0] for t in firsts[:-1]] + [last]
    dropped = firsts[0] + (round((lo - ctx_start) * len(spans) / max(1, ctx_end - lo)) if lo > ctx_start else 0)
    for k, view in enumerate(views):
        view.window, view.cut_tokens = (k, len(views)), dropped
    if dropped:
        log.warning("%s: context of about %d tokens scored in %d windows; its first %d tokens (estimated from the "
                    "characters per token of the rest where not counted) are in none of them (at most %d windows)",
                    sample.where or "sample", len(spans) - firsts[0] + dropped, len(views), dropped, max_windows)
    return views


def runs_within(sizes, limit: int) -> list[range]:
    """Consecutive runs of indices into ``sizes`` whose sizes add up to at most ``limit``, in order; an item larger
    than ``limit`` makes a run alone. Pieces of work that bound memory: views scored at once, rows read at once."""
    runs, start = [], 0
    while start < len(sizes):
        stop, size = start, 0
        while stop < len(sizes) and (size == 0 or size + sizes[stop] <= limit):
            size += sizes[stop]
            stop += 1
        runs.append(range(start, stop))
        start = stop
    return runs


def window_groups(views) -> list[list[int]]:
    """The indices of each answer's views in ``views``: the windows ``(0, n) .. (n - 1, n)`` of one sample's long
    context (:func:`encode_windows`) come together and in order, and form one answer; any other view is one."""
    groups: list[list[int]] = []
    k = 0
    while k < len(views):
        n = views[k].window[1]
        if k + n > len(views) or any(views[k + j].window != (j, n) or views[k + j].sample is not views[k].sample
                                     for j in range(n)):
            raise ValueError(f"view {k}: the windows of one answer must come together and in order")
        groups.append(list(range(k, k + n)))
        k += n
    return groups


def _checked_response(sample: Sample, tokenizer, input_mode: str, max_tokens: int, response=None):
    if input_mode not in INPUT_MODES:
        raise ValueError(f"unknown input mode {input_mode!r}: choose one of {', '.join(INPUT_MODES)}")
    resp_ids, offsets = response or _response_tokens(tokenizer, sample.response)
    if len(resp_ids) >= max_tokens:
        raise InputError(
            f"the response alone has {len(resp_ids)} tokens, over the cap of {max_tokens - 1} of the scoring model "
            f"(halwatch score and fit take --max-tokens)",
            sample.where,
        )
    return resp_ids, offsets


def _fit_context(sample: Sample, tokenizer, input_mode: str, max_tokens: int, resp_ids, offsets, start: int,
                 end: int, whole=None) -> tuple[TokenView, int]:
    """The view whose prompt holds, of the context, the characters ``start .. end`` less as many on the left as the
    cap needs (``cut_chars``: those characters counted from ``start``; ``cut_tokens``: the tokens they took), and
    the prompt's length in tokens before any cut. ``whole``: :func:`_prompt_tokens` of the whole prompt, where it is
    at hand (then ``start .. end`` must be the whole context)."""
    prompt = sample.prompt
    ctx_start, ctx_end = sample.context_span or (0, len(prompt))
    cut, n_first = 0, None
    while True:
        text = prompt[:ctx_start] + prompt[start + cut:end] + prompt[ctx_end:]
        prompt_ids, prompt_offsets = whole if whole is not None and not cut else \
            _prompt_tokens(tokenizer, text, input_mode)
        n_first = len(prompt_ids) if n_first is None else n_first
        excess = len(prompt_ids) + len(resp_ids) - max_tokens
        if excess <= 0:
            break
        ctx_offsets = tokenizer(prompt[start + cut:end], add_special_tokens=False,
                                return_offsets_mapping=True)["offset_mapping"]
        if excess >= len(ctx_offsets):
            raise InputError(
                f"prompt and response do not fit in {max_tokens} tokens even with the whole context cut "
                f"(response: {len(resp_ids)} tokens)",
                sample.where,
            )
        cut += max(1, ctx_offsets[excess][0])
    view = TokenView(sample=sample, input_ids=prompt_ids + resp_ids, n_prompt=len(prompt_ids), offsets=offsets,
                     input_mode=input_mode, cut_chars=(start - ctx_start) + cut, cut_tokens=n_first - len(prompt_ids),
                     n_header=answer_header_length(tokenizer, text, input_mode, prompt_ids, prompt_offsets),
                     kept=(start + cut, end))
    return view, n_first
