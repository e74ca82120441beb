"""Reinforced fractal probabilities (HalMit section 3.1.2): rewards (eq. 2), transform probabilities (eq. 3), states
(eq. 4) and a small MLP policy whose action values are fitted with the L2 loss of eq. 5-6.

Where the equations leave a choice, ours:

- eq. 2, a hallucinated answer among the K: the reward is ``|1 / R_{i-1}|`` as printed, capped at ``REWARD_CAP``
  (10) because ``R_{i-1}`` may be 0 or tiny; a path's first step takes ``R_0 = 1``;
- eq. 3 needs non-negative rewards, and eq. 2 gives a negative one when the entropy falls: rewards (or predicted
  action values) are clipped at ``FLOOR`` (0.01) before they are normalised, so no transform's probability is 0;
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


class Policy:
    """MLP ``Q(s, .)`` over the three transforms: input ``log(1 + s)``, two hidden layers of 32 (ReLU), three
    outputs. :meth:`fit` minimises ``sum_i (R_i - Q(s_i, f_i))^2`` (eq. 5-6; the observed reward stands for ``Q*``)
    with Adam (learning rate 1e-4, mini-batches of 64, 300 epochs: the paper's settings)."""

    name = "reinforced"

    def __init__(self, seed: int = 0, lr: float = 1e-4, batch_size: int = 64, epochs: int = 300):
        import torch

        self.lr, self.batch_size, self.epochs = lr, batch_size, epochs
        self._gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 3))
        with torch.no_grad():  # start from equal values: uniform probabilities before any data
            self.net[-1].weight.zero_()
            self.net[-1].bias.fill_(1.0)
        self.losses: list[float] = []

    def values(self, s: int) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.net(torch.tensor([[math.log1p(max(s, 0))]], dtype=torch.float32))[0].numpy()

    def probabilities(self, s: int) -> np.ndarray:
        """Eq. 3 on the predicted action values."""
        return probabilities(self.values(s))

    def fit(self, states, actions, rewards) -> float:
        """Fit on all transitions seen so far; returns the last epoch's mean loss (eq. 5)."""
        import torch

        if not len(states):
            return float("nan")
        x = torch.tensor(np.log1p(np.maximum(states, 0)), dtype=torch.float32)[:, None]
        a = torch.tensor(actions, dtype=torch.long)
        r = torch.tensor(rewards, dtype=torch.float32)
        opt = torch.optim.Adam(self.net.parameters(), lr=self.lr)
        for _ in range(self.epochs):
            order = torch.randperm(len(x), generator=self._gen)
            total = 0.0
            for start in range(0, len(x), self.batch_size):
                idx = order[start:start + self.batch_size]
                q = self.net(x[idx]).gather(1, a[idx, None])[:, 0]
                loss = ((r[idx] - q) ** 2).sum()
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

    def probabilities(self, s: int) -> np.ndarray:
        return self._rng.dirichlet(np.ones(3))

    def fit(self, states, actions, rewards) -> float:
        return float("nan")
