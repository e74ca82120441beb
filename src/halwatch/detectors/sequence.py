"""The fused detector's token model: a small bidirectional GRU over an answer's token features.

Each response token's features (every head's lookback ratio, MTop-Div edge weight and log self-attention, the middle
layer's hidden state, surprisal, entropy, position and the lexical support flags: ``Fused.token_features``) are
standardised, projected to ``2 * hidden`` units, read in both directions by one GRU layer of ``hidden`` units, and
mapped to the log-odds that the token lies in a human-labelled hallucinated span. Reading the answer both ways is what
a per-token classifier cannot do: a word is judged with its neighbours (a made-up name is a phrase, and a supported
word inside a made-up clause is still part of it), so spans start and end at phrase boundaries without a hand-set
gap. Answers are packed by length, so a batch scores each answer exactly as it scores it alone.

Training: binary cross-entropy over the tokens of answers with token labels (:attr:`TokenView.has_token_labels`),
AdamW (learning rate 1e-3, weight decay 1e-2), dropout 0.2 on the inputs, mini-batches of 32 answers of similar
length, a fixed number of epochs chosen on the dev split, seeded. halwatch's own design (the issue's "sequence model
over the answer"), not a published method's; the weights ship in the artifact as float32 (about 0.4 MB for the
default model).
"""

from __future__ import annotations

import numpy as np

from halwatch.detectors.classifiers import pack, unpack
from halwatch.models.transfer import upload
from halwatch.tokens import runs_within

HIDDEN = 32
EPOCHS = 4
BATCH = 32


def _module(n_in: int, hidden: int):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.2)
            self.inp = torch.nn.Linear(n_in, 2 * hidden)
            self.rnn = torch.nn.GRU(2 * hidden, hidden, batch_first=True, bidirectional=True)
            self.out = torch.nn.Linear(2 * hidden, 1)

        def forward(self, x, lengths):
            h = torch.nn.functional.gelu(self.inp(self.drop(x)))
            packed = torch.nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
            h, _ = self.rnn(packed)
            h, _ = torch.nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
            return self.out(h)[..., 0]

    return Net()


def _scale(mean, std):
    """``[2, F]``: the inputs' mean and standard deviation, for :func:`_batch`."""
    import torch

    return torch.from_numpy(np.stack([mean, std]).astype(np.float32))


def _batch(x: list[np.ndarray], scale, rows):
    """``(inputs [B, T, F], lengths)`` of answers ``rows`` of ``x``, padded and standardised by ``scale``
    (:func:`_scale`; the padding is standardised too, and the network never reads it): training's layout, on the
    CPU. Scoring reads unpadded rows (:func:`logodds`)."""
    import torch

    lengths = [len(x[i]) for i in rows]
    out = np.zeros((len(rows), max(lengths), scale.shape[1]), dtype=np.float32)
    for k, i in enumerate(rows):
        out[k, :lengths[k]] = x[i]
    return (torch.from_numpy(out) - scale[0]) / scale[1], torch.tensor(lengths)


def moments(x: list[np.ndarray], rows: int = 1 << 14) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, standard deviation)`` of every column over the rows of all of ``x`` (arrays ``[R_i, F]``), in
    float64, in two passes over pieces of about ``rows`` rows: never a float64 copy of all of them (for 8,000
    answers of SmolLM2's 1,400 token features that copy alone was 9 GB, and ``halwatch fit`` ran out of memory)."""
    def pieces():
        for run in runs_within([len(t) for t in x], rows):
            yield np.concatenate(x[run.start:run.stop]).astype(np.float64)

    count = sum(len(t) for t in x)
    mean = sum(piece.sum(0) for piece in pieces()) / count
    var = sum(((piece - mean) ** 2).sum(0) for piece in pieces()) / count
    return mean, np.sqrt(var)


def fit(x: list[np.ndarray], y: list[np.ndarray], hidden: int = HIDDEN, epochs: int = EPOCHS, seed: int = 0) -> dict:
    """The token model on answers ``x`` (each ``[R, F]``) with token labels ``y`` (each ``[R]``, 0/1)."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    mean, std = moments(x)
    std = np.where(std > 1e-6, std, 1.0)
    mean, std = mean.astype(np.float32), std.astype(np.float32)
    net = _module(x[0].shape[1], hidden)
    scale = _scale(mean, std)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    order = np.argsort([len(t) for t in x], kind="stable")
    chunks = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    net.train()
    for _ in range(epochs):
        for k in rng.permutation(len(chunks)):
            rows = chunks[k]
            batch, lengths = _batch(x, scale, rows)
            target = torch.zeros(batch.shape[:2])
            mask = torch.zeros(batch.shape[:2])
            for j, i in enumerate(rows):
                target[j, :len(y[i])] = torch.from_numpy(np.asarray(y[i], dtype=np.float32))
                mask[j, :len(y[i])] = 1.0
            logits = net(batch, lengths)
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
                    * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"kind": "bigru", "hidden": hidden, "n_in": int(len(mean)), "mean": pack(mean), "std": pack(std),
            "state": {k: pack(v.detach().numpy()) for k, v in net.state_dict().items()}}


#: The networks of the token models in use, by the identity of their weights (the weights are held too, so that an
#: identity is never reused while its entry lives): built once, not at every call.
_NETS: dict[int, tuple] = {}


def _loaded(model: dict, device="cpu"):
    """``(network, mean, weight, bias)`` of a fitted token model, in evaluation mode, on ``device``: the network and
    its input projection of centred features (:func:`_folded`)."""
    import torch

    key = (id(model["state"]), str(device))
    entry = _NETS.get(key)
    if entry is None or entry[0] is not model["state"]:
        net = _module(model["n_in"], model["hidden"])
        net.load_state_dict({k: torch.tensor(unpack(v), dtype=torch.float32) for k, v in model["state"].items()})
        net.to(device).eval()
        folded = [t.to(device) for t in _folded(net, unpack(model["mean"]), unpack(model["std"]))]
        if len(_NETS) >= 8:
            _NETS.clear()
        entry = _NETS[key] = (model["state"], net, *folded)
    return entry[1:]


def _folded(net, mean, std):
    """``(mean, weight, bias)`` of the input projection of centred features: ``W (x - mean) / std + b = (W / std)
    (x - mean) + b``. Scoring then makes one centred copy of each answer's features, not a padded copy and a
    standardised one (on 209 RAGTruth answers those copies were 44 % of the token model's time on a CPU). The mean
    is subtracted rather than folded into the bias: one of SmolLM2's hidden-state features lies 969 deviations from
    zero, and folding it lost two digits of the log-odds."""
    import torch

    w = net.inp.weight.detach().cpu().double().numpy() / np.asarray(std, dtype=np.float64)
    return (torch.from_numpy(np.asarray(mean, dtype=np.float32)), torch.from_numpy(w.astype(np.float32)),
            net.inp.bias.detach().cpu().clone())


def logodds(model: dict, x: list[np.ndarray], device="cpu") -> list[np.ndarray]:
    """Per answer of ``x``, the log-odds of every token; the network runs on ``device`` (the scoring model's: on a
    GPU a batch of answers costs about one CPU answer). The answers' tokens are centred and projected as one unpadded
    block of rows (:func:`_folded`), and only the projection, 2 x ``hidden`` wide, is packed for the GRU: the same
    function as the network's ``forward`` on standardised, padded inputs, which training uses."""
    import torch
    from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

    net, mean, weight, bias = _loaded(model, device)
    device = weight.device
    out = []
    with torch.no_grad():
        for start in range(0, len(x), BATCH):
            part = x[start:start + BATCH]
            lengths = [len(t) for t in part]
            h = torch.nn.functional.gelu(torch.nn.functional.linear(upload(part, device) - mean, weight, bias))
            h, _ = net.rnn(pack_sequence(torch.split(h, lengths), enforce_sorted=False))
            h, _ = pad_packed_sequence(h, batch_first=True)
            z = net.out(h)[..., 0].cpu().numpy().astype(float)
            out += [z[k, :n] for k, n in enumerate(lengths)]
    return out
