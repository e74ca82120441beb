"""How far an answer's inputs lie from a detector's training answers: the part a detector holds for its verdicts'
``ood`` field.

The reference (:class:`OODReference`) is the mean and deviation of each input of the detector's last step (its
raw score, or the fused detector's stacked inputs) over the training answers, held out where the method has
held-out values, and quantiles of the training answers' own distances. An answer's distance is the root mean square
of its inputs' z-scores; its percentile is the share of training answers nearer; it is ``extrapolated`` when it
lies farther than all but :data:`OOD_EXTRAPOLATED` of them. Artifact section: ``ood_reference``.
"""

from __future__ import annotations

import numpy as np

#: Quantiles of the training answers' distances that an artifact keeps.
OOD_QUANTILES = (0.0, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)
#: An answer farther from the training data than all but this share of the training answers is ``extrapolated``.
OOD_EXTRAPOLATED = 0.01


class OODReference:
    def __init__(self, mean, std, distances):
        self.mean, self.std, self.distances = list(mean), list(std), list(distances)

    @classmethod
    def fit(cls, inputs) -> "OODReference":
        """The reference of the training answers' ``inputs`` (``[n, k]``)."""
        inputs = np.asarray(inputs, dtype=float)
        mean, std = inputs.mean(0), inputs.std(0) + 1e-9
        distances = np.sqrt((((inputs - mean) / std) ** 2).mean(1))
        return cls(mean.tolist(), std.tolist(), np.quantile(distances, OOD_QUANTILES).round(6).tolist())

    def of(self, inputs) -> list[dict]:
        """Per answer (rows of ``inputs``): ``distance``, ``percentile`` and ``extrapolated`` (module docstring)."""
        z = (np.asarray(inputs, dtype=float) - np.array(self.mean)) / np.array(self.std)
        distances = np.sqrt((z ** 2).mean(1))
        cut = np.interp(1 - OOD_EXTRAPOLATED, OOD_QUANTILES, self.distances)
        return [{"distance": round(float(d), 3),
                 "percentile": round(float(np.interp(d, self.distances, OOD_QUANTILES)), 3),
                 "extrapolated": bool(d > cut)} for d in distances]

    def to_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "distances": self.distances}

    @classmethod
    def from_dict(cls, d: dict | None) -> "OODReference | None":
        return None if not d else cls(d["mean"], d["std"], d["distances"])
