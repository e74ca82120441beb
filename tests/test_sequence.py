"""The fused detector's bidirectional GRU token model: its log-odds equal the GRU equations written out here in
NumPy (each direction read over the answer's own tokens only), an answer scores the same in a padded batch as
alone, and it learns which tokens are labelled."""

import numpy as np

from halwatch.detectors import sequence
from halwatch.detectors.classifiers import unpack


def _gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _gru_direction(x, w_ih, w_hh, b_ih, b_hh):
    """PyTorch's GRU cell (r, z, n gates in that order) over ``x`` ``[T, in]`` from a zero state."""
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    h = np.zeros(w_hh.shape[1])
    out = []
    for t in range(len(x)):
        gi, gh = w_ih @ x[t] + b_ih, w_hh @ h + b_hh
        n = len(h)
        r, z = sig(gi[:n] + gh[:n]), sig(gi[n:2 * n] + gh[n:2 * n])
        cand = np.tanh(gi[2 * n:] + r * gh[2 * n:])
        h = (1 - z) * cand + z * h
        out.append(h)
    return np.array(out)


def _reference(model, x):
    s = {k: unpack(v) for k, v in model["state"].items()}
    z = (x - unpack(model["mean"])) / unpack(model["std"])
    h = _gelu(z @ s["inp.weight"].T + s["inp.bias"])
    fwd = _gru_direction(h, s["rnn.weight_ih_l0"], s["rnn.weight_hh_l0"], s["rnn.bias_ih_l0"], s["rnn.bias_hh_l0"])
    bwd = _gru_direction(h[::-1], s["rnn.weight_ih_l0_reverse"], s["rnn.weight_hh_l0_reverse"],
                         s["rnn.bias_ih_l0_reverse"], s["rnn.bias_hh_l0_reverse"])[::-1]
    return np.concatenate([fwd, bwd], axis=1) @ s["out.weight"][0] + s["out.bias"][0]


def test_gru_token_model_matches_numpy_and_ignores_padding():
    """Scoring folds the standardisation into the input projection and packs unpadded rows; training standardises a
    padded batch. Both equal the NumPy equations, with one feature far from zero (mean / deviation about 1,000, as
    one of SmolLM2's hidden-state features is), where folding could lose digits."""
    import torch

    rng = np.random.default_rng(0)
    x = [rng.normal(size=(n, 6)).astype(np.float32) for n in (3, 11, 7, 1, 9)]
    for t in x:
        t[:, 5] = 1000.0 + t[:, 5]
    y = [(t[:, 0] + 0.5 * np.r_[0, t[:-1, 1]] > 0.3).astype(np.int8) for t in x]  # depends on the neighbour too
    model = sequence.fit(x * 20, y * 20, hidden=8, epochs=40)
    batched = sequence.logodds(model, x)
    net = sequence._loaded(model)[0]
    with torch.no_grad():
        padded = net(*sequence._batch(x, sequence._scale(unpack(model["mean"]), unpack(model["std"])),
                                      range(len(x)))).numpy()
    for k, (t, z) in enumerate(zip(x, batched)):
        np.testing.assert_allclose(z, _reference(model, t.astype(float)), atol=1e-4)
        np.testing.assert_allclose(z, padded[k, :len(t)], atol=1e-5)
        np.testing.assert_allclose(z, sequence.logodds(model, [t])[0], atol=1e-5)
    labels, scores = np.concatenate(y), np.concatenate(batched)
    assert scores[labels == 1].mean() > scores[labels == 0].mean() + 1.0


def test_input_moments_in_pieces_equal_those_of_all_rows_at_once():
    """The standardisation's mean and deviation, computed in pieces (never a float64 copy of every token's features),
    against NumPy's over all rows stacked; answers of 1 to 90 tokens, one longer than a piece."""
    rng = np.random.default_rng(0)
    x = [(rng.normal(size=(n, 7)) * [1, 10, 1e3, 0.01, 1, 1, 5] + [0, 5, -3e4, 1, 0, 0, 2]).astype(np.float32)
         for n in rng.integers(1, 30, size=40)] + [rng.normal(size=(90, 7)).astype(np.float32)]
    stacked = np.concatenate(x).astype(np.float64)
    for rows in (50, 1 << 14):
        mean, std = sequence.moments(x, rows=rows)
        np.testing.assert_allclose(mean, stacked.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(std, stacked.std(0), rtol=1e-10, atol=1e-12)
