"""How far an answer's inputs lie from a detector's training answers: the part a detector holds for its verdicts'
``ood`` field.

The reference (:class:`OODReference`) is the mean and deviation of each input of the detector's last step (its
raw score, or the fused detector's stacked inputs) over the training answers, held out where the method has
held-out values, and quantiles of the training answers' own distances. An answer's distance is the root mean square
of its inputs' z-scores; its percentile is the share of training answers nearer; it is ``extrapolated`` when it
lies farther than all but :data:`OOD_EXTRAPOLATED` of them. The reference also keeps the AUROC of the detector's
held-out scores of its training answers: every answer the detector judges is ``weak`` when that is below
:data:`WEAK_AUROC` (an answer of a shape the detector ranks poorly even where it was trained, e.g. the default's
summaries), whatever its distance. Artifact section: ``ood_reference``.
"""

from __future__ import annotations

import numpy as np

#: Quantiles of the training answers' distances that an artifact keeps.
OOD_QUANTILES = (0.0, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)
#: An answer farther from the training data than all but this share of the training answers is ``extrapolated``.
OOD_EXTRAPOLATED = 0.01
#: Below this held-out AUROC on its own training answers a detector (or a routed detector's part) is weak on its
#: answers (halwatch's line: the default ranks RAGTruth's QA answers at 0.87 and summary sets at 0.55-0.61).
WEAK_AUROC = 0.7


def held_out_auroc(raw, labels, oriented: bool = True) -> float:
    """The AUROC of a detector's held-out raw scores (an unsupervised score ranked whichever way it ranks better,
    as its calibration orients it)."""
    from sklearn.metrics import roc_auc_score

    auroc = float(roc_auc_score(np.asarray(labels, dtype=int), np.asarray(raw, dtype=float)))
    return auroc if oriented else max(auroc, 1.0 - auroc)


class OODReference:
    def __init__(self, mean, std, distances, held_out_auroc: float | None = None):
        self.mean, self.std, self.distances = list(mean), list(std), list(distances)
        self.held_out_auroc = held_out_auroc

    @classmethod
    def fit(cls, inputs, held_out_auroc: float | None = None) -> "OODReference":
        """The reference of the training answers' ``inputs`` (``[n, k]``), with the AUROC of the detector's held-out
        scores of them where known."""
        inputs = np.asarray(inputs, dtype=float)
        mean, std = inputs.mean(0), inputs.std(0) + 1e-9
        distances = np.sqrt((((inputs - mean) / std) ** 2).mean(1))
        auroc = None if held_out_auroc is None else round(float(held_out_auroc), 4)
        return cls(mean.tolist(), std.tolist(), np.quantile(distances, OOD_QUANTILES).round(6).tolist(), auroc)

    def of(self, inputs) -> list[dict]:
        """Per answer (rows of ``inputs``): ``distance``, ``percentile`` and ``extrapolated`` (module docstring)."""
        z = (np.asarray(inputs, dtype=float) - np.array(self.mean)) / np.array(self.std)
        distances = np.sqrt((z ** 2).mean(1))
        cut = np.interp(1 - OOD_EXTRAPOLATED, OOD_QUANTILES, self.distances)
        weak = {} if self.held_out_auroc is None else {"weak": self.held_out_auroc < WEAK_AUROC,
                                                        "held_out_auroc": self.held_out_auroc}
        return [{"distance": round(float(d), 3),
                 "percentile": round(float(np.interp(d, self.distances, OOD_QUANTILES)), 3),
                 "extrapolated": bool(d > cut), **weak} for d in distances]

    def to_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "distances": self.distances,
                **({"held_out_auroc": self.held_out_auroc} if self.held_out_auroc is not None else {})}

    @classmethod
    def from_dict(cls, d: dict | None) -> "OODReference | None":
        return None if not d else cls(d["mean"], d["std"], d["distances"], d.get("held_out_auroc"))
