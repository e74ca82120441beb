"""LM-Polygraph's white-box uncertainty estimators as halwatch detectors (``polygraph:NAME``).

LM-Polygraph (Fadeeva et al., "LM-Polygraph: Uncertainty Estimation for Language Models", EMNLP 2023 system
demonstrations, arXiv:2311.07383) splits uncertainty estimation into *stat calculators*, which run the model and
produce named statistics (``greedy_log_probs``, ``greedy_log_likelihoods``, ``attention_all`` ...), and
*estimators*, which turn the statistics into one uncertainty per answer (higher = less certain). Here the estimators
are LM-Polygraph's own classes, run unchanged; the statistics come from our calculator, :func:`teacher_forced_stats`.

Where this departs from LM-Polygraph: its ``GreedyProbsCalculator`` *generates* the answer (greedy decoding) and
records the statistics along the way; a hallucination detector scores a *given* answer (for RAGTruth, written by
Llama-2 or Mistral). :func:`teacher_forced_stats` therefore runs the scoring model once over ``prompt + response``
with teacher forcing (the scorer's input: its scoring model, input mode, prompt text and token cap, exactly the
tokens every other halwatch detector sees) and produces the same statistics, with the same keys, shapes and
conventions, as if the scoring model had generated those response tokens: ``greedy_tokens`` are the response tokens,
``greedy_log_probs[j]`` the log-softmax of the logits that predict token ``j``, ``attention_all[l*H + h, j, k]`` the
attention of the query that predicts token ``j`` on response token ``k < j``. On an answer the scoring model did
generate greedily, the token log-likelihoods, entropies, attention weights and every estimator agree with
LM-Polygraph's own generation path within 1e-5, the whole log-probability rows within a relative 1e-5 (float32
rounding of cached incremental decoding against one pass; ``tests/test_polygraph.py``). Differences that remain by
design: a given answer has no end-of-sequence token (LM-Polygraph's generated answers end with the EOS token when the
model stopped, and count it), and LM-Polygraph's generation suppresses EOS for the first two steps
(``min_new_tokens=2``, the EOS logit set to the row minimum), which shifts its ``greedy_log_probs`` there by the EOS
probability: negligible unless the model wanted to stop at once.

The pass runs with halwatch's SDPA attention (:mod:`halwatch.models.forward`) and recomputes, inside it, only the
attention rows that the estimators read: the rows of the response tokens of every head, and every row of the middle
layer (AttentionScore). ``attention_all`` (``layers x heads x R x R`` float32, 97 MB for SmolLM2 at R = 300) lives
only while one answer is processed; the cache keeps scalars.

Supported estimators (:data:`ESTIMATORS`), each a sequence-level score:

- ``MaximumSequenceProbability`` (minus the log-probability of the answer), ``Perplexity`` (minus its mean
  log-probability) and ``MeanTokenEntropy`` (mean predictive entropy): the information-based baselines of
  LM-Polygraph (Fadeeva et al. 2023; Fomicheva et al., TACL 2020).
- ``SelfCertainty``: minus the mean KL divergence from the uniform distribution (Kang et al. 2025,
  arXiv:2502.18581).
- ``FisherRao`` and ``RenyiNeg``: distance / Renyi divergence of each token's distribution to the uniform one
  (Darrin et al., "Rainproof", 2023, arXiv:2212.09171).
- ``BoostedProbSequence``: BoostedProb, the probability mass of the dominant tokens (EMNLP 2025,
  aclanthology.org/2025.emnlp-main.166).
- ``AttentionScore``: LLM-Check's attention score, the mean over heads of the summed log attention diagonal of the
  middle layer (Sriramanan et al., NeurIPS 2024).
- ``RAUQ``: recurrent attention-based uncertainty, the previous-token attention of the most attentive head of each
  middle layer mixed with token probabilities (Vazhentsev et al. 2025, arXiv:2505.20045), with LM-Polygraph's
  default ``alpha`` (0.2).
- ``CSL``: contextualized sequence likelihood, token log-probabilities weighted by the attention that an eliciting
  prompt ("does the answer correctly answer the question? ... Decision:") pays to each answer token (Lin, Trivedi
  and Sun, EMNLP 2024). It needs a second pass, over LM-Polygraph's eliciting prompt with the answer, which runs only
  when ``CSL`` is asked for.

Not offered (see :data:`NOT_OFFERED`): estimators that need a model or data downloaded from a hub (Focus: an IDF
table computed from a Hugging Face dataset and a spaCy model; ClaimConditionedProbability, TokenSAR and the
semantic ones: NLI or similarity models), sampled answers (halwatch has its own sampling baselines), a training set
of embeddings (Mahalanobis distance, RDE, PPL-MD), ensembles, or further text from the model (P(True), verbalised
confidence). PointwiseMutualInformation and its conditional variant need a pass over the answer alone, and
LM-Polygraph 0.7.0's ``GreedyLMProbsCalculator`` reads the log-probability of token ``t_j`` from the distribution at
``t_j``'s own position, i.e. ``log p(next = t_j | t_<=j)`` instead of ``log p(t_j | t_<j)``; they are left out
rather than reproduced with that shift.

One pass feeds every estimator: the first polygraph detector to score an answer computes the statistics once and
caches the score of *every* estimator of that pass (with the answer's token log-likelihoods) in the scorer's signal
cache (:class:`PolygraphRequest`, the ``extra`` pass of :class:`halwatch.models.forward.SignalRequest`), keyed like
every other signal (scoring model and weights, precision, input mode, token ids, prompt boundary, answer header) plus
:data:`ADAPTER_VERSION` and the installed LM-Polygraph version; every other ``polygraph:NAME`` detector, and every
rerun, reads that entry and imports nothing. CSL's eliciting pass is cached the same way beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np

from halwatch.detectors.base import Detector
from halwatch.errors import HalwatchError
from halwatch.models.signal_types import SignalRequest, Signals

log = logging.getLogger("halwatch")

#: Version of this adapter (the statistics and how the scores are computed from them): part of the cache key.
ADAPTER_VERSION = 1
#: The LM-Polygraph release this adapter was written and tested against.
TESTED_VERSION = "0.7.0"
INSTALL_HINT = "pip install -e .[polygraph]"

#: Supported estimator -> the pass group that feeds it: ``forward`` = the teacher-forced pass over the scorer's
#: input; ``eliciting`` = CSL's pass over LM-Polygraph's eliciting prompt (computed with ``forward``).
ESTIMATORS: dict[str, str] = {
    "MaximumSequenceProbability": "forward",
    "Perplexity": "forward",
    "MeanTokenEntropy": "forward",
    "SelfCertainty": "forward",
    "FisherRao": "forward",
    "RenyiNeg": "forward",
    "BoostedProbSequence": "forward",
    "AttentionScore": "forward",
    "RAUQ": "forward",
    "CSL": "eliciting",
}
GROUPS = ("forward", "eliciting")

#: LM-Polygraph estimators left out, with the reason.
NOT_OFFERED: dict[str, str] = {
    "Focus": "needs an IDF table computed from a downloaded Hugging Face dataset and a downloaded spaCy model",
    "ClaimConditionedProbability": "needs an NLI model (download)",
    "TokenSAR": "needs a sentence-similarity model (download)",
    "PointwiseMutualInformation": "needs an answer-only pass; LM-Polygraph 0.7.0 reads its log-likelihoods one "
                                  "position late",
    "MeanConditionalPointwiseMutualInformation": "as PointwiseMutualInformation",
    "SemanticEntropy": "needs sampled answers and an NLI model; see halwatch's semantic-entropy",
    "LexicalSimilarity": "needs sampled answers",
    "MahalanobisDistanceSeq": "needs training-set embeddings",
    "PTrue": "needs the model to judge its own answer in a further prompt",
}


_WARNED: set[str] = set()  # LM-Polygraph versions other than TESTED_VERSION already warned about


def installed_version() -> str:
    """The installed LM-Polygraph version (read from its metadata, without importing it), or a clear error."""
    from importlib import metadata

    try:
        version = metadata.version("lm-polygraph")
    except metadata.PackageNotFoundError:
        raise HalwatchError(f"the polygraph detectors need LM-Polygraph, which is not installed: {INSTALL_HINT} "
                            f"(lm-polygraph=={TESTED_VERSION})") from None
    if version != TESTED_VERSION and version not in _WARNED:
        _WARNED.add(version)
        log.warning("LM-Polygraph %s is installed; halwatch's adapter was written for %s", version, TESTED_VERSION)
    return version


def _polygraph():
    """LM-Polygraph's estimator classes and entropy calculator (imported on first use: the import takes seconds)."""
    try:
        from lm_polygraph import estimators
        from lm_polygraph.stat_calculators.entropy import EntropyCalculator
    except ImportError as exc:
        raise HalwatchError(f"the polygraph detectors need LM-Polygraph ({exc}): {INSTALL_HINT}") from exc
    return estimators, EntropyCalculator


def check_estimator(name: str) -> str:
    """``name`` if it is a supported estimator, else an error that lists the supported ones."""
    supported = f"supported are {', '.join(ESTIMATORS)}"
    if name in NOT_OFFERED:
        raise HalwatchError(f"LM-Polygraph estimator {name!r} is not offered here ({NOT_OFFERED[name]}): {supported}")
    if name not in ESTIMATORS:
        raise HalwatchError(f"unknown LM-Polygraph estimator {name!r}: {supported} (not offered: "
                            f"{', '.join(NOT_OFFERED)} and the other sampling-based ones)")
    return name


# ---- the teacher-forced stat calculator ----------------------------------------------------------------------------
class _AttentionRows:
    """Inside the forward pass, layer by layer, recomputes the softmax attention rows of the queries at
    ``rows[layer] = (start, end)`` over keys ``0 .. end - 1`` from the layer's query and key states (the capture
    hook of :mod:`halwatch.models.forward`, with the layer's own mask and scaling), and keeps ``keep(layer, probs)``
    of them (``probs [H, end - start, end]``, float32)."""

    def __init__(self, rows: dict[int, tuple[int, int]], keep):
        self.rows, self.keep, self.kept = rows, keep, {}

    def record(self, module, query, key, attention_mask, scaling, softcap=None):
        import torch

        from halwatch.models.masking import attention_probs

        layer = getattr(module, "layer_idx", None)
        if layer not in self.rows:
            return
        start, end = self.rows[layer]
        groups = query.shape[1] // key.shape[1]
        keys = key[0, :, :end].float().repeat_interleave(groups, dim=0)  # [H, end, d] (grouped-query heads)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query[0, :, start:end].float(), keys.transpose(-1, -2))
        mask = None if attention_mask is None else attention_mask[0, :, start:end, :end]
        self.kept[layer] = self.keep(layer, attention_probs(scores, scale, softcap, mask, start))


def _run(scoring_model, ids: list[int], recorder: _AttentionRows, logits_to_keep: int):
    """One teacher-forced pass over ``ids`` (no padding, no cache) with ``recorder`` capturing attention rows."""
    import torch

    from halwatch.models import forward
    from halwatch.models.capture import capturing

    model = scoring_model.model
    if getattr(model.config, "_attn_implementation", None) != forward.ATTN_IMPLEMENTATION:
        forward.install(model)
    device = getattr(model, "device", "cpu")
    # the capture hook that halwatch's attention function calls per layer
    with capturing(recorder), torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=device), logits_to_keep=logits_to_keep, use_cache=False)


def teacher_forced_stats(scoring_model, view, attention: bool = True) -> dict:
    """LM-Polygraph's statistics of the answer in ``view`` (a batch of one), from one teacher-forced pass over the
    scorer's input ``view.input_ids`` (prompt tokens, then the response tokens) instead of a generation.

    Keys, shapes and conventions as LM-Polygraph 0.7.0's ``GreedyProbsCalculator`` (each a list with one item):
    ``input_texts``, ``input_tokens`` (the prompt ids), ``greedy_tokens`` (the response ids), ``greedy_texts`` (their
    decoding), ``greedy_log_probs`` (``[R, V]`` float32 log-softmax of the logits that predict each response token),
    ``greedy_log_likelihoods`` (``R`` float32 log-probabilities of the response tokens), and with ``attention``:
    ``attention_all`` (``[layers * heads, R, R]``, row ``j`` = the attention of the query that predicts token ``j``
    on the response tokens before it, row 0 zero; float32 here, float64 in LM-Polygraph), and
    ``forwardpass_attention_weights`` (``AttentionForwardPassCalculator``'s full attention maps over prompt and
    response, ``[1, heads, T, T]`` here: only the layer ``attention_score_layer`` = layers // 2 that AttentionScore
    reads by default, since every layer would take ``layers * heads * T^2`` floats), plus ``model`` (a stand-in with
    the Hugging Face model as ``.model``, for the estimators that read its config) and ``tokenizer``. ``entropy`` is
    LM-Polygraph's ``EntropyCalculator`` on ``greedy_log_probs`` (:func:`polygraph_scores` adds it).
    """
    import torch

    tokenizer = scoring_model.tokenizer
    ids, n_prompt = list(view.input_ids), view.n_prompt
    n_total, n_resp = len(ids), len(ids) - view.n_prompt
    if n_resp < 1:
        raise HalwatchError("the response has no tokens: nothing to estimate")
    n_layers, n_heads = scoring_model.n_layers, scoring_model.n_heads
    middle = n_layers // 2
    rows: dict[int, tuple[int, int]] = {}
    if attention:  # the rows of the response tokens but the last (each predicts the next), all rows of the middle
        rows = {layer: (n_prompt, n_total - 1) for layer in range(n_layers)}
        rows[middle] = (0, n_total)

    def keep(layer, probs):
        return probs.cpu() if layer == middle else probs[:, :, n_prompt:].cpu()

    recorder = _AttentionRows(rows, keep)
    out = _run(scoring_model, ids, recorder, logits_to_keep=n_resp + 1)
    log_probs = torch.log_softmax(out.logits[0, :n_resp].float(), dim=-1).cpu().numpy()
    tokens = ids[n_prompt:]
    stats = {
        "input_texts": [view.prompt_text()],
        "input_tokens": [ids[:n_prompt]],
        "greedy_log_probs": [log_probs],
        "greedy_tokens": [tokens],
        "greedy_texts": [tokenizer.decode(tokens)],
        "greedy_log_likelihoods": [[log_probs[j, t] for j, t in enumerate(tokens)]],
        "model": SimpleNamespace(model=scoring_model.model),
        "tokenizer": tokenizer,
    }
    if attention:
        block = np.zeros((n_layers * n_heads, n_resp, n_resp), dtype=np.float32)
        for layer, probs in recorder.kept.items():
            part = probs[:, n_prompt : n_total - 1, n_prompt : n_total - 1] if layer == middle else probs
            block[layer * n_heads : (layer + 1) * n_heads, 1:, : n_resp - 1] = part.numpy()
        stats["attention_all"] = [block]
        stats["forwardpass_attention_weights"] = [recorder.kept[middle].numpy()[None]]
        stats["attention_score_layer"] = middle
    return stats


def eliciting_attention(scoring_model, view, template: str, suffix: str) -> np.ndarray:
    """CSL's statistic ``attention_weights_eliciting_prompt`` of one answer (``[layers * heads, R]``): the attention
    of the last token of LM-Polygraph's eliciting prompt (``template`` with the prompt text as ``q``, the response
    tokens, then ``suffix``) on each response token, every layer and head, as ``AttentionElicitingPromptCalculator``
    computes it; from one teacher-forced pass."""
    tokenizer = scoring_model.tokenizer
    head = list(tokenizer([template.format(q=view.prompt_text())])["input_ids"][0])
    tail = list(tokenizer([suffix], add_special_tokens=False)["input_ids"][0])
    response = list(view.input_ids[view.n_prompt :])
    ids = head + response + tail
    start, end = len(head), len(head) + len(response)
    last = (len(ids) - 1, len(ids))
    recorder = _AttentionRows({layer: last for layer in range(scoring_model.n_layers)},
                              lambda layer, probs: probs[:, 0, start:end].cpu())
    _run(scoring_model, ids, recorder, logits_to_keep=1)
    return np.concatenate([recorder.kept[layer].numpy() for layer in range(scoring_model.n_layers)])


def _estimator(estimators, name: str):
    """LM-Polygraph's estimator ``name`` with its default settings (AttentionScore reads layer 0 of our
    ``forwardpass_attention_weights``, which holds only its default layer, layers // 2)."""
    if name == "AttentionScore":
        return estimators.AttentionScore(layer=0)
    return getattr(estimators, name)()


def polygraph_scores(stats: dict, names=None) -> dict[str, float]:
    """Each named estimator (default: every ``forward`` one of :data:`ESTIMATORS`) run by LM-Polygraph on
    ``stats`` (of one answer; adds LM-Polygraph's ``entropy`` to ``stats`` when missing)."""
    estimators, entropy = _polygraph()
    if "entropy" not in stats and "greedy_log_probs" in stats:
        stats.update(entropy()(stats, stats.get("input_texts"), None))
    names = [n for n, group in ESTIMATORS.items() if group == "forward"] if names is None else names
    return {name: float(np.asarray(_estimator(estimators, name)(stats))[0]) for name in names}


def _eliciting_prompt() -> tuple[str, str]:
    """LM-Polygraph's CSL eliciting prompt and its suffix, read from its calculator."""
    _polygraph()
    from lm_polygraph.stat_calculators.attention_eliciting_prompt import AttentionElicitingPromptCalculator

    calc = AttentionElicitingPromptCalculator()
    return calc.prompt, calc.suffix_prompt


def _forward_group(scoring_model, view) -> dict[str, np.ndarray]:
    stats = teacher_forced_stats(scoring_model, view)
    values = {name: np.array(v) for name, v in polygraph_scores(stats).items()}
    values["greedy_log_likelihoods"] = np.asarray(stats["greedy_log_likelihoods"][0], dtype=np.float32)
    return values


def _eliciting_group(scoring_model, view, forward: dict) -> dict[str, np.ndarray]:
    weights = eliciting_attention(scoring_model, view, *_eliciting_prompt())
    stats = {"greedy_log_likelihoods": [forward["greedy_log_likelihoods"]],
             "attention_weights_eliciting_prompt": [weights]}
    return {"CSL": np.array(polygraph_scores(stats, ["CSL"])["CSL"])}


@dataclass(frozen=True)
class PolygraphRequest:
    """The ``extra`` pass of the polygraph detectors (:class:`halwatch.models.forward.SignalRequest`): the scores of
    every supported estimator of the ``groups`` asked for, computed once per answer. ``forward`` is always there;
    ``eliciting`` (CSL) adds a second pass. Each group is cached on its own as well, under the key of the request of
    that group alone, so that a CSL detector reuses the ``forward`` pass of the others and the reverse."""

    groups: tuple[str, ...] = ("forward",)
    lm_polygraph: str = ""  # the installed version, part of the key
    version: int = ADAPTER_VERSION

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(g for g in GROUPS if g in {"forward", *self.groups}))

    def key(self) -> dict:
        return {"polygraph": list(self.groups), "lm_polygraph": self.lm_polygraph, "adapter": self.version}

    def compute(self, scorer, views) -> list[dict[str, np.ndarray]]:
        return [self._one(scorer, view) for view in views]

    def _one(self, scorer, view) -> dict[str, np.ndarray]:
        values: dict[str, np.ndarray] = {}
        for group in self.groups:
            alone = SignalRequest(extra=replace(self, groups=(group,)))
            own = len(self.groups) > 1  # the scorer caches a one-group request itself
            hit = scorer.lookup(view, alone) if own else None
            if hit is not None and hit.extra:
                values.update(hit.extra)
                continue
            if group == "forward":
                found = _forward_group(scorer.model, view)
            else:
                found = _eliciting_group(scorer.model, view, values)
            values.update(found)
            if own:
                scorer.store(view, alone, Signals(n_prompt=view.n_prompt, n_response=view.n_response, extra=found))
        return values


class Polygraph(Detector):
    """One of LM-Polygraph's white-box estimators (setting ``estimator``, :data:`ESTIMATORS`; the spec
    ``polygraph:NAME`` names it) on a teacher-forced pass of the scoring model over the given answer (see the module
    docstring for the adapter and where it departs from LM-Polygraph). Unsupervised: the raw score is the
    estimator's uncertainty (higher = more likely hallucinated); calibration and threshold are fitted on the probe
    data as for every detector. No token scores."""

    name = "polygraph"
    citation = "Fadeeva et al., LM-Polygraph, EMNLP 2023 demo (arXiv:2311.07383)"
    #: ``polygraph:NAME`` sets this setting (:func:`halwatch.detectors.split_spec`).
    positional_setting = "estimator"

    def __init__(self, scorer=None, calibration: str = "platt", estimator: str = "MaximumSequenceProbability",
                 **settings):
        super().__init__(scorer=scorer, calibration=calibration, estimator=check_estimator(estimator), **settings)

    def request(self):
        group = ESTIMATORS[self.settings["estimator"]]
        return SignalRequest(extra=PolygraphRequest(groups=(group,), lm_polygraph=installed_version()))

    def raw_scores(self, signals):
        name = self.settings["estimator"]
        return np.array([float(s.extra[name]) for s in signals])
