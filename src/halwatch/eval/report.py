"""``report.md`` and figures from benchmark results: mean ± std tables (TOHA Tables 1-2), average ranks and
Wilcoxon-Holm pairwise tests (Tables 12-13), ROC curves, Δ scatter of heads (Figure 2), AUROC vs probe size
(Figure 3a-b), AUROC vs N_max (Figure 4b-c) and the transfer matrix (Figure 3c)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from halwatch.plots import figure, roc, save

METRICS = ("auroc", "auc_pr", "f1", "accuracy", "precision", "recall", "trivial_f1")
#: Span-level figures, present for detectors with token scores on data with gold spans (Bench.span_metrics).
SPAN_METRICS = ("span_f1", "span_precision", "span_recall", "span_trivial_f1", "grounded_without_span",
                "window_auroc", "window_auc_pr", "window_f1", "window_trivial_f1")


def _group(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def mean_std_table(rows, metric: str = "auroc") -> str:
    """Markdown table: detectors x datasets, ``mean ± std`` of ``metric`` over seeds; best per column in bold."""
    datasets = sorted({r["dataset"] for r in rows})
    detectors = sorted({r["detector"] for r in rows})
    cells = {k: [r[metric] for r in v] for k, v in _group(rows, "detector", "dataset").items()}
    best = {d: max((np.mean(cells[(det, d)]) for det in detectors if (det, d) in cells), default=None)
            for d in datasets}
    lines = ["| detector | " + " | ".join(datasets) + " |", "|---" * (len(datasets) + 1) + "|"]
    for det in detectors:
        row = []
        for d in datasets:
            vals = cells.get((det, d))
            if not vals:
                row.append("")
                continue
            text = f"{np.mean(vals):.3f} ± {np.std(vals):.3f}"
            row.append(f"**{text}**" if np.isclose(np.mean(vals), best[d]) else text)
        lines.append(f"| {det} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ranks_and_tests(rows, metric: str = "auroc") -> tuple[dict, list]:
    """Average rank of each detector over (dataset, seed) cases (1 = best), and pairwise Wilcoxon signed-rank tests
    on the paired cases with Holm's step-down correction (Ismail Fawaz et al. 2019, as TOHA Tables 12-13)."""
    from scipy.stats import rankdata, wilcoxon

    cases = _group(rows, "dataset", "seed")
    detectors = sorted({r["detector"] for r in rows})
    complete = {k: {r["detector"]: r[metric] for r in v} for k, v in cases.items()}
    complete = {k: v for k, v in complete.items() if set(v) == set(detectors)}
    ranks = defaultdict(list)
    for values in complete.values():
        r = rankdata([-values[d] for d in detectors])
        for d, x in zip(detectors, r):
            ranks[d].append(x)
    avg = {d: float(np.mean(ranks[d])) for d in detectors if ranks[d]}
    tests = []
    for a, b in itertools.combinations(detectors, 2):
        x = np.array([v[a] for v in complete.values()])
        y = np.array([v[b] for v in complete.values()])
        p = float(wilcoxon(x, y).pvalue) if len(x) >= 2 and np.any(x != y) else 1.0
        tests.append({"a": a, "b": b, "p": p, "n": len(x)})
    tests.sort(key=lambda t: t["p"])
    m = len(tests)
    running = 0.0
    for i, t in enumerate(tests):  # Holm: adjusted p_(i) = max_{j<=i} (m - j) p_(j), capped at 1
        running = max(running, min(1.0, (m - i) * t["p"]))
        t["p_holm"] = running
        t["significant"] = running <= 0.05
    return avg, tests


def _plot_roc(predictions, path: Path, dataset: str, protocol: str) -> None:
    curves = {p["detector"]: (p["labels"], p["probs"]) for p in predictions
              if p["dataset"] == dataset and p["protocol"] == protocol and p["seed"] == 0}
    with figure((5, 5)) as (fig, ax):
        roc(ax, curves, f"ROC, {dataset} ({protocol}, seed 0)")
        save(fig, path)


def plot_lines(series: dict, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """``series``: name -> list of (x, mean, std)."""
    with figure((6, 4)) as (fig, ax):
        for name, pts in sorted(series.items()):
            pts = sorted(pts)
            xs, ms, ss = (np.array(v) for v in zip(*pts))
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=name)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.legend(fontsize=7)
        save(fig, path)


def plot_delta_scatter(deltas_a, deltas_b, heads, names, path: Path, top: int = 10) -> None:
    """Figure 2: Δ of every head on dataset A (x) and B (y); the heads best on both are labelled."""
    with figure((5.5, 5)) as (fig, ax):
        ax.scatter(deltas_a, deltas_b, s=8, alpha=0.6)
        best = np.argsort(-np.minimum(deltas_a, deltas_b))[:top]
        for i in best:
            ax.scatter(deltas_a[i], deltas_b[i], s=24, color="deeppink")
            ax.annotate(f"L{heads[i][0]}H{heads[i][1]}", (deltas_a[i], deltas_b[i]), fontsize=7)
        ax.axhline(0, color="k", lw=0.5)
        ax.axvline(0, color="k", lw=0.5)
        ax.set(xlabel=f"Δ on {names[0]}", ylabel=f"Δ on {names[1]}", title="Δ_ij of MTop-Div per head (eq. 3)")
        save(fig, path)


def plot_transfer(rows, path: Path, detector: str) -> None:
    """Figure 3c: AUROC of ``detector`` fitted on the row dataset and evaluated on the column dataset."""
    cells = {}
    for r in rows:
        if r["protocol"] == "transfer" and r["detector"] == detector:
            src, dst = r["dataset"].split("->")
            cells.setdefault((src, dst), []).append(r["auroc"])
    names = sorted({k for pair in cells for k in pair})
    if not names:
        return
    grid = np.full((len(names), len(names)), np.nan)
    for (src, dst), vals in cells.items():
        grid[names.index(src), names.index(dst)] = np.mean(vals)
    with figure((5.5, 4.5)) as (fig, ax):
        im = ax.imshow(grid, vmin=0.4, vmax=0.9, cmap="viridis")
        for i, j in itertools.product(range(len(names)), repeat=2):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        short = [n.split(":")[-1] for n in names]
        ax.set_xticks(range(len(names)), short, rotation=30, fontsize=7)
        ax.set_yticks(range(len(names)), short, fontsize=7)
        ax.set(xlabel="evaluated on", ylabel="fitted on", title=f"transfer AUROC, {detector}")
        fig.colorbar(im)
        save(fig, path)


def _bootstrap_tables(preds, protocol, probe, mode) -> list[str]:
    """For a one-seed run (the official split): per dataset, each detector's AUROC with a 95 % bootstrap interval
    and its paired difference to the best detector (2,000 resamples of the test answers)."""
    from halwatch.eval.metrics import paired_bootstrap

    lines = []
    chosen = [p for p in preds if p["protocol"] == protocol and p.get("probe_size") == probe
              and p["input_mode"] == mode and "raw" in p and not p.get("settings")]
    for dataset, group in sorted(_group(chosen, "dataset").items()):
        rankings = {p["detector"]: p["raw"] for p in group}
        labels = group[0]["labels"]
        if len(rankings) < 2 or any(p["labels"] != labels for p in group) or len(set(labels)) < 2:
            continue
        from sklearn.metrics import roc_auc_score

        best = max(rankings, key=lambda d: roc_auc_score(labels, rankings[d]))
        stats = paired_bootstrap(labels, rankings, best)
        lines += [f"**AUROC with 95 % bootstrap intervals, {dataset[0]}** (paired difference to {best}; "
                  "2,000 resamples of the test answers)", "",
                  "| detector | AUROC | 95 % CI | Δ vs best | 95 % CI of Δ | p |", "|---|---|---|---|---|---|"]
        for name, st in sorted(stats.items(), key=lambda kv: -kv[1]["auroc"]):
            lines.append(f"| {name} | {st['auroc']:.3f} | {st['ci'][0]:.3f}-{st['ci'][1]:.3f} | {st['diff']:+.3f} | "
                         f"{st['diff_ci'][0]:+.3f} to {st['diff_ci'][1]:+.3f} | {st['p']:.4f} |")
        lines.append("")
    return lines


def shape_transfer_table(rows) -> list[str]:
    """Report lines of shape-transfer rows: per dataset and detector, with the dataset's training part included
    and held out (and ``never`` for a set that is never trained on), AUROC, the operating point at the shipped
    threshold (false- and true-positive rates, F1), the calibration error against the observed rate, span F1, and
    response length's AUROC on the same answers (the confound every figure is read beside)."""
    lines = [f"## Shape transfer ({rows[0]['settings']['eval']} split)", "",
             "| dataset | detector | training part | n | rate | length | AUROC | FPR | TPR | F1 | ECE | mean p "
             "| span F1 |", "|" + " --- |" * 13]
    order = {"included": 0, "never": 0, "held-out": 1}
    for r in sorted(rows, key=lambda r: (r["dataset"], r["detector"], order[r["settings"]["training"]])):
        span = f"{r['span_f1']:.3f}" if "span_f1" in r else "-"
        length = f"{r['length_auroc']:.3f}" if "length_auroc" in r else "-"
        lines.append(f"| {r['dataset']} | {r['detector']} | {r['settings']['training']} | {r['n_test']} | "
                     f"{r['rate']:.2f} | {length} | {r['auroc']:.3f} | {r['fpr']:.2f} | {r['tpr']:.2f} | "
                     f"{r['f1']:.3f} | {r['ece']:.3f} | {r['mean_prob']:.2f} | {span} |")
    return lines + [""]


def write_report(out_dir) -> Path:
    """``report.md`` and its figures from what the runs left in ``out_dir``: ``results.json``,
    ``predictions.jsonl``, ``commands.txt`` and, from ``--sweeps``, ``sweeps.md`` and its figures."""
    out = Path(out_dir)
    rows = json.loads((out / "results.json").read_text())
    preds = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines() if x]
    main = [r for r in rows if not r.get("settings")]  # sweeps carry their settings and are reported apart
    shapes = [r for r in rows if r["protocol"] == "shape-transfer"]
    commands = (out / "commands.txt").read_text().splitlines() if (out / "commands.txt").exists() else []
    lines = ["# halwatch benchmark report", "", "Made with:", "", "```", *commands, "```", ""]
    ident = sorted({(r["scoring_model"], r["input_mode"], r.get("dtype", "float32"), r["commit"]) for r in rows})
    lines += [f"Scoring model / input mode / precision / commit: {', '.join(' / '.join(i) for i in ident)}", ""]
    for (protocol, probe, mode), group in sorted(_group(main, "protocol", "probe_size", "input_mode").items(),
                                                 key=lambda kv: tuple(map(str, kv[0]))):
        seeds = sorted({r["seed"] for r in group})
        lines += [f"## {protocol}, probe {probe}, input mode {mode} ({len(seeds)} seeds/folds)", ""]
        for metric in METRICS:
            lines += [f"**{metric}** (mean ± std over seeds)", "", mean_std_table(group, metric), ""]
        for metric in SPAN_METRICS:
            having = [r for r in group if metric in r]
            if having:
                what = ("character level, flagged spans vs gold spans" if metric.startswith("span")
                        else "share of grounded answers with no span" if metric == "grounded_without_span"
                        else "over the sliding windows of the test responses")
                lines += [f"**{metric}** ({what}; mean ± std over seeds)", "", mean_std_table(having, metric), ""]
        avg, tests = ranks_and_tests(group)
        if avg:
            lines += ["**Average AUROC rank** over (dataset, seed) cases (1 = best): "
                      + ", ".join(f"{d} {r:.2f}" for d, r in sorted(avg.items(), key=lambda x: x[1])), ""]
            lines += ["| method 1 | method 2 | p (Wilcoxon) | p (Holm) | significant |", "|---|---|---|---|---|"]
            lines += [f"| {t['a']} | {t['b']} | {t['p']:.4f} | {t['p_holm']:.4f} | "
                      f"{'yes' if t['significant'] else 'no'} |" for t in tests]
            lines.append("")
        if len(seeds) == 1:
            lines += _bootstrap_tables(preds, protocol, probe, mode)
        for dataset in sorted({r["dataset"] for r in group}):
            fig = (f"roc-{protocol}-{probe}-{mode}-"
                   f"{dataset.replace(':', '_').replace('>', '').replace('/', '_')}.png")
            _plot_roc([p for p in preds if p.get("probe_size") == probe and p["input_mode"] == mode], out / fig,
                      dataset, protocol)
            lines += [f"![ROC {dataset}]({fig})", ""]
    if shapes:
        lines += shape_transfer_table(shapes)
    transfer = sorted({r["detector"] for r in rows if r["protocol"] == "transfer"})
    if transfer:
        lines += ["## Transfer matrices (fitted on the row dataset's train split, tested on the column's test split)",
                  ""]
        for det in transfer:
            plot_transfer(rows, out / f"transfer-{det}.png", det)
            lines += [f"![transfer {det}](transfer-{det}.png)", ""]
    if (out / "sweeps.md").exists():
        lines += [(out / "sweeps.md").read_text()]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
