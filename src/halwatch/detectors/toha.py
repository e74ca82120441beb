"""TOHA (Bazarova et al.): hallucination score = mean MTop-Div_G(R, P) / |R| over a few "hallucination-aware"
attention heads (sections 3.4-3.5, Algorithm 1), with spans from the spanning forest."""

from __future__ import annotations

import numpy as np

from halwatch.detectors.base import Detector
from halwatch.detectors.heads import head_deltas, select_heads
from halwatch.models.signal_types import SignalRequest


class TOHA(Detector):
    """TOHA, Algorithm 1: heads ranked by Δ (eq. 3) on the probe set, ``N_opt <= n_max`` chosen by probe AUROC; the
    raw score of a response is the mean normalised divergence ``d`` (eq. 3) over the chosen heads.

    Token score (for spans): the weight of the spanning-forest edge by which the token attaches (its share of
    MTop-Div), averaged over the chosen heads.

    ``divergence="mst"`` is the ablation of section 4.4 (Table 4): the length of the minimum spanning tree of the
    complete attention graph (prompt-prompt distances kept), normalised by |R|, in place of MTop-Div; it needs the
    attention rows of every token and gives no spans.

    ``selection="signed"`` is a variant, not the paper's method: each head's ``d`` is z-scored on the probe and
    turned by the sign of its Δ, heads are ranked by |Δ| of the z-scores, so that heads whose divergence *falls* on
    hallucinated answers count too (Algorithm 1 ranks by Δ and so discards them); N_opt as in lines 6-16.
    """

    name = "toha"
    citation = "Bazarova et al., TOHA (shared/papers/toha.md), Algorithm 1"
    supervised = True

    def __init__(self, scorer=None, calibration: str = "platt", n_max: int = 10, divergence: str = "mtopdiv",
                 selection: str = "delta", **settings):
        if divergence not in ("mtopdiv", "mst"):
            raise ValueError(f"divergence must be 'mtopdiv' or 'mst', not {divergence!r}")
        if selection not in ("delta", "signed"):
            raise ValueError(f"selection must be 'delta' (Algorithm 1) or 'signed', not {selection!r}")
        super().__init__(scorer=scorer, calibration=calibration, n_max=n_max, divergence=divergence,
                         selection=selection, **settings)
        self.heads: list[tuple[int, int]] | None = None
        self.ranking: list[dict] = []
        self.scale: dict | None = None  # selection="signed": per chosen head, the probe mean, std and sign

    def _all_heads(self):
        return self.get_scorer().model.all_heads()

    def request(self) -> SignalRequest:
        return self._request(self.heads if self.heads is not None else self._all_heads())

    def fit_request(self) -> SignalRequest:
        """Head selection reads every head, also when a fitted detector is fitted again."""
        return self._request(self._all_heads())

    def _request(self, heads) -> SignalRequest:
        mst = self.settings["divergence"] == "mst"
        return SignalRequest(heads=tuple(map(tuple, heads)), reducers=(self.settings["divergence"],),
                             attention_from="all" if mst else "response")

    def per_head(self, signals, heads) -> np.ndarray:
        """``d`` of eq. (3) (or the MST ablation's) for every sample and the given heads: ``[N, len(heads)]``."""
        return np.stack([s.head_values(f"{self.settings['divergence']}.d", heads) for s in signals])

    def choose_heads(self, signals, labels) -> None:
        heads = self._all_heads()
        values = self.per_head(signals, heads)
        scale = None
        if self.settings.get("selection") == "signed":
            mean, std = values.mean(0), values.std(0) + 1e-8
            sign = np.sign(head_deltas(values, labels)) + (head_deltas(values, labels) == 0)
            scale = {"mean": mean, "std": std, "sign": sign}
            values = (values - mean) / std * sign
        order, deltas, n_opt = select_heads(values, labels, self.settings["n_max"])
        chosen = order[:n_opt]
        self.heads = [heads[i] for i in chosen]
        self.ranking = [{"head": list(heads[i]), "delta": round(float(deltas[i]), 6)} for i in order[:20]]
        self.scale = None if scale is None else {k: v[chosen].tolist() for k, v in scale.items()}

    def fit_method(self, signals, labels):
        self.choose_heads(signals, labels)

    def raw_scores(self, signals):
        values = self.per_head(signals, self.heads)
        if self.scale is not None:
            values = (values - np.array(self.scale["mean"])) / np.array(self.scale["std"]) * np.array(
                self.scale["sign"])
        return values.mean(axis=1)

    def token_scores(self, signals):
        if self.settings["divergence"] == "mst":
            return None
        sign = np.array(self.scale["sign"])[:, None] if self.scale is not None else 1.0
        return [(s.head_values("mtopdiv.token_weights", self.heads) * sign).mean(axis=0).astype(float)
                for s in signals]

    def state(self):
        return {"heads": [list(h) for h in self.heads], "ranking": self.ranking, "scale": self.scale}

    def set_state(self, state):
        self.heads = [tuple(h) for h in state["heads"]]
        self.ranking = state.get("ranking", [])
        self.scale = state.get("scale")


def copy_head_scores(scoring_model, n_sequences: int = 8, length: int = 48, seed: int = 0) -> np.ndarray:
    """Token-copying (induction) score of every head, ``[layers, heads]``, from the scoring model itself.

    Random token sequences are repeated twice (Elhage et al. 2021; the copying score used by TOHA section 4.4 after
    Feucht et al. 2025); a head's score is its mean attention, from each token of the second copy, on the token
    that followed the same token in the first copy. No labels are involved.
    """
    from halwatch.models import forward
    from halwatch.sample import Sample
    from halwatch.tokens import TokenView

    rng = np.random.default_rng(seed)
    vocab = scoring_model.tokenizer.vocab_size
    heads = scoring_model.all_heads()
    request = SignalRequest(heads=heads, attention_from="all", keep_attention=True)
    scores = np.zeros(len(heads))
    for _ in range(n_sequences):
        seq = rng.integers(1000, min(vocab, 30000), size=length).tolist()
        ids = seq + seq
        view = TokenView(sample=Sample(prompt="x", response="x"), input_ids=ids, n_prompt=1, offsets=[(0, 1)],
                         input_mode="raw")
        rows = forward.run(scoring_model, [view], request)[0].attention  # [H, 2L, 2L]
        queries = np.arange(length, 2 * length - 1)
        scores += rows[:, queries, queries - length + 1].mean(axis=1)
    return (scores / n_sequences).reshape(scoring_model.n_layers, scoring_model.n_heads)


_COPY_SCORES: dict = {}


class TOHACopyHeads(TOHA):
    """Zero-shot TOHA (section 4.4, Table 5, "TOHA_Copy Heads"): the mean divergence of the model's top-``n_copy``
    copying heads, chosen without labels; only the calibration and thresholds use the probe data."""

    name = "toha-copy"
    citation = "Bazarova et al., TOHA (shared/papers/toha.md), section 4.4, Table 5"
    supervised = False  # the heads are chosen without labels

    def __init__(self, scorer=None, calibration: str = "platt", n_copy: int = 4, **settings):
        super().__init__(scorer=scorer, calibration=calibration, n_copy=n_copy, **settings)

    def choose_heads(self, signals, labels) -> None:
        model = self.get_scorer().model
        key = (model.name, model.weights_hash, model.dtype)
        if key not in _COPY_SCORES:  # depends on the model (and its precision) only: computed once per process
            _COPY_SCORES[key] = copy_head_scores(model)
        scores = _COPY_SCORES[key]
        flat = np.argsort(-scores.ravel(), kind="stable")[: self.settings["n_copy"]]
        self.heads = [(int(i) // model.n_heads, int(i) % model.n_heads) for i in flat]
        self.ranking = [{"head": list(h), "copy_score": round(float(scores[h]), 6)} for h in self.heads]


class TOHAMST(TOHA):
    """The ablation of section 4.4 (Table 4) under its own name: TOHA with the MST length of the complete
    attention graph in place of MTop-Div."""

    name = "toha-mst"
    citation = "Bazarova et al., TOHA (shared/papers/toha.md), section 4.4, Table 4"

    def __init__(self, scorer=None, calibration: str = "platt", n_max: int = 10, **settings):
        settings.setdefault("divergence", "mst")
        super().__init__(scorer=scorer, calibration=calibration, n_max=n_max, **settings)
