"""Reinforced fractal probabilities (HalMit section 3.1.2): rewards (eq. 2), transform probabilities (eq. 3), states
(eq. 4) and the policy network trained with the L2 loss of eq. 5-6.

Training data (the paper's quadruples ``{P_j, {a_j}_K, H_{j-1}, p_j}``): when a hallucinated query is expanded, the
policy draws the transforms of its children (section 3.1's fan-out); once they are answered, their rewards ``R_j``
(eq. 2) give the target ``p_j = R_j / sum_k R_k`` (eq. 3) over the transforms drawn, and the state is the expanded
query's: its embedding, the mean embedding of its K answers, its semantic entropy and the eq. 4 state ``s``. The
network (an MLP) maps that state to non-negative action values ``Q(s, f)`` whose eq. 3 normalisation is the
transform distribution; :meth:`Policy.fit` minimises ``sum_i ||p_i - p(s_i)||^2`` (eq. 5, the observed sibling
distribution standing for ``Q*``) over the transforms drawn at each expansion (eq. 6), with Adam at the paper's
settings (learning rate 1e-4, mini-batches of 64, 300 epochs).

Where the equations leave a choice, ours:

- eq. 2, a hallucinated answer among the K: the reward is ``|1 / R_{i-1}|`` as printed, capped at ``REWARD_CAP``
  (10) because ``R_{i-1}`` may be 0 or tiny; a path's first step takes ``R_0 = 1``;
- eq. 3 needs non-negative rewards, and eq. 2 gives a negative one when the entropy falls: rewards (and action
  values) are clipped at ``FLOOR`` (0.01) before they are normalised, so no transform's probability is 0; several
  children with one transform count with their mean reward;
- eq. 4, ``Delta Sim(P_0, P_i)`` is read as the semantic distance ``1 - cos(P_0, P_i)`` of the query from the
  path's initial query, and ``omega`` = 0.1; the network sees ``log(1 + s)``.

The random baseline of Figure 6 (``RandomPolicy``) draws the probabilities from a flat Dirichlet at every step.
"""

from __future__ import annotations

import math

import numpy as np

TRANSFORMS = ("deduction", "analogy", "induction")  # FT1, FT2, FT3
REWARD_CAP = 10.0
FLOOR = 0.01


def reward(all_grounded: bool, entropy_before: float, entropy: float, reward_before: float = 1.0) -> float:
    """Eq. 2: ``Delta H`` when none of the K answers is hallucinated, else ``|1 / R_{i-1}|`` (capped)."""
    if all_grounded:
        return float(entropy - entropy_before)
    return REWARD_CAP if abs(reward_before) < 1.0 / REWARD_CAP else min(REWARD_CAP, abs(1.0 / reward_before))


def probabilities(rewards) -> np.ndarray:
    """Eq. 3: ``p_j = R_j / sum_k R_k`` (rewards clipped at ``FLOOR``)."""
    r = np.maximum(np.asarray(rewards, dtype=float), FLOOR)
    return r / r.sum()


def state(similarity: float, entropy: float, omega: float = 0.1) -> int:
    """Eq. 4: ``floor((1 - cos(P_0, P_i)) * e^H_i / omega)``."""
    return int(math.floor(max(0.0, 1.0 - similarity) * math.exp(entropy) / omega))


def features(query_vector, answer_vectors, entropy: float, s: int) -> np.ndarray:
    """The policy's state of a query: its unit embedding, the normalised mean embedding of its answers, its semantic
    entropy and ``log(1 + s)`` (eq. 4)."""
    q = np.asarray(query_vector, dtype=np.float32)
    a = np.asarray(answer_vectors, dtype=np.float32).reshape(-1, len(q))
    mean = a.mean(0) if len(a) else np.zeros_like(q)
    norm = np.linalg.norm(mean)
    mean = mean / norm if norm > 0 else mean
    h = 0.0 if entropy is None or not np.isfinite(entropy) else float(entropy)
    return np.concatenate([q, mean, [h, math.log1p(max(int(s or 0), 0))]]).astype(np.float32)


def sibling_target(transforms, rewards) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 3 over the children of one expansion: ``(mask, target)``, the transforms drawn and ``p_j = R_j / sum_k
    R_k`` over them (mean reward per transform, clipped at ``FLOOR``); zeros elsewhere."""
    mask, target = np.zeros(3, dtype=np.float32), np.zeros(3, dtype=np.float32)
    for j in range(3):
        mine = [r for t, r in zip(transforms, rewards) if t == TRANSFORMS[j] and r is not None]
        if mine:
            mask[j], target[j] = 1.0, max(float(np.mean(mine)), FLOOR)
    if mask.sum():
        target = target / target.sum()
    return mask, target


class Policy:
    """MLP over the state of :func:`features`: two hidden layers of 64 (ReLU), three action values made
    non-negative by a softplus (plus ``FLOOR``); eq. 3 on them is the transform distribution."""

    name = "reinforced"

    def __init__(self, dim: int, seed: int = 0, lr: float = 1e-4, batch_size: int = 64, epochs: int = 300):
        import torch

        self.lr, self.batch_size, self.epochs = lr, batch_size, epochs
        self._gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 3))
        with torch.no_grad():  # start from equal values: uniform probabilities before any data
            self.net[-1].weight.zero_()
            self.net[-1].bias.fill_(1.0)
        self.losses: list[float] = []

    def _values(self, x):
        import torch

        return torch.nn.functional.softplus(self.net(x)) + FLOOR

    def probabilities(self, state) -> np.ndarray:
        """Eq. 3 on the predicted action values of ``state`` (a :func:`features` vector)."""
        import torch

        with torch.no_grad():
            q = self._values(torch.as_tensor(np.asarray(state, dtype=np.float32))[None])[0].numpy()
        return (q / q.sum()).astype(float)

    def fit(self, states, masks, targets) -> float:
        """Eq. 5-6 on every expansion seen so far: ``states`` ``[N, dim]``, ``masks`` and ``targets`` ``[N, 3]``
        (:func:`sibling_target`); returns the last epoch's mean loss."""
        import torch

        if not len(states):
            return float("nan")
        x = torch.as_tensor(np.asarray(states, dtype=np.float32))
        m = torch.as_tensor(np.asarray(masks, dtype=np.float32))
        t = torch.as_tensor(np.asarray(targets, dtype=np.float32))
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        for _ in range(self.epochs):
            order = torch.randperm(len(x), generator=self._gen)
            total = 0.0
            for start in range(0, len(x), self.batch_size):
                idx = order[start:start + self.batch_size]
                q = self._values(x[idx]) * m[idx]
                p = q / q.sum(1, keepdim=True)  # eq. 3 over the transforms drawn
                loss = (((t[idx] - p) * m[idx]) ** 2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
        self.losses.append(total / len(x))
        return self.losses[-1]


class RandomPolicy:
    """Figure 6's baseline: probabilities drawn from a flat Dirichlet at every step; nothing is learnt."""

    name = "random"

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def probabilities(self, state) -> np.ndarray:
        return self._rng.dirichlet(np.ones(3))

    def fit(self, states, masks, targets) -> float:
        return float("nan")
