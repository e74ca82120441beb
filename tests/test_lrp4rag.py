"""LRP4RAG: resampling (eq. 7-9; every length pair in test_relevance_resample.py), the propagation rules against
hand-computed LRP, Input x Gradient against autograd, batched seeds against one position at a time, conservation, the
detector's paper defaults (maximum logit, relevance normalised to (0, 1)) and the detector on real RAGTruth answers."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from halwatch.detectors import classifiers, create_detector, load_detector
from halwatch.models import relevance as lrp
from halwatch.models.forward import install, run
from halwatch.models.relevance import RelevanceRequest
from halwatch.models.signal_types import SignalRequest
from halwatch.sample import Sample
from halwatch.signals.relevance import resample, resample_2d, resample_matrix

SHORT = Sample(prompt="Context: The Eiffel Tower in Paris was finished in 1889 for the World's Fair.\n"
                      "Question: When was the Eiffel Tower finished?\nAnswer:",
               response=" It was finished in 1889, for the World's Fair in Paris.")


def test_resampling_by_hand_down_up_and_2d():
    # shrink 5 -> 2: rho = 2.5, ranges [0, 2) and [2, 5)
    assert resample([1, 2, 3, 4, 5], 2) == pytest.approx([1.5, 4.0])
    # shrink 6 -> 4: rho = 1.5, ranges [0, 1) [1, 3) [3, 4) [4, 6)
    assert resample([1, 2, 4, 8, 16, 32], 4) == pytest.approx([1, 3, 8, 24])
    # stretch 2 -> 5: empty ranges take the value at their start; never a zero
    assert resample([1, 3], 5) == pytest.approx([1, 1, 1, 3, 3])
    assert resample([7], 3) == pytest.approx([7, 7, 7])
    assert resample([4, -2, 9], 3) == pytest.approx([4, -2, 9])
    assert resample_2d([[1, 2], [3, 4]], 1, 4) == pytest.approx(np.array([[2, 2, 3, 3]]))
    assert resample_matrix(7, 3).sum(axis=1) == pytest.approx(np.ones(3))
    with pytest.raises(ValueError):
        resample([], 3)


class _RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _MLP(torch.nn.Module):
    def __init__(self, d, h, gen):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(a, b, bias=False, dtype=torch.float64)
                                                        for a, b in ((d, h), (d, h), (h, d)))
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=gen, dtype=torch.float64)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Tiny(torch.nn.Module):
    """x -> x + MLP(RMSNorm(x)) -> linear readout: a one-block, hand-checkable transformer feed-forward."""

    def __init__(self, d=4, h=6, out=3):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm, self.mlp = _RMSNorm(d), _MLP(d, h, gen)
        self.out = torch.nn.Linear(d, out, bias=False, dtype=torch.float64)
        self.out.weight.data = torch.randn((out, d), generator=gen, dtype=torch.float64)

    def forward(self, x):
        return self.out(x + self.mlp(self.norm(x)))


def _hand_lrp(net, x: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """LRP written out in relevance space (epsilon rule with epsilon 0 for linear maps and sums, the identity rule
    for RMSNorm and SiLU, the uniform rule for the gate x up product), explaining output ``k``."""
    w = lambda lin: lin.weight.detach().numpy()  # noqa: E731  [out, in]
    norm = x / np.sqrt((x ** 2).mean() + 1e-6) * net.norm.weight.detach().numpy()
    gate, up = w(net.mlp.gate_proj) @ norm, w(net.mlp.up_proj) @ norm
    act = gate / (1 + np.exp(-gate))
    prod = act * up
    mlp = w(net.mlp.down_proj) @ prod
    h = x + mlp
    z = w(net.out) @ h

    def linear(rel_out, weight, inp, out):  # R_i = sum_j x_i W_ji / z_j R_j
        return ((weight * inp[None, :]) / out[:, None] * rel_out[:, None]).sum(0)

    rel_h = linear(np.eye(len(z))[k] * z[k], w(net.out), h, z)
    rel_x_skip, rel_mlp = x / h * rel_h, mlp / h * rel_h
    rel_prod = linear(rel_mlp, w(net.mlp.down_proj), prod, mlp)
    rel_act = rel_up = 0.5 * rel_prod
    rel_gate = rel_act  # identity rule through SiLU
    rel_norm = linear(rel_gate, w(net.mlp.gate_proj), norm, gate) + linear(rel_up, w(net.mlp.up_proj), norm, up)
    return rel_x_skip + rel_norm, z[k]  # identity rule through RMSNorm


def test_lrp_rules_match_hand_computed_relevance_and_conserve():
    net = _Tiny()
    x = np.array([0.7, -1.2, 0.4, 2.0])
    for k in range(3):
        expected, logit = _hand_lrp(net, x, k)
        xt = torch.tensor(x, requires_grad=True)
        with lrp.rules(net, "lrp"):
            out = net(xt)[k]
        (grad,) = torch.autograd.grad(out, xt)
        got = (xt * grad).detach().numpy()
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert got.sum() == pytest.approx(logit, rel=1e-9)  # conservation
        # outside the block the network is itself again: its gradient times input is not conserved here
        (plain,) = torch.autograd.grad(net(xt)[k], xt)
        assert not np.allclose((xt * plain).detach().numpy(), expected)


def test_attention_rule_matches_hand_computed_attnlrp():
    """Uniform rule on A V and Q K^T, AttnLRP's softmax rule R_x = x (R_A - A sum R_A), causal mask."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn((1, 1, 4, 3), generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn((1, 4, 1, 3), generator=gen, dtype=torch.float64)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    with lrp.rules(torch.nn.Module(), "lrp"):
        out = lrp.attention(module, q, k, v, None, scaling=0.5)
    (out * g).sum().backward()
    got = {n: (t * t.grad)[0, 0].detach().numpy() for n, t in (("q", q), ("k", k), ("v", v))}

    Q, K, V, G = q[0, 0].detach().numpy(), k[0, 0].detach().numpy(), v[0, 0].detach().numpy(), g[0, :, 0].numpy()
    x = 0.5 * Q @ K.T
    mask = np.tril(np.ones((4, 4), dtype=bool))
    A = np.where(mask, np.exp(np.where(mask, x, -np.inf) - x.max(1, keepdims=True)), 0)
    A /= A.sum(1, keepdims=True)
    out_ref = A @ V
    R_out = out_ref * G
    terms = A[:, :, None] * V[None, :, :]  # [i, j, p] = A_ij V_jp
    share = terms / out_ref[:, None, :] * R_out[:, None, :]
    R_A, R_V = 0.5 * share.sum(2), 0.5 * share.sum(0)
    R_x = np.where(mask, x * (R_A - A * R_A.sum(1, keepdims=True)), 0)
    qk = 0.5 * Q[:, None, :] * K[None, :, :]  # [i, j, d]
    share = np.where(mask[:, :, None], qk / np.where(mask, x, 1)[:, :, None] * R_x[:, :, None], 0)
    assert got["v"] == pytest.approx(R_V, rel=1e-8)
    assert got["q"] == pytest.approx(0.5 * share.sum(1), rel=1e-8)
    assert got["k"] == pytest.approx(0.5 * share.sum(0), rel=1e-8)


def _matrix(smol, view, method):
    """The full relevance signals (one seed per response token) of one view."""
    return run(smol, [view], SignalRequest(relevance=RelevanceRequest(method=method, rows=-1)))[0]


def test_input_x_gradient_equals_autograd(smol, scorer):
    view = scorer.encode(SHORT)
    sig = _matrix(smol, view, "ixg")
    model = smol.model
    install(model)
    ids = torch.tensor([view.input_ids])
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.enable_grad():
        logits = model(inputs_embeds=embeds).logits[0]
        rows = []
        for j, token in enumerate(view.input_ids[view.n_prompt :]):
            (grad,) = torch.autograd.grad(logits[view.n_prompt - 1 + j, token], embeds, retain_graph=True)
            rows.append((grad * embeds)[0].sum(-1).detach().numpy())
    expected = np.array(rows)
    assert sig.relevance["rows"] == pytest.approx(expected[:, : view.n_prompt], rel=1e-3, abs=1e-4)
    assert sig.relevance["mean"] == pytest.approx(expected.mean(0), rel=1e-3, abs=1e-4)
    assert sig.relevance["response"] == pytest.approx(expected[:, : view.n_prompt].mean(1), rel=1e-3, abs=1e-4)


def test_batched_seeds_equal_one_position_at_a_time_and_marginals_agree(smol, scorer):
    view = scorer.encode(SHORT)
    model = smol.model
    install(model)
    ids = torch.tensor([view.input_ids])

    def seeds_run(batched):
        with torch.enable_grad(), lrp.rules(model, "lrp"):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            values, _ = lrp.targets(model(inputs_embeds=embeds).logits, [view], 0, "token")
            return lrp.backward_relevance(embeds, values, [view], rows=-1, batched=batched)[0]

    batched, single = seeds_run(True), seeds_run(False)
    assert batched == pytest.approx(single, rel=1e-4, abs=1e-5)
    full = single[1:]  # [R, n_input], one row per response token
    assert single[0] == pytest.approx(full.mean(0), rel=1e-4, abs=1e-5)  # the mean seed is R* averaged (eq. 5)

    sig = _matrix(smol, view, "lrp")
    assert sig.relevance["rows"] == pytest.approx(full[:, : view.n_prompt], rel=1e-4, abs=1e-5)
    # the forward-mode row sums give R^response (eq. 6) without the matrix
    assert sig.relevance["response"] == pytest.approx(full[:, : view.n_prompt].mean(1), rel=1e-3, abs=1e-4)
    # resampled rows are the resampling matrix applied to R* (each row one seed)
    four = run(smol, [view], SignalRequest(relevance=RelevanceRequest(rows=4)))[0].relevance["rows"]
    assert four == pytest.approx(resample_matrix(view.n_response, 4) @ full[:, : view.n_prompt], rel=1e-3,
                                 abs=1e-4)


def test_conservation_cp_exact_attnlrp_leaks_ixg_worst(smol, scorer):
    view = scorer.encode(SHORT)
    errors = {}
    for method in ("lrp-cp", "lrp", "ixg"):
        r = run(smol, [view], SignalRequest(relevance=RelevanceRequest(method=method)))[0].relevance
        errors[method] = abs(r["mean"].sum() - r["logits"].mean()) / abs(r["logits"].mean())
    print("relative conservation error", errors)
    assert errors["lrp-cp"] < 1e-4
    assert errors["lrp-cp"] < errors["lrp"] < errors["ixg"]


def test_relevance_shares_the_pass_with_other_signals(smol, scorer):
    view = scorer.encode(SHORT)
    plain = run(smol, [view], SignalRequest(token_stats=True, heads=((3, 1),), reducers=("lookback",)))[0]
    both = run(smol, [view], SignalRequest(token_stats=True, heads=((3, 1),), reducers=("lookback",),
                                           relevance=RelevanceRequest()))[0]
    assert both.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert both.reduced["lookback.ratio"] == pytest.approx(plain.reduced["lookback.ratio"], abs=1e-5)
    assert both.relevance["logits"].shape == (view.n_response,)


def test_lrp4rag_classifiers_fit_score_spans_and_reload(spans_of, scorer, short_answers, tmp_path):
    answers = short_answers[0]  # four hallucinated and four grounded SQuAD-built answers: relevance is dear
    for kind in ("svm", "mlp", "random_forest", "threshold"):
        det = create_detector("lrp4rag", scorer=scorer, classifier=kind, length=32).fit(answers)
        probs = det.score(answers)
        assert probs.shape == (8,) and np.all((probs > 0) & (probs < 1))
        assert det.identity["scoring_model"] == "smollm2-135m" and det.identity["dtype"] == "float32"
        if kind != "threshold" and det.calibrator.params["coef"] > 0:  # the classifier's own decision
            raw = det.raw_scores(scorer.signals(answers, det.request()))
            assert np.array_equal(probs >= det.threshold, raw >= (0.0 if kind == "svm" else 0.5))
        det.save(tmp_path / f"{kind}.json")
        again = load_detector(str(tmp_path / f"{kind}.json"), scorer=scorer)
        assert again.score(answers) == pytest.approx(probs)
    spans = spans_of(det, answers[0])
    assert all(0 <= s["start"] < s["end"] <= len(answers[0].response) for s in spans)
    assert json.loads((tmp_path / "svm.json").read_text())["settings"]["classifier"] == "svm"


def test_exported_classifiers_equal_scikit_learn():
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.neural_network import MLPClassifier
    from sklearn.svm import SVC

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 5))
    y = (x[:, 0] + 0.5 * rng.normal(size=60) > 0).astype(int)
    z = (x - x.mean(0)) / x.std(0)
    reference = {"svm": SVC(kernel="rbf", gamma="scale").fit(z, y).decision_function(z),
                 "mlp": MLPClassifier(hidden_layer_sizes=(100,), max_iter=1000, random_state=0).fit(z, y)
                 .predict_proba(z)[:, 1],
                 "random_forest": RandomForestClassifier(n_estimators=200, random_state=0).fit(z, y)
                 .predict_proba(z)[:, 1]}
    for kind, expected in reference.items():
        assert classifiers.predict(classifiers.fit(kind, x, y), x) == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError):
        classifiers.fit("knn", x, y)


def test_lstm_over_resampled_matrix(scorer, short_answers):
    few = short_answers[0][:2] + short_answers[0][4:6]
    det = create_detector("lrp4rag", scorer=scorer, classifier="lstm", rows=2, length=16, epochs=2)
    assert det.request().relevance.rows == 2
    det.fit(few)
    x = det.features(scorer.signals(few, det.request()))
    assert x.shape == (4, 2, 16)
    restored = load_detector_from(det)
    assert restored.score(few) == pytest.approx(det.score(few), abs=1e-6)


def load_detector_from(det):
    from halwatch.detectors import DETECTORS

    return DETECTORS[det.name].from_dict(json.loads(json.dumps(det.to_dict())), scorer=det.scorer)


def _fake_signals(n=12, seed=0):
    """Relevance signals of ``n`` made-up answers (half "hallucinated" with lower relevance), no model needed."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        n_prompt, n_response = int(rng.integers(20, 60)), int(rng.integers(5, 30))
        shift = 0.0 if k % 2 else 1.5
        out.append(types.SimpleNamespace(
            n_prompt=n_prompt, n_response=n_response,
            relevance={"mean": rng.normal(shift, 1, n_prompt + n_response) * 3,
                       "response": rng.normal(shift, 1, n_response) * 3,
                       "rows": rng.normal(shift, 1, (4, n_prompt)) * 3}))
    return out, np.array([k % 2 for k in range(n)])


def test_lrp4rag_follows_the_paper_by_default_max_logit_and_unit_normalisation():
    """Section 3.2 explains the maximum logit; sections 4.2 / 4.4 normalise relevance to (0, 1) with epsilon 1e-6,
    here per answer before resampling. ``target=token, normalize=none`` is the behaviour before."""
    det = create_detector("lrp4rag")
    assert det.settings["target"] == "max" and det.settings["normalize"] == "minmax"
    assert det.request().relevance.target == "max"
    signals, _ = _fake_signals()
    x = det.features(signals)
    assert x.shape == (12, 220) and np.all((x >= 0) & (x < 1))
    for sig, row in zip(signals, x):
        r = sig.relevance["response"]
        assert row == pytest.approx(resample((r - r.min()) / (r.max() - r.min() + 1e-6), 220), rel=1e-12)
        assert row.max() == pytest.approx(1.0, abs=1e-5)  # the largest value maps to 1 - eps / range
    old = create_detector("lrp4rag", target="token", normalize="none", features="both", length=50)
    assert old.request().relevance.target == "token"
    assert old.features(signals)[0] == pytest.approx(np.concatenate(
        [resample(signals[0].relevance["response"], 50), resample(signals[0].relevance["mean"][: signals[0].n_prompt],
                                                                   50)]), rel=1e-12)
    both = create_detector("lrp4rag", features="both", length=50).features(signals)
    assert both[:, :50].min() == 0 and both[:, 50:].min() == 0  # R^response and R^prompt normalised separately
    lstm = create_detector("lrp4rag", classifier="lstm", rows=4, length=10).features(signals)
    rows = signals[0].relevance["rows"]
    assert lstm[0] == pytest.approx(resample_2d((rows - rows.min()) / (rows.max() - rows.min() + 1e-6), 4, 10))
    threshold = create_detector("lrp4rag", classifier="threshold")
    assert np.all((threshold.raw_scores(signals) <= 0) & (threshold.raw_scores(signals) > -1))  # the (0, 1) scale
    with pytest.raises(ValueError):
        create_detector("lrp4rag", normalize="zscore")


def test_lrp4rag_artifact_without_normalize_loads_as_raw_relevance():
    """Artifacts saved before ``normalize`` existed were fitted on raw relevance: they load with ``normalize=none``
    and score as they did; a new artifact keeps its setting."""
    signals, labels = _fake_signals(16)
    raw = create_detector("lrp4rag", normalize="none", target="token", length=20).fit_signals(signals, labels)
    saved = json.loads(json.dumps(raw.to_dict()))
    del saved["settings"]["normalize"]
    old = load_detector_from_dict(saved)
    assert old.settings["normalize"] == "none"
    assert old.scores_and_ranking(signals)[0] == pytest.approx(raw.scores_and_ranking(signals)[0])
    new = create_detector("lrp4rag", length=20).fit_signals(signals, labels)
    again = load_detector_from_dict(json.loads(json.dumps(new.to_dict())))
    assert again.settings["normalize"] == "minmax" and again.settings["target"] == "max"
    assert again.scores_and_ranking(signals)[0] == pytest.approx(new.scores_and_ranking(signals)[0])


def load_detector_from_dict(d):
    from halwatch.detectors import DETECTORS

    return DETECTORS[d["detector"]].from_dict(d)


def test_lrp4rag_rejects_bad_settings(scorer):
    for bad in ({"classifier": "knn"}, {"features": "all"}, {"method": "gradcam"}, {"length": 0},
                {"normalize": "zscore"}):
        with pytest.raises(ValueError):
            create_detector("lrp4rag", scorer=scorer, **bad)
    with pytest.raises(ValueError):
        RelevanceRequest(rows=-2)


def test_relevance_in_a_padded_batch_equals_one_at_a_time(smol, scorer):
    other = Sample(prompt="Context: The moon is about 384,000 km from the Earth.\nQuestion: How far is the moon?\n"
                          "Answer:", response=" About 384,000 km.")
    views = [scorer.encode(SHORT), scorer.encode(other)]
    request = SignalRequest(relevance=RelevanceRequest(rows=2))
    together = run(smol, views, request)
    for view, sig in zip(views, together):
        alone = run(smol, [view], request)[0]
        for key, value in alone.relevance.items():
            assert sig.relevance[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
