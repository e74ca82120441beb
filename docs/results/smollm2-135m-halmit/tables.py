"""The Markdown tables of this folder's README, printed from its JSON files (run in this folder):

    python tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
METHODS = {"halmit": "HalMit monitor", "pp": "predictive probability (PP)", "icl": "ICL prompt judge",
           "selfcheckgpt": "SelfCheckGPT (unigram)", "semantic-entropy": "semantic entropy alone (extra)"}


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def method_table(table: dict) -> str:
    """One labelling's figures: AUROC with its bootstrap interval, the paired difference to the monitor, and the
    threshold figures."""
    lines = ["| method | AUROC [95 % CI] | minus HalMit [95 % CI] (p) | AUC-PR | F1 | precision | recall |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, label in METHODS.items():
        m, b = table["metrics"][name], table["vs_halmit"][name]
        diff = "" if name == "halmit" else f"{b['diff']:+.3f} [{b['diff_ci'][0]:+.3f}, {b['diff_ci'][1]:+.3f}] " \
                                           f"({b['p']:.2f})"
        lines.append(f"| {label} | {m['auroc']:.3f} [{b['ci'][0]:.2f}, {b['ci'][1]:.2f}] | {diff} | "
                     f"{m['auc_pr']:.3f} | {m['f1']:.3f} | {m['precision']:.3f} | {m['recall']:.3f} |")
    return "\n".join(lines)


def bench_section(result: dict) -> str:
    out = []
    for rule, table in (("GQA (the paper's rule)", result), ("answer containment", result["by_label"]["contains"])):
        trivial = table["metrics"]["halmit"]["trivial_f1"]
        out.append(f"*Labels by {rule}*: {table['hallucinated']} of {result['n_test']} hallucinated (base rate "
                   f"{table['base_rate']:.2f}; flagging everything gives F1 {trivial:.3f}).\n\n"
                   + method_table(table))
    cases = ", ".join(f"{c}: {n}" for c, n in result["cases"].items())
    out.append(f"Monitor decisions (ε = {result['epsilon']}): {cases}.")
    return "\n\n".join(out)


def cost_table(runs: dict) -> str:
    lines = ["| run | queries | boundary points | γ | expanded | ε (case 1 fires on explored queries) | LLM calls | "
             "minutes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, path in runs.items():
        if not (HERE / path).exists():
            continue
        s = load(path)
        eps = s["epsilon"]
        lines.append(f"| {name} | {s['evaluated']} | {s['boundary_points']} | {s['gamma']:.3f} | {s['expanded']} | "
                     f"{eps['value']} ({eps.get('fires', '-')}) | "
                     f"{sum(s['llm_calls'].values())} | {s['minutes']} |")
    return "\n".join(lines)


def curve_table(names) -> str:
    lines = ["| domain / policy | mean H | slope per step | volatility | steps keeping or raising H | "
             "mean H by depth (n) |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        if not (HERE / name).exists():
            continue
        for run, c in load(name).items():
            depth = " / ".join(f"{v['mean']:.2f} ({v['n']})" for v in c["by_depth"].values())
            lines.append(f"| {run} | {c['mean']:.3f} | {c['slope']:+.4f} | {c['volatility']:.3f} | "
                         f"{c['non_decreasing']:.2f} | {depth} |")
    return "\n".join(lines)


def main() -> None:
    for domain in ("Warsaw", "Imperialism"):
        if (HERE / f"bench-{domain}.json").exists():
            print(f"## {domain}\n\n{bench_section(load(f'bench-{domain}.json'))}\n")
    known = load("known-analysis.json")
    print("## Known boundary\n\n" + json.dumps({k: v for k, v in known.items() if k != "region_label"}, indent=1))
    print(f"\nRegion label: {known['region_label']['hallucinated']} of 80 questions about the missing part\n")
    print(method_table(known["region_label"]) + "\n")
    print(bench_section(load("bench-known.json")) + "\n")
    print(cost_table({"Warsaw / reinforced": "explore-Warsaw-reinforced.json",
                      "Warsaw / random": "explore-Warsaw-random.json",
                      "Imperialism / reinforced": "explore-Imperialism-reinforced.json",
                      "Imperialism / random": "explore-Imperialism-random.json",
                      "Warsaw without its last 16 paragraphs / reinforced": "explore-known.json"}) + "\n")
    print(curve_table(["figure6-Warsaw.json", "figure6-Imperialism.json"]))


if __name__ == "__main__":
    main()
