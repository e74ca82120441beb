"""Extra generations of the scoring model, for the baselines that compare a response with sampled answers
(SelfCheckGPT, semantic entropy, EigenScore, LN-entropy), and yes/no judgements by the same model.

The prompt is run once; its key/value cache is repeated for the ``n`` samples, which are then drawn token by token
(temperature and nucleus sampling, a seeded generator). A sample ends at the end-of-sequence token, or, in ``raw``
mode where a base-style prompt has no end-of-turn token, at the first line break after some text (as the
same-model data generator keeps the first line); an answer cannot end before it has begun. For each sample we
keep its text, the sum of its token log-probabilities under the model (temperature 1, the quantity LN-entropy and
semantic entropy use), its length in tokens, and the middle layer's hidden state of its last token (the sentence
embedding of EigenScore, Chen et al. 2024, section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halwatch.tokens import TokenView, prompt_token_ids

#: Version of the sampling procedure, part of the signal-cache key of sampled answers (2: stop tokens are masked
#: before the nucleus is taken).
SAMPLING_VERSION = 2


@dataclass(frozen=True)
class SamplingRequest:
    """How many answers to sample and how: ``n`` samples of at most ``max_new_tokens`` tokens."""

    n: int = 5
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"sampling needs n >= 1 and max_new_tokens >= 1, got {self.n} and {self.max_new_tokens}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}")


def _end_ids(tokenizer) -> set[int]:
    """End-of-sequence and end-of-turn token ids."""
    ends = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    ends.discard(tokenizer.unk_token_id)
    return ends


def _newline_ids(tokenizer) -> set[int]:
    """Ids of the tokens whose text holds a line break (computed once per tokenizer)."""
    ids = getattr(tokenizer, "_halwatch_newline_ids", None)
    if ids is None:
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        ids = {i for i, t in enumerate(vocab) if t and "\n" in tokenizer.convert_tokens_to_string([t])}
        tokenizer._halwatch_newline_ids = ids
    return ids


def stop_ids(tokenizer, input_mode: str) -> tuple[set[int], set[int]]:
    """``(end, stop)``: the end-of-sequence/turn ids, and the ids that end an answer once it has begun (the ends,
    plus line breaks in ``raw`` mode)."""
    eos = _end_ids(tokenizer)
    return eos, (eos | _newline_ids(tokenizer) if input_mode == "raw" else eos)


def _draw_probs(logits, stop_mask, started, temperature: float, top_p: float):
    """The distribution tokens are drawn from [n, V]: stop tokens masked in the rows that have not ``started`` (an
    answer does not end before it has begun), then temperature, then the nucleus (the smallest set of most likely
    tokens holding ``top_p`` of the mass). Masking comes first, so the nucleus is taken over the allowed tokens and
    every row keeps some mass."""
    import torch

    if not started.all():
        rows = torch.from_numpy(~started).to(logits.device)
        logits = logits.masked_fill(rows[:, None] & stop_mask[None, :], float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return probs


def draw_tokens(model, tokenizer, cache, logits, steps: int, input_mode: str, gen, temperature: float = 1.0,
                top_p: float = 1.0, started=None, greedy: bool = False, on_step=None, top_logprobs: int = 0,
                on_token=None, cancel=None) -> dict:
    """Continue ``len(logits)`` sequences from a key/value ``cache`` (one row each) for at most ``steps`` tokens.

    ``logits`` [n, V]: the next-token logits after the cached tokens. Tokens are drawn by temperature and nucleus
    sampling with the generator ``gen`` (or argmax when ``greedy``). A sequence ends at an end token, or at a stop
    token (a line break in raw mode) once it has visible text (``started``, per row, carries over between calls);
    an answer cannot end before it has begun (in a row that has not started, the stop tokens are masked before the
    nucleus is taken, so it draws from the allowed tokens). Each drawn token that does not end its sequence is fed
    back through the model; ``on_step(out, fed_rows)`` sees each such forward output. ``on_token(row, token_id)``
    sees each token added to a row and ends the row when it returns true (a stop string); ``cancel`` (a
    ``threading.Event``) stops every row between tokens.

    Returns ``tokens`` (per row, the stop line break kept, the end token not), ``done`` [n], ``started`` [n] and
    ``logprob`` [n] (sum of token log-probabilities at temperature 1); with ``top_logprobs`` = k > 0 also ``top``:
    per row, per drawn token (the end token that finishes a row included), ``(log-probability, [(token id,
    log-probability)] of the k most likely at that step)``.
    """
    import torch

    n = logits.shape[0]
    eos, stop = stop_ids(tokenizer, input_mode)
    tokens: list[list[int]] = [[] for _ in range(n)]
    top: list[list] = [[] for _ in range(n)]
    logprob = np.zeros(n)
    done = np.zeros(n, dtype=bool)
    started = np.zeros(n, dtype=bool) if started is None else np.array(started, dtype=bool)
    stop_mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    stop_mask[sorted(stop)] = True
    for _ in range(steps):
        if cancel is not None and cancel.is_set():
            break
        logp = torch.log_softmax(logits, dim=-1)
        probs = _draw_probs(logits, stop_mask, started, temperature, top_p)
        # drawn on the CPU with the seeded CPU generator, so that a seed gives the same answers on every device
        nxt = probs.argmax(-1) if greedy else torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0].to(probs.device)
        fed = []
        best = logp.topk(top_logprobs, dim=-1) if top_logprobs else None
        for b in np.flatnonzero(~done):
            t = int(nxt[b])
            logprob[b] += float(logp[b, t])
            if best is not None:
                top[b].append((float(logp[b, t]), list(zip(best.indices[b].tolist(), best.values[b].tolist()))))
            if t in stop and (t in eos or started[b]):
                done[b] = True
                if t not in eos:
                    tokens[b].append(t)  # the line break ends the answer; callers cut its text
            else:
                started[b] = started[b] or bool(tokenizer.decode([t], skip_special_tokens=True).strip())
                tokens[b].append(t)
                if on_token is not None and on_token(int(b), t):
                    done[b] = True
                else:
                    fed.append(b)
        if done.all():
            break
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True,
                    output_hidden_states=on_step is not None)
        logits = out.logits[:, -1].float()
        if on_step is not None and fed:
            on_step(out, fed)
    out = {"tokens": tokens, "done": done, "started": started, "logprob": logprob}
    if top_logprobs:
        out["top"] = top
    return out


def answer_text(tokenizer, token_ids, input_mode: str) -> str:
    """The text of generated tokens: special tokens dropped, the first line only in ``raw`` mode."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return (text.strip().split("\n")[0] if input_mode == "raw" else text).strip()


def sample_answers(scoring_model, view: TokenView, request: SamplingRequest, input_mode: str) -> dict[str, np.ndarray]:
    """``request.n`` answers sampled from the scoring model for the prompt of ``view``.

    Returns ``texts`` [n], ``logprob`` [n] (sum of token log-probabilities), ``length`` [n] (tokens),
    ``embedding`` [n, d] (middle layer, last token) and ``response`` (the scored response, decoded).
    """
    import torch

    model, tok = scoring_model.model, scoring_model.tokenizer
    n, mid = request.n, scoring_model.n_layers // 2
    gen = torch.Generator().manual_seed(request.seed)
    with torch.inference_mode():
        prompt = torch.tensor([view.input_ids[: view.n_prompt]], device=scoring_model.device)
        out = model(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        embedding = out.hidden_states[mid][:, -1].float().repeat(n, 1)

        def keep_embedding(step_out, fed):
            embedding[fed] = step_out.hidden_states[mid][fed, -1].float()

        drawn = draw_tokens(model, tok, cache, out.logits[:, -1].float().repeat(n, 1), request.max_new_tokens,
                            input_mode, gen, request.temperature, request.top_p, on_step=keep_embedding)
    tokens = drawn["tokens"]
    response = tok.decode(view.input_ids[view.n_prompt:], skip_special_tokens=True)
    return {"texts": np.array([answer_text(tok, t, input_mode) for t in tokens], dtype=str),
            "logprob": drawn["logprob"].astype(np.float32),
            "length": np.array([max(1, len(t)) for t in tokens], dtype=np.int32),
            "embedding": embedding.cpu().numpy().astype(np.float32), "response": np.array(response, dtype=str)}


def _yes_no_ids(tokenizer) -> tuple[list[int], list[int]]:
    def first(words):
        return sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words})

    return first(["Yes", " Yes", "yes", " yes"]), first(["No", " No", "no", " no"])


def yes_probability(scoring_model, prompts: list[str], input_mode: str, batch_size: int = 8) -> np.ndarray:
    """P(yes) of the scoring model for each yes/no question: its next-token mass on "Yes" against "No" after the
    prompt (rendered by the input mode), left-padded batches."""
    import torch

    tok, model = scoring_model.tokenizer, scoring_model.model
    yes, no = _yes_no_ids(tok)
    encoded = [prompt_token_ids(tok, p, input_mode) for p in prompts]
    out = np.zeros(len(prompts))
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad = tok.pad_token_id or 0
    from halwatch.progress import progress

    for start in progress(range(0, len(order), batch_size), desc="judge", unit="batch", disable=len(order) < 256):
        batch = order[start:start + batch_size]
        longest = max(len(encoded[i]) for i in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, longest - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[row, longest - len(encoded[i]):] = 1
        with torch.inference_mode():
            ids, mask = ids.to(scoring_model.device), mask.to(scoring_model.device)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           logits_to_keep=1, use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        p_yes = torch.logsumexp(logp[:, yes], -1)
        p_no = torch.logsumexp(logp[:, no], -1)
        out[batch] = torch.sigmoid(p_yes - p_no).cpu().numpy()
    return out
