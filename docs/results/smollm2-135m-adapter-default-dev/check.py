"""The stop rule of commands.txt applied to step 3's dev run: per dev set, the AUROC of the routed default with the
adapter family and without it (both fitted on the training parts, read on the dev parts), the paired difference with
its 95 % bootstrap interval (the same resampled answers for both), and the verdict: ship only if RAGTruth (ragtruth:all)
gains >= 0.01 and no other set loses more than 0.01. Also the FPR and TPR at each one's threshold and the span F1,
and per part (task): a part takes the adapter where none of its dev sets loses more than 0.01 and they gain on
average (the routed setting adapter_tasks), which the rows show since each part is fitted on its own task alone.

    python check.py WORK/routed-adapter-dev        (prints a markdown table and the verdict)
"""

import json
import sys
from pathlib import Path

from halwatch.eval.metrics import paired_bootstrap

GAIN, LOSS, TARGET = 0.01, 0.01, "ragtruth:all"
#: The part (task) that judges each dev set: each part is fitted on its own task's answers alone.
PARTS = {"ragtruth:all": "qa", "ragtruth-qa:all": "qa", "squad-shapes": "qa", "squad-shapes-ragtruth": "qa",
         "begin": "dialogue", "faithdial": "dialogue", "diasumfact": "summary", "summedits": "summary",
         "xsum-hallucination": "summary"}


def by_detector(rows: list[dict]) -> dict:
    """{(dataset, "adapter" or "plain"): row} for the routed rows of a results or predictions file."""
    out = {}
    for row in rows:
        if row.get("settings", {}).get("training", "included") != "included":
            continue  # a fit without the set (--hold-out NAME): not the rule's rows
        name = row["detector"]
        if name == "routed":
            out[(row["dataset"], "plain")] = row
        elif name.startswith("routed") and "adapter" in name:
            out[(row["dataset"], "adapter")] = row
    return out


def main(folder: Path) -> None:
    results = by_detector(json.loads((folder / "results.json").read_text()))
    preds = by_detector(json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines())
    datasets = sorted({d for d, _ in results if (d, "plain") in results and (d, "adapter") in results},
                      key=lambda d: (d != TARGET, d))
    print("| dev set | answers | AUROC without | AUROC with | change (95 % paired bootstrap) | FPR / TPR without | "
          "FPR / TPR with | span F1 without / with |")
    print("|---|---|---|---|---|---|---|---|")
    changes = {}
    for d in datasets:
        plain, adapter = results[(d, "plain")], results[(d, "adapter")]
        p_plain, p_adapter = preds[(d, "plain")], preds[(d, "adapter")]
        assert p_plain["labels"] == p_adapter["labels"], d
        boot = paired_bootstrap(p_plain["labels"], {"plain": p_plain["probs"], "adapter": p_adapter["probs"]}, "plain")
        change = boot["adapter"]["diff"]
        changes[d] = change
        low, high = boot["adapter"]["diff_ci"]
        spans = "/".join(f"{r['span_f1']:.3f}" if "span_f1" in r else "-"
                         for r in (plain, adapter))
        print(f"| {d} | {plain['n_test']} | {boot['plain']['auroc']:.3f} | {boot['adapter']['auroc']:.3f} | "
              f"{change:+.3f} ({low:+.3f}, {high:+.3f}) | {plain['fpr']:.2f} / {plain['tpr']:.2f} | "
              f"{adapter['fpr']:.2f} / {adapter['tpr']:.2f} | {spans} |")
    gained = changes.get(TARGET, float("nan")) >= GAIN
    worst = min((c, d) for d, c in changes.items() if d != TARGET)
    print()
    print(f"{TARGET}: {changes.get(TARGET, float('nan')):+.3f} (rule: >= +{GAIN}); largest loss elsewhere: "
          f"{worst[0]:+.3f} on {worst[1]} (rule: no set below -{LOSS})")
    print("verdict:", "ship the adapter" if gained and worst[0] >= -LOSS else "the adapter stays out")
    # per part: it takes the adapter where none of its sets loses more than LOSS and they gain on average
    helps = []
    for part in sorted(set(PARTS.values())):
        mine = [changes[d] for d in changes if PARTS.get(d) == part]
        ok = bool(mine) and min(mine) >= -LOSS and sum(mine) / len(mine) > 0
        print(f"part {part}: mean change {sum(mine) / max(len(mine), 1):+.3f}, lowest {min(mine, default=0):+.3f}"
              f" -> {'takes' if ok else 'goes without'} the adapter")
        helps += [part] * ok
    if gained and "qa" in helps:
        print("per part: ship with adapter_tasks=" + "+".join(helps))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
