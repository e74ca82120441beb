"""Print the invariance figures of several runs side by side: python compare_inv.py NAME=FILE ..."""
import json
import sys

runs = [(a.split("=", 1)[0], json.load(open(a.split("=", 1)[1]))) for a in sys.argv[1:]]
print("| run | threshold | rendering | median abs change | flips | flagged | AUROC | lookback | toha | diag | hidden | uncertainty | token_max |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name, d in runs:
    for r, v in d["renderings"].items():
        s = v["inputs_median_abs_change_sd"]
        print(f"| {name} | {d['threshold']:.3f} | {r} | {v['median_abs_change']:.4f} | {v['flips']:.4f} | {v['flagged']:.4f} | "
              f"{v['auroc']:.4f} | {s['lookback']:.3f} | {s['toha']:.3f} | {s['diag']:.3f} | {s['hidden']:.3f} | "
              f"{s['uncertainty']:.3f} | {s['token_max']:.3f} |")
