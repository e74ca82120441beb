"""The adapter beside the routed default on RAGTruth's dev answers, nothing fitted: each one's answer AUROC, their
rank correlation, the AUROC of the plain average of their two rankings, and how far each one's probability moves
between RAGTruth's prompt and the QA template (the adapter: the sigmoid of its highest token log-odds); where the
adapter read RAGTruth's answers in the chat input mode too, how far its probability moves between raw and chat.
Usage: compare.py WORK TAG  (after ``train.py WORK dev TAG`` on dev.pt and on dev-ragtruth-qa:all.pt, and on
dev-chat.pt if there)"""

import json
import sys
from pathlib import Path

import numpy as np
from scipy.special import expit
from scipy.stats import rankdata, spearmanr
from sklearn.metrics import roc_auc_score

ROUTED = Path(__file__).parent.parent / "smollm2-135m-routed-dev" / "predictions.jsonl"


def routed_dev() -> dict:
    """The routed default's committed dev predictions (train-only fit), one row per dataset."""
    rows = map(json.loads, ROUTED.read_text().splitlines())
    return {row["dataset"]: row for row in rows if row["detector"] == "routed"}


def main(work, tag):
    routed = routed_dev()
    raw, qa = (np.load(Path(work) / f"dev-{tag}-{name}.npy") for name in ("dev", "dev-ragtruth-qa:all"))
    labels = np.array(routed["ragtruth:all"]["labels"])
    assert len(labels) == len(raw) and routed["ragtruth-qa:all"]["labels"] == routed["ragtruth:all"]["labels"]
    default, default_qa = (np.array(routed[name]["probs"]) for name in ("ragtruth:all", "ragtruth-qa:all"))
    print(f"answer AUROC: routed {roc_auc_score(labels, default):.4f}, adapter {roc_auc_score(labels, raw):.4f}")
    print(f"rank correlation {spearmanr(default, raw).correlation:.4f}; AUROC of the average of the two rankings "
          f"{roc_auc_score(labels, rankdata(default) + rankdata(raw)):.4f}")
    print(f"median |change of probability| between the two renderings: routed "
          f"{np.median(np.abs(default - default_qa)):.4f}, adapter {np.median(np.abs(expit(raw) - expit(qa))):.4f}")
    chat = Path(work) / f"dev-{tag}-dev-chat.npy"
    if chat.exists():
        chat = np.load(chat)
        print(f"adapter, chat input: answer AUROC {roc_auc_score(labels, chat):.4f}, median |change of probability| "
              f"from raw {np.median(np.abs(expit(raw) - expit(chat))):.4f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
