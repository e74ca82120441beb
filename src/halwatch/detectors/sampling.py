"""Baselines that need extra answers sampled from the scoring model for the same prompt (TOHA Table 1 baselines):
LN-entropy, EigenScore, SelfCheckGPT (unigram and an entailment variant) and semantic entropy.

All take the number of samples ``n_samples`` (TOHA used 5, and 20 for some) and the sampling settings of
:class:`halwatch.models.sampling.SamplingRequest`. The samples are cached with the other signals, so a benchmark
rerun samples nothing twice.

The entailment judgements (SelfCheckGPT's NLI variant, semantic entropy's bidirectional entailment) need an NLI
model; no NLI model can be had from the package registries here, so the judge is a causal LM asked a yes/no
question (SelfCheckGPT's prompt variant, Manakul et al. 2023 section 5.5): the scoring model by default, or any
other model given as ``judge`` (a registry name, a local folder). A 135M-parameter judge is weak; give a larger one
when you have it.
"""

from __future__ import annotations

import re

import numpy as np

from halwatch.clustering import cluster_entropy, clusters, entailment_prompt
from halwatch.data.generate import words
from halwatch.detectors.base import Detector
from halwatch.models.sampling import SamplingRequest, yes_probability
from halwatch.models.signal_types import SignalRequest

_JUDGED: dict = {}  # (judge, precision, input mode, prompt) -> P(yes), kept for the life of the process


class _SamplingDetector(Detector):
    def __init__(self, scorer=None, calibration: str = "platt", n_samples: int = 5, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 0.95, sampling_seed: int = 0, **settings):
        super().__init__(scorer=scorer, calibration=calibration, n_samples=n_samples, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, sampling_seed=sampling_seed, **settings)

    def request(self):
        s = self.settings
        return SignalRequest(sampling=SamplingRequest(n=s["n_samples"], max_new_tokens=s["max_new_tokens"],
                                                      temperature=s["temperature"], top_p=s["top_p"],
                                                      seed=s["sampling_seed"]))


class LNEntropy(_SamplingDetector):
    """Length-normalised predictive entropy, Malinin & Gales 2021 (section 3, the Monte-Carlo estimate over sampled
    answers): ``-(1/K) sum_k (1/L_k) log p(s_k | x)``."""

    name = "ln-entropy"
    citation = "Malinin & Gales, ICLR 2021 (arXiv:2002.07650)"

    def raw_scores(self, signals):
        return np.array([-float(np.mean(s.generations["logprob"] / s.generations["length"])) for s in signals])


class EigenScore(_SamplingDetector):
    """EigenScore, Chen et al. 2024 ("INSIDE", section 3.1, eq. 4-6): the K sampled answers' sentence embeddings
    (the middle layer's hidden state of the last token) as columns of Z, centred over features
    (``Sigma = Z^T J_d Z``), and the score ``(1/K) log det(Sigma + alpha I_K)`` with alpha = 1e-3: semantically
    diverse samples span more volume."""

    name = "eigenscore"
    citation = "Chen et al., INSIDE, ICLR 2024 (arXiv:2402.03744)"

    def __init__(self, scorer=None, calibration: str = "platt", alpha: float = 1e-3, **settings):
        super().__init__(scorer=scorer, calibration=calibration, alpha=alpha, **settings)

    def raw_scores(self, signals):
        out = []
        for s in signals:
            z = s.generations["embedding"].astype(float).T  # [d, K]
            z = z - z.mean(axis=0, keepdims=True)  # J_d Z
            cov = z.T @ z
            eig = np.linalg.eigvalsh(cov + self.settings["alpha"] * np.eye(cov.shape[0]))
            out.append(float(np.mean(np.log(np.maximum(eig, 1e-12)))))
        return np.array(out)


def sentences(text: str) -> list[str]:
    """The response split into sentences (at ., ! or ? followed by space, and at line breaks)."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", str(text))
    return [p.strip() for p in parts if words(p)]


class SelfCheckNGram(_SamplingDetector):
    """SelfCheckGPT with an n-gram model, Manakul et al. 2023 (section 5.4): a unigram model with add-one smoothing
    is estimated on the K samples and the response; the score is the mean over the response's sentences of the mean
    negative log-probability of their words (``Avg(-log P)``)."""

    name = "selfcheck-ngram"
    citation = "Manakul et al., SelfCheckGPT, EMNLP 2023 (arXiv:2303.08896)"

    def raw_scores(self, signals):
        return np.array([selfcheck_unigram(str(s.generations["response"]), list(map(str, s.generations["texts"])))
                         for s in signals])


def selfcheck_unigram(response: str, samples) -> float:
    """SelfCheckGPT-unigram score of ``response`` against its sampled answers (``Avg(-log P)``, higher = less
    consistent with the samples)."""
    counts: dict[str, int] = {}
    for text in [*samples, response]:
        for w in words(text):
            counts[w] = counts.get(w, 0) + 1
    total, vocab = sum(counts.values()), len(counts)
    per_sentence = [np.mean([-np.log((counts[w] + 1) / (total + vocab)) for w in words(sent)])
                    for sent in sentences(response)]
    return float(np.mean(per_sentence)) if per_sentence else 0.0


class _Judged(_SamplingDetector):
    """A sampling detector that asks a yes/no judge (the scoring model unless ``judge`` names another model)."""

    def __init__(self, scorer=None, calibration: str = "platt", judge: str | None = None, **settings):
        super().__init__(scorer=scorer, calibration=calibration, judge=judge, **settings)
        self._judge = None  # the judge model, loaded on first use when it is not the scoring model

    def _ask(self, prompts: list[str]) -> np.ndarray:
        from halwatch.models.loader import load_model

        judge, scorer = self.settings["judge"], self.get_scorer()
        if judge and self._judge is None:  # on the scoring model's device, in its precision
            self._judge = load_model(judge, device=str(scorer.model.device), dtype=scorer.model.dtype)
        model = self._judge if judge else scorer.model
        mode = scorer.input_mode
        todo = sorted({p for p in prompts if (model.name, model.dtype, mode, p) not in _JUDGED})
        if todo:
            for p, v in zip(todo, yes_probability(model, todo, mode)):
                _JUDGED[(model.name, model.dtype, mode, p)] = float(v)
        return np.array([_JUDGED[(model.name, model.dtype, mode, p)] for p in prompts])


SUPPORT_PROMPT = ("Context: {context}\n\nSentence: {sentence}\n\nIs the sentence supported by the context above? "
                  "Answer Yes or No.\n\nAnswer:")


class SelfCheckEntailment(_Judged):
    """SelfCheckGPT, entailment variant (Manakul et al. 2023, sections 5.5 NLI and 5.5 Prompt): each response
    sentence is checked against each sample, ``P(not supported)`` from the judge's yes/no answer to the paper's
    prompt; the score is the mean over sentences of the mean over samples."""

    name = "selfcheck-entail"
    citation = "Manakul et al., SelfCheckGPT, EMNLP 2023 (arXiv:2303.08896)"

    def raw_scores(self, signals):
        jobs = []
        for i, s in enumerate(signals):
            for j, sent in enumerate(sentences(str(s.generations["response"]))):
                for sample in map(str, s.generations["texts"]):
                    jobs.append((i, j, SUPPORT_PROMPT.format(context=sample, sentence=sent)))
        p_yes = self._ask([p for _, _, p in jobs])
        per: dict = {}
        for (i, j, _), p in zip(jobs, p_yes):
            per.setdefault(i, {}).setdefault(j, []).append(1.0 - p)
        return np.array([float(np.mean([np.mean(v) for v in per[i].values()])) if i in per else 0.0
                         for i in range(len(signals))])


class SemanticEntropy(_Judged):
    """Semantic entropy, Kuhn et al. 2023 (section 3, Algorithm 1 and eq. 2-3): the samples are clustered by
    bidirectional entailment (each joins the first cluster whose representative it entails both ways, judge
    P(yes) >= ``entail_threshold``; :mod:`halwatch.clustering`, shared with HalMit's watchdog), each cluster's
    probability is the sum of its members' length-normalised sequence probabilities, and the score is the entropy
    over clusters."""

    name = "semantic-entropy"
    citation = "Kuhn et al., ICLR 2023 (arXiv:2302.09664)"

    def __init__(self, scorer=None, calibration: str = "platt", entail_threshold: float = 0.5, **settings):
        super().__init__(scorer=scorer, calibration=calibration, entail_threshold=entail_threshold, **settings)

    def _entails(self, pairs) -> dict:
        prompts = [entailment_prompt(a, b) for a, b in pairs]
        return dict(zip(pairs, self._ask(prompts) >= self.settings["entail_threshold"]))

    def raw_scores(self, signals):
        texts = [list(map(str, s.generations["texts"])) for s in signals]
        # every ordered pair once, judged in one batch
        entails = self._entails(sorted({(a, b) for t in texts for a in t for b in t if a != b}))
        out = []
        for s, t in zip(signals, texts):
            ids = clusters(len(t), lambda k, h: t[k] == t[h] or (entails[(t[h], t[k])] and entails[(t[k], t[h])]))
            out.append(cluster_entropy(ids, np.exp(s.generations["logprob"] / s.generations["length"])))
        return np.array(out)
