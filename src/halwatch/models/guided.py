"""Detector-guided decoding (Lookback Lens section 3, "Lookback Lens Guided Decoding").

At each step the scoring model samples ``n_candidates`` continuations of ``chunk`` tokens from one shared key/value
cache; a fitted detector scores every candidate (:meth:`Detector.continuation_scores`: Lookback Lens scores the
candidate chunk with its window classifier, other detectors the whole partial response) and the least
hallucinated candidate is kept. Without a detector the answer is decoded greedily with the same stopping rules.

The signals of the candidates come from one batched teacher-forced pass over ``response so far + candidate``
that reuses the cached prompt (:func:`halwatch.models.forward.run` with ``past``), so they are the signals the
detector would see when scoring the finished text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from halwatch.errors import InputError
from halwatch.models import forward
from halwatch.models.sampling import answer_text, draw_tokens
from halwatch.tokens import TokenView, answer_header_length, prompt_token_ids


@dataclass
class Generation:
    """One generated answer: its text and token ids, whether the model ended it (an end token or, in raw mode, a
    line break) rather than the length cap, the detector's raw score of each kept chunk, and the time."""

    text: str
    token_ids: list[int]
    ended: bool = False
    chunk_scores: list[float] = field(default_factory=list)
    seconds: float = 0.0


def decoding_name(detector=None, sample: bool = False) -> str:
    """How an answer was decoded, as results record it: the guide's name, ``sampled`` or ``greedy``."""
    return detector.name if detector is not None else ("sampled" if sample else "greedy")


def _view(prompt_ids, response_ids, input_mode, n_header: int) -> TokenView:
    """A token view of generated ids (no text yet: the forward pass reads only the ids and the boundaries)."""
    return TokenView(sample=None, input_ids=list(prompt_ids) + list(response_ids), n_prompt=len(prompt_ids),
                     offsets=[(0, 0)] * len(response_ids), input_mode=input_mode, n_header=n_header)


def generate(scoring_model, prompt: str, input_mode: str, detector=None, max_new_tokens: int = 64,
             n_candidates: int = 8, chunk: int = 8, temperature: float = 1.0, top_p: float = 0.95,
             seed: int = 0, max_tokens: int | None = None, where: str | None = None,
             sample: bool = False) -> Generation:
    """Answer ``prompt`` with the scoring model, guided by a fitted ``detector``; without one, greedily, or by
    plain sampling with ``sample`` (the baseline that separates the guide's choice from the sampling itself).

    The answer has ``max_new_tokens`` tokens unless it ends earlier (an end token, or a line break after text in
    ``raw`` mode). Every random draw comes from one generator seeded with ``seed``. ``max_tokens``: the cap on
    prompt + answer tokens (an :class:`InputError` naming ``where`` when the prompt leaves no room).
    """
    import torch

    if max_new_tokens < 1 or n_candidates < 1 or chunk < 1:
        raise ValueError("max_new_tokens, n_candidates and chunk must be at least 1")
    t0 = time.perf_counter()
    model, tok = scoring_model.model, scoring_model.tokenizer
    if getattr(model.config, "_attn_implementation", None) != forward.ATTN_IMPLEMENTATION:
        forward.install(model)
    n = n_candidates if detector is not None else 1
    chunk = chunk if detector is not None else max_new_tokens  # unguided: one uninterrupted run
    request = detector.request() if detector is not None else None
    prompt_ids = prompt_token_ids(tok, prompt, input_mode)
    n_header = answer_header_length(tok, prompt, input_mode, prompt_ids)
    if len(prompt_ids) < 2:
        raise InputError("the prompt is too short to answer (it needs at least two tokens)", where)
    if max_tokens is not None and len(prompt_ids) + max_new_tokens > max_tokens:
        raise InputError(f"the prompt has {len(prompt_ids)} tokens: with {max_new_tokens} new tokens it passes the cap "
                         f"of {max_tokens} (raise --max-tokens or shorten the prompt)", where)
    cached = len(prompt_ids) - 1  # the last prompt token is run with the response, where signals begin
    gen = torch.Generator().manual_seed(seed)
    response: list[int] = []
    scores: list[float] = []
    started = ended = False
    with torch.inference_mode():
        device = scoring_model.device
        cache = model(input_ids=torch.tensor([prompt_ids[:-1]], device=device), use_cache=True,
                      logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(n)
        while len(response) < max_new_tokens:
            step_ids = torch.tensor([[prompt_ids[-1], *response]] * n, device=device)
            logits = model(input_ids=step_ids, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1].float()
            drawn = draw_tokens(model, tok, cache, logits, min(chunk, max_new_tokens - len(response)), input_mode,
                                gen, temperature, top_p, started=[started] * n, greedy=detector is None and not sample)
            forward.crop_cache(cache, cached)
            best = 0
            if detector is not None:
                views = [_view(prompt_ids, response + toks, input_mode, n_header) for toks in drawn["tokens"]]
                # a detector that reads the rows of every token (toha-mst) needs the whole input in the pass
                past = None if request.attention_from == "all" else (cache, cached)
                signals = forward.run(scoring_model, views, request, past=past)
                raw = np.asarray(detector.continuation_scores(signals, len(response)), dtype=float)
                best = int(np.argmin(raw))
                scores.append(float(raw[best]))
            response += drawn["tokens"][best]
            started = bool(drawn["started"][best])
            if drawn["done"][best]:
                ended = True
                break
    return Generation(text=answer_text(tok, response, input_mode), token_ids=response, ended=ended,
                      chunk_scores=scores, seconds=time.perf_counter() - t0)
