"""The benchmark harness on a few dozen real RAGTruth answers: every protocol end to end, and every reported
number recomputed independently with scikit-learn from the saved predictions."""

import json

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, f1_score, roc_auc_score

from halwatch.data.jsonl import write_jsonl
from halwatch.eval.bench import run_bench
from halwatch.eval.folds import make_splits
from halwatch.eval.protocols import Bench, save_results
from halwatch.eval.report import ranks_and_tests, shape_transfer_table, write_report
from halwatch.scorer import Scorer

# one detector of each kind the harness treats apart: head selection (toha), a supervised probe of attention
# (lookback-lens), an unsupervised attention score (llm-check), token statistics (perplexity) and response length with
# its real ties; test_detectors.py fits every detector
DETECTORS = ["toha", "lookback-lens", "llm-check", "perplexity", "length"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, ragtruth_train):
    from halwatch.data.ragtruth import read_ragtruth

    folder = tmp_path_factory.mktemp("bench-data")
    paths = []
    for gen in ("llama-2-7b-chat", "mistral-7B-instruct"):
        short = [s for s in read_ragtruth(generator=gen) if len(s.response) < 500 and len(s.prompt) < 1500]
        pick = []
        for split, n in (("train", 8), ("test", 4)):
            for label in (0, 1):
                pick += [s for s in short if s.meta["split"] == split and s.label == label][:n]
        path = folder / f"{gen}.jsonl"
        write_jsonl(path, [s.to_dict() for s in pick])
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def bench(smol, signal_cache, scorer):
    """The harness on the session's cache, after the probe's white-box pass (``scorer``): that pass holds the 16
    llama-2-7b-chat training answers of ``datasets``, and serves the harness's request from the cache."""
    return Bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), DETECTORS, progress=False)


def _check_rows_against_sklearn(bench):
    """Every row's figures recomputed from the saved predictions: AUROC and AUC-PR from the ranking score ``raw``
    (which the probabilities never contradict), the verdicts from the probabilities."""
    assert bench.rows
    for row, pred in zip(bench.rows, bench.predictions):
        y, p, raw = np.array(pred["labels"]), np.array(pred["probs"]), np.array(pred["raw"])
        assert row["auroc"] == pytest.approx(roc_auc_score(y, raw), abs=1e-5)
        assert row["auc_pr"] == pytest.approx(average_precision_score(y, raw), abs=1e-5)
        assert np.all(np.diff(p[np.argsort(raw, kind="stable")]) >= -1e-12)
        assert row["n_test"] == len(y) and row["n_pos"] == int(y.sum())
        assert row["trivial_f1"] == pytest.approx(f1_score(y, np.ones_like(y)))
        assert 0 <= row["f1"] <= 1 and 0 <= row["accuracy"] <= 1
        assert set(row) >= {"dataset", "generator", "probe_size", "scoring_model", "input_mode", "detector",
                            "protocol", "seed", "auroc", "auc_pr", "f1", "accuracy", "trivial_f1", "n_test", "n_pos",
                            "seconds", "commit"}


def test_protocols_run_and_numbers_match_sklearn(bench, datasets, tmp_path):
    bench.run("ragtruth-official", datasets, seeds=[0], probe_size=12)
    bench.run("random-splits", datasets[:1], seeds=[0, 1], probe_size=16)  # several seeds
    bench.run("kfold", datasets[:1], seeds=[0])
    bench.run("transfer", datasets, seeds=[0])
    _check_rows_against_sklearn(bench)
    assert all(r["dirty"] == r["commit"].endswith("-dirty") for r in bench.rows)
    assert {(r["protocol"], r["split"]) for r in bench.rows} == {
        ("ragtruth-official", "test"), ("random-splits", "random"), ("kfold", "fold"), ("transfer", "test")}
    protocols = {r["protocol"] for r in bench.rows}
    assert protocols == {"ragtruth-official", "random-splits", "kfold", "transfer"}
    assert {r["detector"] for r in bench.rows} == set(DETECTORS)
    assert {r["dataset"] for r in bench.rows if r["protocol"] == "transfer"} == {
        f"{datasets[0]}->{datasets[1]}", f"{datasets[1]}->{datasets[0]}"}
    # the F1 of a row is that of the detector's fitted threshold: refit one and compare
    samples, labels, views, signals, _ = bench.data(datasets[0])
    seed, probe, test = make_splits("ragtruth-official", samples, [0], 12)[0]
    det, (probs, _) = bench.fit_score("toha", ([signals[i] for i in probe], labels[probe],
                                               [views[i] for i in probe]), [signals[i] for i in test])
    row = next(r for r in bench.rows if r["protocol"] == "ragtruth-official" and r["detector"] == "toha"
               and r["seed"] == 0 and r["dataset"] == datasets[0])
    assert row["f1"] == pytest.approx(f1_score(labels[test], probs >= det.threshold))
    spans = [det.verdicts([views[i]], [signals[i]])[0]["spans"] for i in test]  # and its grounded answers' spans
    clean = [not x for x, i in zip(spans, test) if labels[i] == 0]
    assert row["grounded_without_span"] == pytest.approx(np.mean(clean))
    save_results(tmp_path, bench.rows, bench.predictions)
    save_results(tmp_path, bench.rows, bench.predictions)  # a rerun replaces, never duplicates
    assert len(json.loads((tmp_path / "results.json").read_text())) == len(bench.rows)
    report = write_report(tmp_path).read_text()
    assert "## ragtruth-official, probe 12, input mode raw" in report and "Average AUROC rank" in report
    # every row and the report name the precision the signals were made in (the session's pin: float32)
    assert {r["dtype"] for r in bench.rows} == {"float32"} and "smollm2-135m / raw / float32 / " in report
    assert list(tmp_path.glob("roc-*.png")) and list(tmp_path.glob("transfer-*.png"))
    # no AUROC rests on tied scores: the ranking score of a continuous detector has (almost) no ties (response
    # length counts tokens, so its ties are real)
    for pred in bench.predictions:
        if pred["detector"] != "length":
            raw = np.array(pred["raw"])
            assert 1 - len(np.unique(raw)) / len(raw) < 0.01, pred["detector"]


def test_shape_transfer_holds_each_dataset_out_in_turn(smol, signal_cache, datasets):
    """Shape transfer: the included model is fitted on every dataset's training part, each held-out row comes from
    a model that never saw that dataset: equal to a detector fitted here on the other dataset alone."""
    from halwatch.data.splits import split_of

    bench = Bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), ["lookback-lens", "length"],
                  progress=False)
    bench.run("shape-transfer", datasets, eval_split="test")
    rows = {(r["dataset"], r["detector"], r["settings"]["training"]): r for r in bench.rows}
    assert set(rows) == {(d, det, t) for d in datasets for det in ("lookback-lens", "length")
                         for t in ("included", "held-out")}
    a, b = datasets
    samples, labels, views, signals, _ = bench.data(b)
    fit = [i for i, s in enumerate(samples) if split_of(s) in ("train", "dev")]
    samples_a, labels_a, _, signals_a, _ = bench.data(a)
    test = [i for i, s in enumerate(samples_a) if split_of(s) == "test"]
    _, (probs, ranking) = bench.fit_score("lookback-lens", ([signals[i] for i in fit], labels[fit],
                                                            [views[i] for i in fit]), [signals_a[i] for i in test])
    assert rows[(a, "lookback-lens", "held-out")]["auroc"] == pytest.approx(roc_auc_score(labels_a[test], ranking))
    assert rows[(a, "lookback-lens", "included")]["n_test"] == len(test)


def test_shape_transfer_never_trains_on_the_never_datasets(smol, signal_cache, datasets):
    """A dataset named in ``never`` is only scored, by the model fitted on the others: one row, marked "never",
    equal to a length detector fitted here on the other dataset's training part alone."""
    from halwatch.data.splits import split_of

    bench = Bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), ["length"], progress=False)
    a, b = datasets
    bench.run("shape-transfer", [b], eval_split="test", never=[a])
    rows = {(r["dataset"], r["settings"]["training"]): r for r in bench.rows}
    assert set(rows) == {(b, "included"), (a, "never")}  # b alone is trained on: it has no held-out row
    samples, labels, views, signals, _ = bench.data(b)
    fit = [i for i, s in enumerate(samples) if split_of(s) in ("train", "dev")]
    samples_a, labels_a, _, signals_a, _ = bench.data(a)
    test = [i for i, s in enumerate(samples_a) if split_of(s) == "test"]
    _, (_, ranking) = bench.fit_score("length", ([signals[i] for i in fit], labels[fit], [views[i] for i in fit]),
                                      [signals_a[i] for i in test])
    assert rows[(a, "never")]["auroc"] == pytest.approx(roc_auc_score(labels_a[test], ranking))
    assert rows[(a, "never")]["n_test"] == len(test)
    bench.rows = []
    bench.run("shape-transfer", [a, b], eval_split="test", hold_out=[b])
    assert {(r["dataset"], r["settings"]["training"]) for r in bench.rows} == {(a, "included"), (b, "included"),
                                                                              (b, "held-out")}
    bench.rows = []
    bench.run("shape-transfer", [a, b], eval_split="test", hold_out=[])  # `--hold-out` alone: the pooled fit only
    assert {(r["dataset"], r["settings"]["training"]) for r in bench.rows} == {(a, "included"), (b, "included")}


def test_an_artifact_is_scored_as_it_is_and_never_on_its_own_training_split(smol, signal_cache, datasets, tmp_path):
    """``--artifacts``: a saved artifact scored with no refit gives the rows of the same detector fitted by the bench
    on the same answers (its probabilities too), the datasets it was not trained on marked "never"; an artifact
    fitted on the split to be scored of a dataset scored, or one that does not say what it was fitted on, is
    refused."""
    from halwatch.data.splits import split_of
    from halwatch.errors import InputError

    scorer = Scorer(model=smol, max_tokens=512, cache=signal_cache)
    a, b = datasets
    fitted = Bench(scorer, ["length"], progress=False)
    fitted.run("shape-transfer", [b], eval_split="test", never=[a])
    samples, labels, views, signals, _ = fitted.data(b)
    train = [i for i, s in enumerate(samples) if split_of(s) in ("train", "dev")]
    det, _ = fitted.fit_score("length", ([signals[i] for i in train], labels[train], [views[i] for i in train]), [])
    det.fitted_on["data"] = f"{b}: split train+dev"  # as `halwatch fit --datasets B --split train+dev` records it
    path = tmp_path / "length.json"
    det.save(path)

    shipped = Bench(scorer, [], progress=False)
    shipped.run("shape-transfer", [a, b], eval_split="test", artifacts=[str(path)])
    rows = {(r["dataset"], r["settings"]["training"]): r for r in shipped.rows}
    assert set(rows) == {(b, "included"), (a, "never")}
    for key, row in rows.items():
        reference = next(r for r in fitted.rows if (r["dataset"], r["settings"]["training"]) == key)
        assert row["detector"] == str(path) and row["settings"]["fitted_on"] == f"{b}: split train+dev"
        for metric in ("auroc", "fpr", "tpr", "f1", "ece", "n_test"):
            assert row[metric] == pytest.approx(reference[metric]), (key, metric)
        assert row["length_auroc"] == pytest.approx(reference["auroc"])  # length ranks by the same token counts
    line = next(x for x in shape_transfer_table(shipped.rows) if x.startswith(f"| {b} |"))
    assert f"| {rows[(b, 'included')]['length_auroc']:.3f} | {rows[(b, 'included')]['auroc']:.3f} |" in line
    by_set = {p["dataset"]: p["probs"] for p in shipped.predictions}
    for p in fitted.predictions:
        assert by_set[p["dataset"]] == pytest.approx(p["probs"])

    with pytest.raises(InputError, match="fitted on the train\\+dev split .* would read its own training answers"):
        shipped.run("shape-transfer", [b], eval_split="dev", artifacts=[str(path)])
    assert shipped._shipped(str(path), "dev", [a])[1] == {b}  # a set it never saw: any split may be scored
    added = json.loads(path.read_text())  # a part fitted on A put in later (`halwatch fit --into`) names its data
    added["fitted_on"]["parts"] = {"summary": {"n": 10, "data": f"{a}: split train+dev"}}
    (tmp_path / "added.json").write_text(json.dumps(added))
    _, trained_on, described = shipped._shipped(str(tmp_path / "added.json"), "test", [a, b])
    assert trained_on == {a, b} and described == [f"{b}: split train+dev", f"{a}: split train+dev"]
    with pytest.raises(InputError, match=f"fitted on the train\\+dev split of {a}: "):
        shipped._shipped(str(tmp_path / "added.json"), "dev", [a])
    unsaid = json.loads(path.read_text())
    unsaid["fitted_on"]["data"] = "my-answers.jsonl"  # `halwatch fit --input FILE`: no split named
    (tmp_path / "unsaid.json").write_text(json.dumps(unsaid))
    with pytest.raises(InputError, match="does not say which datasets and split"):
        shipped.run("shape-transfer", [b], eval_split="test", artifacts=[str(tmp_path / "unsaid.json")])
    with pytest.raises(InputError, match="shape-transfer only"):
        shipped.run("official", [b], artifacts=[str(path)])


def test_the_fit_data_text_names_its_datasets_and_split_after_any_description():
    """``halwatch fit --datasets ... --split ... --describe TEXT`` records the user's text and still the datasets and
    split the bench reads back (an artifact fitted with --describe was unreadable to the bench before); a file's
    name or free text names none."""
    from halwatch.data.splits import describe_fit_data, fit_data_of

    said = "RAGTruth QA (ragtruth:all), split train; my notes"
    assert fit_data_of(describe_fit_data(["ragtruth:all"], "train", said)) == ({"ragtruth:all"}, ["train"])
    assert describe_fit_data(["ragtruth:all"], "train", said).startswith(said)
    assert fit_data_of(describe_fit_data(["begin", "squad-shapes"], "train+dev")) == ({"begin", "squad-shapes"},
                                                                                     ["train", "dev"])
    for text in ("answers.jsonl", said, "RAGTruth QA, official train split", ""):
        assert fit_data_of(text) is None, text


def test_every_split_keeps_a_source_on_one_side():
    """Two generators' answers to one RAGTruth source never sit on both sides of a split, under any protocol."""
    from halwatch.data.splits import split_of
    from halwatch.eval.datasets import load_dataset

    samples, _ = load_dataset("ragtruth:llama-2-7b-chat+mistral-7B-instruct")
    sources = np.array([s.source for s in samples])
    for protocol, size in (("dev", None), ("official", None), ("random-splits", 100), ("kfold", None)):
        for _, probe, test in make_splits(protocol, samples, [0, 1], size):
            assert not set(sources[probe]) & set(sources[test]), protocol
    _, probe, test = make_splits("dev", samples, [0])[0]
    assert {split_of(samples[i]) for i in probe} == {"train"} and {split_of(samples[i]) for i in test} == {"dev"}
    assert {samples[i].meta["split"] for i in make_splits("official", samples, [0])[0][2]} == {"test"}


def test_published_results_come_from_clean_trees():
    """A row of docs/results made from a tree with uncommitted changes is not a result: every folder that still
    holds such rows (from before this rule) is named as history under "Rows from uncommitted trees" in
    docs/results/README.md, and the shape-transfer tables (the verdicts' figures) hold none."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "docs" / "results"
    readme = (folder / "README.md").read_text()
    assert "## Rows from uncommitted trees" in readme
    declared = readme.split("## Rows from uncommitted trees", 1)[1].split("\n## ", 1)[0]
    shapes = 0
    for path in folder.glob("**/results.json"):
        rows = json.loads(path.read_text())
        dirty = [r for r in rows if str(r.get("commit", "")).endswith("-dirty") or r.get("dirty")]
        if dirty:
            assert f"({path.parent.relative_to(folder).as_posix()}/" in declared, path
        shapes += sum(r["protocol"] == "shape-transfer" for r in rows)
        # every row says which split its figures were read on, and a shape-transfer row's agrees with its settings
        assert all(r.get("split") in ("test", "dev", "random", "fold") for r in rows), path
        assert all(r["split"] == r["settings"]["eval"] for r in rows
                   if r["protocol"] == "shape-transfer" and "eval" in r.get("settings", {})), path
        assert not [r for r in dirty if r["protocol"] == "shape-transfer"], path
    assert shapes


def test_splits_are_disjoint_and_stratified(datasets):
    from halwatch.eval.datasets import load_dataset

    samples, _ = load_dataset(datasets[0])
    for protocol, size in (("ragtruth-official", 12), ("random-splits", 16), ("kfold", None)):
        seen_test = []
        for seed, probe, test in make_splits(protocol, samples, [0, 1], size):
            assert not set(probe) & set(test)
            assert {samples[i].label for i in probe} == {0, 1}
            seen_test += list(test)
        if protocol == "kfold":
            assert sorted(seen_test) == list(range(len(samples)))  # every sample tested exactly once


def test_ranks_and_holm():
    rows = [{"dataset": d, "seed": s, "detector": m, "auroc": a + 0.01 * s}
            for d in ("a", "b") for s in range(5) for m, a in (("good", 0.8), ("bad", 0.6), ("mid", 0.7))]
    avg, tests = ranks_and_tests(rows)
    assert avg == {"good": 1.0, "mid": 2.0, "bad": 3.0}
    holm = [t["p_holm"] for t in tests]
    assert holm == sorted(holm) and all(t["p_holm"] >= t["p"] for t in tests)


def test_paired_bootstrap():
    """Each resample's AUROC equals scikit-learn's on the same resampled answers; a detector compared with itself
    differs by exactly 0 (p = 1); a perfect ranking beats a random one with a tiny p and an interval above 0."""
    from halwatch.eval.metrics import _aurocs, paired_bootstrap

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 120)
    noisy = labels + rng.normal(0, 1.0, 120)
    index = rng.integers(0, 120, size=(5, 120))
    expected = [roc_auc_score(labels[i], noisy[i]) for i in index]
    np.testing.assert_allclose(_aurocs(labels, noisy, index), expected, atol=1e-12)
    stats = paired_bootstrap(labels, {"perfect": labels + 0.0, "noisy": noisy, "same": noisy}, "noisy",
                             n_boot=500)
    assert stats["same"]["diff"] == 0 and stats["same"]["diff_ci"] == [0.0, 0.0]
    assert stats["perfect"]["p"] < 0.01 and stats["perfect"]["diff_ci"][0] > 0
    low, high = stats["noisy"]["ci"]
    assert low < stats["noisy"]["auroc"] < high


def test_bench_command_with_sweeps(datasets, tmp_path, signal_cache, smol, monkeypatch):
    import halwatch.eval.bench as bench_mod

    monkeypatch.setattr(bench_mod, "PROBE_SIZES", (6, 12))
    monkeypatch.setattr(bench_mod, "N_MAX", (1, 3))
    run_bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), ["toha", "toha:n_max=2", "length"],
              ["ragtruth-official"], datasets, tmp_path / "out", seeds=2, probe_size=12, sweeps=True,
              sweep="n_max=4,6", map_from_model="smollm2-135m", command="halwatch bench (test)")
    out = tmp_path / "out"
    assert "halwatch bench (test)" in (out / "report.md").read_text()
    for fig in ("auroc-vs-probe-size.png", "auroc-vs-nmax.png", "delta-scatter.png"):
        assert (out / fig).stat().st_size > 1000
    rows = json.loads((out / "results.json").read_text())
    assert {r["settings"]["n_max"] for r in rows if "n_max" in r.get("settings", {})} == {1, 3, 4, 6}
    # a detector spec is a variant with its own rows; --sweep runs the detectors that have the setting
    assert {r["detector"] for r in rows if not r.get("settings")} >= {"toha", "toha:n_max=2", "length"}
    table = (out / "sweep-n_max.md").read_text()
    assert "| toha | 4 |" in table and "| toha:n_max=2 | 6 |" in table and "| length |" not in table
    mapped = [r for r in rows if r["detector"] == "lookback-lens<-smollm2-135m"]  # Lookback Lens carried over
    assert len(mapped) == 2 * len(datasets) and all(0 <= r["auroc"] <= 1 and "span_f1" in r for r in mapped)


def test_requests_outside_the_whitebox_pass_get_their_own(bench, datasets):
    from halwatch.models.signal_types import SignalRequest

    covered = bench.data(datasets[0], SignalRequest(token_stats=True))[3]
    assert covered is bench.data(datasets[0])[3]  # the shared pass serves what it covers
    request = SignalRequest(heads=((21, 6),), attention_from="all", reducers=("mst",))
    own = bench.data(datasets[0], request)[3]
    assert own is not covered and all(s.reduced["mst.d"].shape == (1,) for s in own)


def test_ripser_comparison_agrees():
    import numpy as np

    from halwatch.eval.speed import ripser_comparison

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 20, 50))
    logits[:, np.arange(20)[:, None] < np.arange(50)[None, :] - 30] = -np.inf  # causal: row r sees 30 + r + 1
    rows = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    result = ripser_comparison(rows, 30, out=lambda m: None)
    assert result["max_diff"] < 1e-6


def test_sampling_baselines_under_a_protocol(smol, signal_cache, datasets):
    """Sampling baselines run under a protocol like any detector: their samples are drawn only for the answers the
    protocol uses, and the rows match scikit-learn."""
    options = {d: {"n_samples": 2, "max_new_tokens": 6} for d in ("eigenscore", "selfcheck-ngram", "ln-entropy")}
    bench = Bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), list(options), options, progress=False)
    bench.run("ragtruth-official", datasets[:1], seeds=[0], probe_size=8)
    _check_rows_against_sklearn(bench)
    assert {r["detector"] for r in bench.rows} == set(options)
    signals = next(v for k, v in bench._data[datasets[0]][4].items() if k.sampling is not None)
    _, probe, test = make_splits("ragtruth-official", bench.data(datasets[0], needed=())[0], [0], 8)[0]
    used = {i for i, s in enumerate(signals) if s is not None}
    assert used == set(probe) | set(test) and len(used) < len(signals)  # not the other training answers


def test_a_fit_the_answers_cannot_make_skips_its_rows_and_says_why(smol, signal_cache, datasets, caplog):
    """A routed detector whose fallback task has no answers in the training data (two QA sets, fallback summary)
    is refused at each fit: the bench says so in one line per fit and still gives the other detectors' rows."""
    bench = Bench(Scorer(model=smol, max_tokens=512, cache=signal_cache), ["routed", "length"],
                  options={"routed": {"fallback": "summary"}}, progress=False)
    with caplog.at_level("WARNING", logger="halwatch"):
        bench.run("shape-transfer", datasets, eval_split="test")
    rows = {(r["dataset"], r["detector"], r["settings"]["training"]) for r in bench.rows}
    assert rows == {(d, "length", t) for d in datasets for t in ("included", "held-out")}
    skipped = [r.getMessage() for r in caplog.records if "not fitted, its rows skipped" in r.getMessage()]
    assert len(skipped) == 3  # the pooled fit and one held-out fit per dataset
    assert all(m.startswith("routed fitted on every dataset") and "fallback task 'summary'" in m for m in skipped)
