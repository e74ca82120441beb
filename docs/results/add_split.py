"""Backfill ``"split"`` into the committed result rows: the split each row's figures were computed on.

Since ``"split"`` is written by ``halwatch bench`` itself (``halwatch.eval.protocols.SCORED_SPLIT``; for
shape-transfer its ``--eval-split``), rows made before it lack the field, and a dev row looked like a test row. This
script reads every ``results.json`` under ``docs/results``, finds the ``halwatch bench`` commands that made it in the
folder's ``commands.txt`` (or, for a subfolder without one, the nearest parent's; where some of those commands write
``--out`` to this folder, only those), and gives each row without the field:

- ``shape-transfer``: the ``--eval-split`` of the commands that ran that protocol (``dev`` where none is given, the
  command line's default), which must be one split and agree with the row's own ``settings.eval``;
- every other protocol: the split that protocol scores (``SCORED_SPLIT``: ``official`` / ``ragtruth-official`` and
  ``transfer`` the test split, ``dev`` the dev split, ``random-splits`` ``random`` and ``kfold`` ``fold``: answers
  drawn from the whole set, whatever their official split), once a command there names the protocol.

A row it cannot decide (no command of its protocol, several eval splits, or one that contradicts the row) gets
``"split": "unknown"`` and is listed. The field goes right after ``protocol``; each file keeps its formatting
(``json.dump(..., indent=1)``, as ``halwatch.eval.protocols.save_results`` writes it). Rows that already carry
``split`` are left as they are, so a second run changes nothing.

    .venv/bin/python docs/results/add_split.py            # write the field, print counts per folder
    .venv/bin/python docs/results/add_split.py --check    # only print what it would write
"""

import json
import shlex
import sys
from collections import Counter
from pathlib import Path

from halwatch.eval.protocols import SCORED_SPLIT

HERE = Path(__file__).resolve().parent


def bench_commands(folder: Path) -> list[dict]:
    """``{"protocols", "eval_split", "out"}`` of every ``halwatch bench`` run in the commands.txt that serves
    ``folder`` (its own, else the nearest parent's under docs/results)."""
    for place in (folder, *folder.parents):
        if (place / "commands.txt").exists() or place == HERE:
            break
    path = place / "commands.txt"
    found = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if "bench" not in words or "--protocol" not in words:
            continue
        protocols, eval_split, out = [], "dev", None
        for i, word in enumerate(words):
            if word == "--protocol":  # one or more names, up to the next option
                for name in words[i + 1:]:
                    if name.startswith("-"):
                        break
                    protocols.append(name)
            elif word == "--eval-split" and i + 1 < len(words):
                eval_split = words[i + 1]
            elif word == "--out" and i + 1 < len(words):
                out = words[i + 1].rstrip("/")
        found.append({"protocols": protocols, "eval_split": eval_split, "out": out})
    here = folder.relative_to(HERE).as_posix()
    own = [c for c in found if c["out"] and (c["out"] == here or c["out"].endswith("/" + here))]
    return own or found


def split_of(row: dict, commands: list[dict]) -> str:
    """The split of one row, from its protocol and the commands that ran it; ``"unknown"`` if they do not say."""
    protocol = row.get("protocol")
    ran = [c for c in commands if protocol in c["protocols"]]
    if not ran:
        return "unknown"
    if protocol == "shape-transfer":
        splits = {c["eval_split"] for c in ran}
        recorded = (row.get("settings") or {}).get("eval")
        if len(splits) != 1 or (recorded is not None and recorded not in splits):
            return "unknown"
        return splits.pop()
    return SCORED_SPLIT.get(protocol, "unknown")


def with_split(row: dict, split: str) -> dict:
    """``row`` with ``"split"`` right after ``"protocol"`` (at the end where it has none)."""
    out = {}
    for key, value in row.items():
        out[key] = value
        if key == "protocol":
            out["split"] = split
    out.setdefault("split", split)
    return out


def main(check: bool = False) -> int:
    undecided = []
    for path in sorted(HERE.glob("**/results.json")):
        rows = json.loads(path.read_text())
        commands = bench_commands(path.parent)
        new = [row if "split" in row else with_split(row, split_of(row, commands)) for row in rows]
        counts = Counter(r["split"] for r in new)
        undecided += [(path, i, r.get("protocol"), r.get("dataset"), r.get("detector"))
                      for i, r in enumerate(new) if r["split"] == "unknown"]
        print(f"{path.parent.relative_to(HERE)}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        if not check and any("split" not in r for r in rows):
            path.write_text(json.dumps(new, indent=1))
    for path, i, protocol, dataset, detector in undecided:
        print(f"unknown: {path.relative_to(HERE)} row {i} ({protocol}, {dataset}, {detector})")
    print(f"{len(undecided)} rows undecided")
    return 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
