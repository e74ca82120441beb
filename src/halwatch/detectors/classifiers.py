"""The classifiers of LRP4RAG section 3.4, fitted with scikit-learn or PyTorch and kept as plain arrays.

Each ``fit_*`` returns a JSON-ready dict (arrays packed as base64 float32), and :func:`predict` scores new features
from that dict alone, with the same code after fitting and after loading an artifact. Inputs are standardised with
the training data's mean and deviation; the hyper-parameters are fixed (section 4.2 where the paper gives them,
scikit-learn's defaults otherwise), so nothing is selected on test data.
"""

from __future__ import annotations

import base64

import numpy as np

from halwatch.detectors.logistic import sigmoid

CLASSIFIERS = ("svm", "mlp", "random_forest", "lstm")


def pack(array, dtype: str = "float32") -> dict:
    """``array`` as JSON: its shape and its values in ``dtype`` (float32, or float16 for large weights), base64."""
    array = np.ascontiguousarray(array, dtype=dtype)
    return {"shape": list(array.shape), dtype: base64.b64encode(array.tobytes()).decode("ascii")}


def unpack(packed: dict) -> np.ndarray:
    """:func:`pack`'s array back, as float64."""
    dtype = "float16" if "float16" in packed else "float32"
    return np.frombuffer(base64.b64decode(packed[dtype]), dtype=dtype).reshape(packed["shape"]).astype(float)


def _standardiser(x) -> tuple[np.ndarray, np.ndarray]:
    mean = x.reshape(-1, x.shape[-1]).mean(axis=0)
    std = x.reshape(-1, x.shape[-1]).std(axis=0)
    return mean, np.where(std > 1e-12, std, 1.0)


def fit(kind: str, x, labels, seed: int = 0, **lstm_settings) -> dict:
    """Fit classifier ``kind`` on features ``x`` (``[n, L]``, or ``[n, T, L]`` for the LSTM) and 0/1 labels."""
    x, labels = np.asarray(x, dtype=float), np.asarray(labels, dtype=int)
    mean, std = _standardiser(x)
    z = (x - mean) / std
    if kind == "lstm":
        model = _fit_lstm(z, labels, seed, **lstm_settings)
    elif kind == "svm":
        from sklearn.svm import SVC

        svc = SVC(kernel="rbf", gamma="scale").fit(z, labels)
        model = {"support": pack(svc.support_vectors_), "dual": pack(svc.dual_coef_[0]),
                 "intercept": float(svc.intercept_[0]), "gamma": float(svc._gamma)}
    elif kind == "mlp":
        from sklearn.neural_network import MLPClassifier

        mlp = MLPClassifier(hidden_layer_sizes=(100,), max_iter=1000, random_state=seed).fit(z, labels)
        model = {"weights": [pack(w) for w in mlp.coefs_], "biases": [pack(b) for b in mlp.intercepts_]}
    elif kind == "random_forest":
        from sklearn.ensemble import RandomForestClassifier

        forest = RandomForestClassifier(n_estimators=200, random_state=seed, n_jobs=1).fit(z, labels)
        model = {"trees": [_tree_arrays(t.tree_) for t in forest.estimators_]}
    else:
        raise ValueError(f"unknown classifier {kind!r}: choose one of {', '.join(CLASSIFIERS)}")
    return {"kind": kind, "mean": pack(mean), "std": pack(std), **model}


def predict(model: dict, x) -> np.ndarray:
    """Score of class 1 (hallucinated) for each row of ``x``: the SVM's decision value, else a probability."""
    z = (np.asarray(x, dtype=float) - unpack(model["mean"])) / unpack(model["std"])
    kind = model["kind"]
    if kind == "svm":
        support = unpack(model["support"])
        sq = (z ** 2).sum(1)[:, None] + (support ** 2).sum(1)[None, :] - 2 * z @ support.T
        return np.exp(-model["gamma"] * np.maximum(sq, 0)) @ unpack(model["dual"]) + model["intercept"]
    if kind == "mlp":
        h = z
        weights, biases = model["weights"], model["biases"]
        for i, (w, b) in enumerate(zip(weights, biases)):
            h = h @ unpack(w) + unpack(b)
            if i < len(weights) - 1:
                h = np.maximum(h, 0)
        return sigmoid(h[:, 0])
    if kind == "random_forest":
        return np.mean([_tree_predict(t, z) for t in model["trees"]], axis=0)
    if kind == "lstm":
        return _lstm_predict(model, z)
    raise ValueError(f"unknown classifier {kind!r}")


# ---- random forest -------------------------------------------------------------------------------------------------
def _tree_arrays(tree) -> dict:
    value = tree.value[:, 0, :]
    value = value / value.sum(axis=1, keepdims=True)
    return {"left": tree.children_left.tolist(), "right": tree.children_right.tolist(),
            "feature": tree.feature.tolist(), "threshold": pack(tree.threshold), "p1": pack(value[:, 1])}


def _tree_predict(tree: dict, z) -> np.ndarray:
    left, right = np.array(tree["left"]), np.array(tree["right"])
    feature, threshold = np.array(tree["feature"]), unpack(tree["threshold"])
    node = np.zeros(len(z), dtype=int)
    rows = np.arange(len(z))
    while True:
        inner = left[node] != -1
        if not inner.any():
            return unpack(tree["p1"])[node]
        go_left = z[rows, np.maximum(feature[node], 0)] <= threshold[node]
        node = np.where(inner, np.where(go_left, left[node], right[node]), node)


# ---- LSTM (eq. 10-12) ----------------------------------------------------------------------------------------------
def _lstm_module(n_in: int, hidden: int, layers: int):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(n_in, hidden, num_layers=layers, batch_first=True)
            self.head = torch.nn.Linear(hidden, 1)

        def forward(self, x):
            out, _ = self.lstm(x)
            return self.head(out[:, -1])[:, 0]

    return Net()


def _fit_lstm(z, labels, seed: int, hidden: int = 256, layers: int = 2, lr: float = 5e-4, epochs: int = 30,
              batch: int = 32) -> dict:
    """A ``layers``-layer LSTM over the response steps of ``R*`` with a linear head on its last state, trained with
    Adam at learning rate ``lr`` on the binary cross-entropy (section 3.4, settings of section 4.2)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = _lstm_module(z.shape[-1], hidden, layers)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    x = torch.tensor(z, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.float32)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch):
            idx = order[start : start + batch]
            opt.zero_grad()
            loss_fn(net(x[idx]), y[idx]).backward()
            opt.step()
    return {"hidden": hidden, "layers": layers, "n_in": int(z.shape[-1]),
            "state": {k: pack(v.detach().numpy()) for k, v in net.state_dict().items()}}


def _lstm_predict(model: dict, z) -> np.ndarray:
    import torch

    net = _lstm_module(model["n_in"], model["hidden"], model["layers"])
    net.load_state_dict({k: torch.tensor(unpack(v), dtype=torch.float32) for k, v in model["state"].items()})
    net.eval()
    with torch.no_grad():
        return torch.sigmoid(net(torch.tensor(z, dtype=torch.float32))).numpy().astype(float)
