"""What a detector asks of the one forward pass (:class:`SignalRequest`) and what it gets back (:class:`Signals`):
the contract between the scoring model's pass (:mod:`halwatch.models.forward`), the cache and the detectors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from halwatch.models.adapter import AdapterRequest
from halwatch.models.relevance import RELEVANCE_VERSION, RelevanceRequest
from halwatch.models.sampling import SAMPLING_VERSION, SamplingRequest
from halwatch.signals import reducers as reducer_lib
from halwatch.signals.reducers import REDUCERS


@dataclass(frozen=True)
class SignalRequest:
    """What a detector needs from the forward pass. Requests of several detectors merge into one pass.

    - ``token_stats``: log-probability and entropy of the next-token distribution at each response token.
    - ``hidden_layers``: indices into the hidden-state stack (0 = embeddings, i = output of layer i), response rows.
    - ``hidden_pool``: ``"none"`` (every response row) or ``"mean_last"`` (the mean over response tokens and the last
      response token: ``[layers, 2, d]``, small enough to cache for whole datasets).
    - ``token_hidden_layers``: layers whose hidden state of every response token is returned besides the (pooled)
      ``hidden_layers`` (``token_hidden [layers, R, d]``), for token-level classifiers.
    - ``heads``: ``(layer, head)`` pairs whose attention rows are captured.
    - ``attention_from``: ``"response"`` (rows of response tokens) or ``"all"`` (rows of every token).
    - ``keep_attention``: return the captured rows themselves (large); otherwise only reducer outputs.
    - ``reducers``: names in :data:`halwatch.signals.reducers.REDUCERS` applied to the captured rows of every
      requested head.
    - ``sampling``: extra answers sampled from the scoring model for the prompt
      (:class:`halwatch.models.sampling.SamplingRequest`), for the sampling baselines.
    - ``relevance``: relevance of the input tokens for the response tokens
      (:class:`halwatch.models.relevance.RelevanceRequest`, LRP4RAG); the pass then runs with gradients and the
      propagation rules, and feeds every other signal asked for from the same forward pass.
    - ``evidence_heads``: ``(layer, head)`` pairs whose attention rows of the response tokens, summed over these
      heads, are returned as ``Signals.evidence`` ``[R, n_prompt]`` (:mod:`halwatch.evidence`); they are captured
      (added to ``heads``) for it.
    - ``adapter``: the token log-odds of a fine-tuned adapter of the scoring model's upper layers
      (:class:`halwatch.models.adapter.AdapterRequest`), run on the pass's own states after it
      (``Signals.adapter`` ``[R]``).
    - ``support``: the lexical support of the response by the context (:mod:`halwatch.signals.support`), from the
      texts alone: no part of the pass, computed whenever signals are handed out and never cached.
    - ``extra``: a pass that a detector module defines itself (e.g.
      :class:`halwatch.detectors.polygraph.PolygraphRequest`, LM-Polygraph's estimators): a frozen, hashable object
      with ``key()`` (its part of the cache key, with its own version) and ``compute(scorer, views)`` (one dict of
      arrays per view, returned in ``Signals.extra`` and cached with the other signals).
    """

    token_stats: bool = False
    hidden_layers: tuple[int, ...] = ()
    hidden_pool: str = "none"
    token_hidden_layers: tuple[int, ...] = ()
    heads: tuple[tuple[int, int], ...] = ()
    attention_from: str = "response"
    keep_attention: bool = False
    reducers: tuple[str, ...] = ()
    sampling: SamplingRequest | None = None
    relevance: RelevanceRequest | None = None
    extra: Any = None
    support: bool = False
    evidence_heads: tuple[tuple[int, int], ...] = ()
    adapter: AdapterRequest | None = None

    def __post_init__(self):
        evidence = tuple(sorted({(int(layer), int(h)) for layer, h in self.evidence_heads}))
        object.__setattr__(self, "evidence_heads", evidence)
        object.__setattr__(self, "heads", (*self.heads, *evidence))
        object.__setattr__(self, "hidden_layers", tuple(sorted(set(self.hidden_layers))))
        object.__setattr__(self, "token_hidden_layers", tuple(sorted(set(self.token_hidden_layers))))
        object.__setattr__(self, "heads", tuple(sorted({(int(layer), int(h)) for layer, h in self.heads})))
        object.__setattr__(self, "reducers", tuple(sorted(set(self.reducers))))
        if self.hidden_pool not in ("none", "mean_last"):
            raise ValueError(f"hidden_pool must be 'none' or 'mean_last', not {self.hidden_pool!r}")
        if self.attention_from not in ("response", "all"):
            raise ValueError(f"attention_from must be 'response' or 'all', not {self.attention_from!r}")
        unknown = [r for r in self.reducers if r not in REDUCERS]
        if unknown:
            raise ValueError(f"unknown attention reducer(s) {unknown}: known are {sorted(REDUCERS)}")
        if self.attention_from != "all" and any(REDUCERS[r].needs_all_rows for r in self.reducers):
            raise ValueError("the 'mst' reducer needs the attention rows of every token (attention_from='all')")

    def merge(self, *others: "SignalRequest") -> "SignalRequest":
        reqs = (self, *others)
        return SignalRequest(
            token_stats=any(r.token_stats for r in reqs),
            hidden_layers=tuple(x for r in reqs for x in r.hidden_layers),
            hidden_pool="mean_last" if all(r.hidden_pool == "mean_last" for r in reqs if r.hidden_layers) and any(
                r.hidden_layers for r in reqs) else "none",
            token_hidden_layers=tuple(x for r in reqs for x in r.token_hidden_layers),
            heads=tuple(x for r in reqs for x in r.heads),
            attention_from="all" if any(r.attention_from == "all" for r in reqs) else "response",
            keep_attention=any(r.keep_attention for r in reqs),
            reducers=tuple(x for r in reqs for x in r.reducers),
            sampling=_one(reqs, "sampling"),
            relevance=_one(reqs, "relevance"),
            extra=_one(reqs, "extra"),
            support=any(r.support for r in reqs),
            evidence_heads=_one_heads(reqs),
            adapter=_one(reqs, "adapter"),
        )

    def covers(self, other: "SignalRequest") -> bool:
        """True when the signals of this request contain everything ``other`` asks for (never where the two ask
        for different settings of one thing, e.g. two adapters)."""
        try:
            return self.merge(other) == self
        except ValueError:
            return False

    def key(self) -> dict:
        """What identifies this request's signals in the cache: every field (the optional ones only when set) and
        the version of each reducer, so that a changed signal definition never reuses old values."""
        optional = ("sampling", "relevance", "token_hidden_layers", "evidence_heads")
        key = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in (*optional, "extra", "support", "adapter")}
        for name in optional:
            if getattr(self, name):
                value = getattr(self, name)
                key[name] = asdict(value) if name in ("sampling", "relevance") else value
        key["reducer_versions"] = reducer_lib.versions(self.reducers)
        if self.sampling is not None:
            key["sampling_version"] = SAMPLING_VERSION
        if self.relevance is not None:
            key["relevance_version"] = RELEVANCE_VERSION
        if self.extra is not None:
            key["extra"] = self.extra.key()
        if self.adapter is not None:
            key["adapter"] = self.adapter.key()
        return key

    def without_sampling(self) -> "SignalRequest":
        """The request of the forward pass alone: no sampled answers, no ``extra`` pass, no lexical support."""
        return replace(self, sampling=None, extra=None, support=False)


def _one_heads(reqs) -> tuple:
    """The one set of evidence heads that the requests ask for, if any."""
    asked = {r.evidence_heads for r in reqs if r.evidence_heads}
    if len(asked) > 1:
        raise ValueError("requests ask for different evidence heads")
    return asked.pop() if asked else ()


def _one(reqs, name: str):
    """The one setting of ``name`` (sampling, relevance) that the requests ask for, if any."""
    asked = {getattr(r, name) for r in reqs if getattr(r, name) is not None}
    if len(asked) > 1:
        raise ValueError(f"requests ask for different {name} settings: {sorted(map(str, asked))}")
    return asked.pop() if asked else None


@dataclass
class Signals:
    """The signals of one sample. Arrays are indexed by response token (``R = n_response``) and requested head.

    ``relevance`` (LRP4RAG, :mod:`halwatch.models.relevance`): ``mean`` [n_input], the relevance of every input token
    averaged over the explained logits of the response tokens (its prompt part is ``R^prompt``, eq. 5); ``response``
    [R], the mean relevance of the prompt tokens for each response token (``R^response``, eq. 6); ``logits`` [R], the
    explained logits; ``rows`` [k, n_prompt], ``R*`` resampled to ``k`` response rows (or all of them) when asked.
    """

    n_prompt: int
    n_response: int
    heads: tuple[tuple[int, int], ...] = ()
    hidden_layers: tuple[int, ...] = ()
    token_hidden_layers: tuple[int, ...] = ()
    logprobs: np.ndarray | None = None  # [R] log p(token_t | prefix)
    entropy: np.ndarray | None = None  # [R] entropy of the predictive distribution at token t
    hidden: np.ndarray | None = None  # [len(hidden_layers), R, d], or [len(hidden_layers), 2, d] pooled
    token_hidden: np.ndarray | None = None  # [len(token_hidden_layers), R, d], float16
    attention: np.ndarray | None = None  # [H, Q, n] rows of the response tokens (every token: attention_from="all")
    reduced: dict[str, np.ndarray] = field(default_factory=dict)  # "reducer.field" -> [H, ...]
    generations: dict[str, np.ndarray] | None = None  # sampled answers, see halwatch.models.sampling
    relevance: dict[str, np.ndarray] | None = None  # see the class docstring
    extra: dict[str, np.ndarray] | None = None  # the results of SignalRequest.extra
    evidence: np.ndarray | None = None  # [R, n_prompt] attention of the evidence heads, summed (float32)
    adapter: np.ndarray | None = None  # [R] the adapter's log-odds of each response token (float32)
    support: np.ndarray | None = None  # [R, k] lexical support flags per response token (never cached)
    support_answer: np.ndarray | None = None  # [m] lexical support features of the answer (never cached)
    task: str | None = None  # the answer's task (halwatch.sample.task_of), set by the scorer (never cached)

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {
            "n_prompt": np.array(self.n_prompt),
            "n_response": np.array(self.n_response),
            "heads": np.array(self.heads, dtype=np.int32).reshape(-1, 2),
            "hidden_layers": np.array(self.hidden_layers, dtype=np.int32),
            "token_hidden_layers": np.array(self.token_hidden_layers, dtype=np.int32),
        }
        for name in ("logprobs", "entropy", "hidden", "token_hidden", "attention", "evidence", "adapter"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update({f"reduced:{k}": v for k, v in self.reduced.items()})
        out.update({f"gen:{k}": v for k, v in (self.generations or {}).items()})
        out.update({f"rel:{k}": v for k, v in (self.relevance or {}).items()})
        out.update({f"extra:{k}": v for k, v in (self.extra or {}).items()})
        return out

    @classmethod
    def from_arrays(cls, arrays) -> "Signals":
        return cls(
            n_prompt=int(arrays["n_prompt"]),
            n_response=int(arrays["n_response"]),
            heads=tuple(tuple(int(x) for x in row) for row in arrays["heads"]),
            hidden_layers=tuple(int(x) for x in arrays["hidden_layers"]),
            token_hidden_layers=tuple(int(x) for x in arrays.get("token_hidden_layers", ())),
            **{name: arrays[name] if name in arrays else None
               for name in ("logprobs", "entropy", "hidden", "token_hidden", "attention", "evidence", "adapter")},
            reduced={k.split(":", 1)[1]: arrays[k] for k in arrays if k.startswith("reduced:")},
            generations={k.split(":", 1)[1]: arrays[k] for k in arrays if k.startswith("gen:")} or None,
            relevance={k.split(":", 1)[1]: arrays[k] for k in arrays if k.startswith("rel:")} or None,
            extra={k.split(":", 1)[1]: arrays[k] for k in arrays if k.startswith("extra:")} or None,
        )

    def head_values(self, name: str, heads) -> np.ndarray:
        """Reducer output ``name`` for the given heads, in their order."""
        if heads == self.heads:  # every captured head, in order (the white-box pass): a tuple compared in C
            return self.reduced[name]
        heads = tuple(tuple(h) for h in heads)
        if heads == self.heads:
            return self.reduced[name]
        index = {h: i for i, h in enumerate(self.heads)}
        return self.reduced[name][[index[h] for h in heads]]
