"""``halwatch bench``: protocols, sweeps and the report, from the command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.eval.protocols import Bench, save_results
from halwatch.eval.report import plot_delta_scatter, plot_lines, write_report

PROBE_SIZES = (10, 25, 50, 100, 200, 400)
N_MAX = (1, 2, 3, 5, 10, 15, 20, 30)


def _series(rows, key):
    out = {}
    for r in rows:
        out.setdefault(r["detector"], {}).setdefault(r[key], []).append(r["auroc"])
    return {d: [(x, float(np.mean(v)), float(np.std(v))) for x, v in pts.items()] for d, pts in out.items()}


def run_bench(scorer, detectors: list[str], protocols: list[str], datasets: list[str], out: str | Path,
              seeds: int = 5, probe_size: int | None = None, settings: dict | None = None, sweeps: bool = False,
              sweep: str | None = None, map_from_model: str | None = None, command: str = "",
              eval_split: str = "dev", never=(), hold_out=None, artifacts=()) -> Path:
    """Run ``protocols`` over ``datasets`` for every detector (``settings`` go to each detector that has them) and
    every fitted artifact of ``artifacts`` (scored as it is: shape-transfer only),
    optionally the TOHA sweeps, a setting sweep and the Lookback Lens cross-model map; merge the rows into
    ``out/results.json``, append ``command`` to ``out/commands.txt`` and write the report. Returns its path."""
    from halwatch.detectors import DETECTORS, split_spec

    settings = settings or {}
    if not detectors and not artifacts:
        raise HalwatchError("name --detectors to fit, or --artifacts to score as they are")
    methods = {d: split_spec(d)[0] for d in detectors}
    unknown = [d for d, m in methods.items() if m not in DETECTORS]
    if unknown:
        raise HalwatchError(f"unknown detector(s) {unknown}: known are {', '.join(sorted(DETECTORS))}")
    options = {d: {k: v for k, v in settings.items() if k in DETECTORS[methods[d]].setting_names()}
               for d in detectors}
    unused = [k for k in settings if not any(k in o for o in options.values())]
    if unused:
        raise HalwatchError(f"no detector of this run has the setting(s) {unused}")
    bench = Bench(scorer, detectors, options)
    seed_list = list(range(seeds))
    for protocol in protocols:
        bench.run(protocol, datasets, seeds=seed_list, probe_size=probe_size, eval_split=eval_split, never=never,
                  hold_out=hold_out, artifacts=artifacts)
    if map_from_model:
        bench.run_mapped(scorer.on_model(map_from_model), datasets, seeds=seed_list, probe_size=probe_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if sweeps:
        (out / "sweeps.md").write_text("\n".join(toha_sweeps(bench, datasets, seed_list, out)) + "\n")
    if sweep:
        lines = setting_sweep(bench, protocols[0], datasets[0], seed_list, sweep, probe_size)
        print("\n".join(lines))
        (out / f"sweep-{sweep.partition('=')[0]}.md").write_text("\n".join(lines) + "\n")
    save_results(out, bench.rows, bench.predictions)
    with open(out / "commands.txt", "a") as f:
        f.write(command + "\n")
    path = write_report(out)
    print(f"{len(bench.rows)} runs -> {out / 'results.json'}; report: {path}")
    return path


def toha_sweeps(bench: Bench, datasets, seeds, out: Path) -> list[str]:
    """AUROC vs probe size (TOHA Figure 3a-b) and vs N_max (Figure 4b-c) on the first dataset with the official
    split, and the Δ scatter of heads on the first two datasets (Figure 2). Returns report lines."""
    from halwatch.detectors.heads import head_deltas
    from halwatch.detectors.toha import TOHA

    lines = []
    name = datasets[0]
    keep = bench.rows
    bench.rows = []
    for size in PROBE_SIZES:
        bench.run("ragtruth-official", [name], seeds=seeds, probe_size=size, extra={"settings": {"probe": size}})
    probe_rows = [r | {"probe": r["settings"]["probe"]} for r in bench.rows]
    plot_lines(_series(probe_rows, "probe"), out / "auroc-vs-probe-size.png", "probe size", "test AUROC",
               f"AUROC vs probe size, {name} (official test split)")
    swept = bench.rows
    bench.rows, detectors = [], bench.detectors
    bench.detectors = ["toha"]
    for n_max in N_MAX:
        bench.run("ragtruth-official", [name], seeds=seeds, probe_size=100, options={"n_max": n_max},
                  extra={"settings": {"n_max": n_max}})
    nmax_rows = [r | {"n_max": r["settings"]["n_max"]} for r in bench.rows]
    plot_lines(_series(nmax_rows, "n_max"), out / "auroc-vs-nmax.png", "N_max", "test AUROC",
               f"TOHA AUROC vs N_max, {name} (probe 100)")
    bench.rows, bench.detectors = keep + swept + bench.rows, detectors
    lines += ["## Sweeps", "", "![AUROC vs probe size](auroc-vs-probe-size.png)", "",
              "![AUROC vs N_max](auroc-vs-nmax.png)", ""]
    if len(datasets) >= 2:
        toha = TOHA(scorer=bench.scorer)
        heads = bench.scorer.model.all_heads()
        deltas = []
        for d in datasets[:2]:
            samples, labels, _, signals, _ = bench.data(d)  # the white-box pass has MTop-Div of every head
            train = [i for i, s in enumerate(samples) if s.meta.get("split", "train") == "train"]
            deltas.append(head_deltas(toha.per_head([signals[i] for i in train], heads), labels[train]))
        plot_delta_scatter(deltas[0], deltas[1], heads, datasets[:2], out / "delta-scatter.png")
        top = np.argsort(-np.minimum(*deltas))[:10]
        lines += ["![Δ scatter](delta-scatter.png)", "",
                  "Heads with the largest Δ on both training sets: "
                  + ", ".join(f"L{heads[i][0]}H{heads[i][1]}" for i in top), ""]
    return lines


def setting_sweep(bench: Bench, protocol: str, dataset: str, seeds, sweep: str, probe_size=None) -> list[str]:
    """``KEY=V1,V2,...``: every detector of the bench under ``protocol`` on ``dataset`` for each value of setting
    KEY (e.g. LRP4RAG's resampling length, Table 3). Rows carry ``settings``; returns a markdown table of the mean
    accuracy, precision, recall, F1 and AUROC over seeds (folds)."""
    from halwatch.detectors import DETECTORS, parse_setting, split_spec

    key, _, values = sweep.partition("=")
    parsed = [parse_setting(f"{key}={v}")[1] for v in values.split(",") if v]
    if not key or not parsed:
        raise HalwatchError(f"--sweep expects KEY=V1,V2,..., got {sweep!r}")
    swept = [d for d in bench.detectors if key in DETECTORS[split_spec(d)[0]].setting_names()]
    if not swept:
        raise HalwatchError(f"--sweep {key}: no detector of this run has that setting")
    keep, everyone, bench.rows, bench.detectors = bench.rows, bench.detectors, [], swept
    for value in parsed:
        bench.run(protocol, [dataset], seeds=seeds, probe_size=probe_size, options={key: value},
                  extra={"settings": {key: value}})
    bench.detectors = everyone
    metrics = ("accuracy", "precision", "recall", "f1", "auroc")
    lines = [f"## {key} sweep: {dataset}, {protocol} (mean over {len(seeds) if protocol != 'kfold' else 5} runs)",
             "", "| detector | " + key + " | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 2) + "|"]
    for det in swept:
        for value in parsed:
            rows = [r for r in bench.rows if r["detector"] == det and r["settings"][key] == value]
            lines.append(f"| {det} | {value} | " + " | ".join(f"{np.mean([r[m] for r in rows]):.3f}"
                                                            for m in metrics) + " |")
    bench.rows = keep + bench.rows
    return lines
