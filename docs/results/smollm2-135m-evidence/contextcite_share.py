"""ContextCite's top-1 share from its results alone (contextcite.jsonl, by contextcite_run.py) on the answers of an
answers file written by measure.py, per kind and for the answers sharing at most half their words with the gold
sentence, with its median seconds per answer; right by measure.py's own rule (``holds``). No scoring model runs.

    .venv/bin/python docs/results/smollm2-135m-evidence/contextcite_share.py [answers.jsonl | answers-generated.jsonl]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import holds  # noqa: E402


def main(answers: str) -> None:
    rows = [json.loads(line) for line in (HERE / answers).read_text().splitlines()]
    cited = {c["id"]: c for c in map(json.loads, (HERE / "contextcite.jsonl").read_text().splitlines())}
    out = {}
    for row in rows:
        if row["id"] not in cited:
            continue
        right = holds(tuple(cited[row["id"]]["top"]), row)
        for kind in (row["kind"], f"{row['kind']}, overlap <= 0.5" if row["overlap"] <= 0.5 else None):
            if kind:
                out.setdefault(kind, []).append((right, cited[row["id"]]["seconds"]))
    print(json.dumps({k: {"answers": len(v), "ContextCite top-1": round(float(np.mean([r for r, _ in v])), 3),
                          "median s/answer": round(float(np.median([s for _, s in v])), 1)}
                      for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "answers.jsonl")
