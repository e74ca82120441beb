"""Chat completions from a local model, as an OpenAI-compatible server answers them: the chat template, ``n``
choices sampled from one prompt pass, temperature (0 = greedy), nucleus sampling, a seed, stop strings, token
log-probabilities, the text of every choice as it is produced, and cancellation between tokens.

``halwatch watch serve-llm`` (:mod:`halwatch.serve.llm`) and the in-process HalMit client
(:class:`halwatch.watchdog.clients.LocalClient`) both answer through :func:`complete_chat`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from halwatch.errors import InputError
from halwatch.models.sampling import draw_tokens


@dataclass
class TokenLogprob:
    """One generated token: its text, log-probability and the ``top`` alternatives ``[(text, logprob)]``."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ChatChoice:
    text: str
    token_ids: list[int]  # the answer's tokens (not the end token)
    finish_reason: str  # "stop": the model ended it or a stop string came; "length": the token cap
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per answer token
    n_tokens: int = 0  # generated tokens, the end token included (what usage counts)

    @property
    def logprob(self) -> float:
        """Sum of the answer tokens' log-probabilities (temperature 1)."""
        return float(sum(t.logprob for t in self.logprobs))


@dataclass
class ChatResult:
    prompt_tokens: int
    choices: list[ChatChoice]

    @property
    def completion_tokens(self) -> int:
        return sum(c.n_tokens for c in self.choices)


def message_text(content) -> str:
    """A message's content as text: a string, or a list of parts of which the ``text`` parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise InputError("message content must be a string or a list of text parts")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template, with the assistant's generation
    prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the model's tokenizer has no chat template: it cannot answer chat messages")
    chat = [{"role": m.get("role", "user"), "content": message_text(m.get("content", ""))} for m in messages]
    if not any(m["content"].strip() for m in chat):
        raise InputError("empty chat: give at least one message with text")
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class _Text:
    """The text of one choice as tokens arrive: stop strings cut it, and only text that can no longer turn into
    a stop string (nor be half a character) is released to the stream."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.stopped = "", 0, False

    def add(self, token_ids: list[int]) -> None:
        self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def release(self, final: bool = False) -> str:
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        while end > self.sent and not final and self.text[end - 1] == "\ufffd":
            end -= 1
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta


def complete_chat(scoring_model, messages: list[dict], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                  max_tokens: int = 64, stop=(), seed: int | None = None, top_logprobs: int = 0, on_text=None,
                  cancel=None) -> ChatResult:
    """Answer ``messages`` with ``n`` choices of at most ``max_tokens`` tokens.

    ``temperature`` 0 decodes greedily; otherwise tokens are sampled (nucleus ``top_p``) from one generator seeded
    with ``seed`` (a random one when ``None``). A choice ends at the model's end token, at the first of the
    ``stop`` strings (cut from its text) or at ``max_tokens``. ``on_text(index, delta)`` receives each choice's new
    text as it is produced; ``cancel`` (a ``threading.Event``) stops the generation between tokens. Every answer
    token comes with its log-probability and the ``top_logprobs`` most likely alternatives.
    """
    import torch

    model, tok = scoring_model.model, scoring_model.tokenizer
    stop = tuple(s for s in ([stop] if isinstance(stop, str) else stop or ()) if s)
    ids = chat_prompt_ids(tok, messages)
    limit = getattr(model.config, "max_position_embeddings", 8192)
    if len(ids) + max_tokens > limit:
        raise InputError(f"the chat has {len(ids)} tokens: with {max_tokens} new tokens it passes the model's "
                         f"{limit} positions")
    texts = [_Text(tok, stop) for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]

    def on_token(b: int, token_id: int) -> bool:
        tokens[b].append(token_id)
        texts[b].add(tokens[b])
        if on_text is not None:
            delta = texts[b].release()
            if delta:
                on_text(b, delta)
        return texts[b].stopped

    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=scoring_model.device), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        drawn = draw_tokens(model, tok, cache, out.logits[:, -1].float().repeat(n, 1), max_tokens, "chat",
                            torch.Generator().manual_seed(seed), max(temperature, 1e-6), top_p,
                            greedy=temperature <= 0, top_logprobs=max(int(top_logprobs), 1), on_token=on_token,
                            cancel=cancel)
    choices = []
    for b in range(n):
        if on_text is not None:
            rest = texts[b].release(final=True)
            if rest:
                on_text(b, rest)
        answer = drawn["tokens"][b]
        steps = drawn["top"][b][: len(answer)]  # the end token that finished the row has no text
        entries = [TokenLogprob(tok.decode([t]), lp, [(tok.decode([i]), v) for i, v in alts[: int(top_logprobs)]])
                   for t, (lp, alts) in zip(answer, steps)]
        ended_by_model = bool(drawn["done"][b]) and not texts[b].stopped
        choices.append(ChatChoice(text=texts[b].text, token_ids=answer,
                                  finish_reason="stop" if drawn["done"][b] else "length", logprobs=entries,
                                  n_tokens=len(answer) + int(ended_by_model)))
    return ChatResult(prompt_tokens=len(ids), choices=choices)
