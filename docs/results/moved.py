"""Which published figures moved: the mean AUROC (and span F1) of every (dataset, detector, protocol, probe) cell of
a results folder, before (the folder's results.json at a git revision) and after (the file on disk).

    python docs/results/moved.py REV docs/results/smollm2-135m-raw [more folders]

prints a markdown table per folder with before, after and the change, largest changes first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def cells(rows: list[dict], metric: str) -> dict:
    out = defaultdict(list)
    for r in rows:
        if r.get("settings") or metric not in r or r[metric] != r[metric]:
            continue
        dataset = r["dataset"].replace("ragtruth:", "")
        out[(dataset, r["detector"], r["protocol"], str(r.get("probe_size")), r.get("input_mode"))].append(r[metric])
    return {k: sum(v) / len(v) for k, v in out.items()}


def table(rev: str, folder: Path, metric: str) -> list[str]:
    old_text = subprocess.run(["git", "show", f"{rev}:{folder / 'results.json'}"], capture_output=True, text=True)
    if old_text.returncode != 0:
        return [f"(no results.json in {folder} at {rev})"]
    before, after = cells(json.loads(old_text.stdout), metric), cells(json.loads((folder / "results.json").read_text()),
                                                                      metric)
    keys = sorted(set(before) & set(after), key=lambda k: -abs(after[k] - before[k]))
    lines = [f"### {folder.name}: {metric}", "", "| dataset | detector | protocol | probe | mode | before | after | "
             "change |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(k)} | {before[k]:.3f} | {after[k]:.3f} | {after[k] - before[k]:+.3f} |" for k in keys]
    only = sorted(set(before) ^ set(after))
    if only:
        lines += ["", f"{len(only)} cells in one run only (not compared)."]
    return lines + [""]


def main(argv: list[str]) -> None:
    rev, folders = argv[0], [Path(f) for f in argv[1:]]
    for folder in folders:
        for metric in ("auroc", "span_f1"):
            print("\n".join(table(rev, folder, metric)))


if __name__ == "__main__":
    main(sys.argv[1:])
