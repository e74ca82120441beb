"""The `halwatch` command end to end, as a user runs it (real model, shipped default artifact)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from halwatch.data.jsonl import write_jsonl
from halwatch.eval.metrics import span_scores


def run(*args, check=True):
    """The installed entry point in a process of its own (`python -m halwatch`): the other tests run the command in
    this process (the ``halwatch`` fixture), which skips 13-18 s of imports and model loading per command."""
    proc = subprocess.run([sys.executable, "-m", "halwatch", *args], capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


CONTEXT = "Insulin is a peptide hormone produced by beta cells of the pancreatic islets."


def test_score_one_answer():
    out = run("score", "--no-cache", "--context", CONTEXT, "--question", "Which cells produce insulin?",
              "--response", "Insulin is produced by red blood cells in the bone marrow.")
    result = json.loads(out.stdout)
    assert set(result) == {"id", "score", "hallucinated", "threshold", "spans", "offset_unit", "detector",
                           "scoring_model", "input_mode", "truncated", "windows", "ood", "task"}
    assert result["offset_unit"] == "unicode_code_point"
    assert set(result["ood"]) == {"distance", "percentile", "extrapolated", "weak", "held_out_auroc"}
    assert result["ood"]["weak"] is False and 0.7 <= result["ood"]["held_out_auroc"] < 1  # the qa part's
    assert 0 <= result["score"] <= 1 and result["scoring_model"] == "smollm2-135m" and result["input_mode"] == "raw"
    for span in result["spans"]:
        assert "Insulin is produced by red blood cells in the bone marrow."[span["start"] : span["end"]] == span["text"]


def test_score_file_fit_and_bad_input(tmp_path, probe_by_size, halwatch):
    # the probe's shortest answers: each context fits the cap, one forward pass per answer (windows: test_windows.py)
    by_size = probe_by_size
    few = by_size[:4]
    fit_on = [s for s in by_size if s.label][:6] + [s for s in by_size if not s.label][:6]
    data = tmp_path / "in.jsonl"
    write_jsonl(data, [s.to_dict() for s in few])
    out = tmp_path / "out.jsonl"
    loud = halwatch("score", "--input", str(data), "--output", str(out), "--no-cache", "--max-tokens", "512")
    assert "scored 4 responses" in loud.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in few]

    # fit an artifact with the command, then score with it
    train = tmp_path / "train.jsonl"
    names = ["a", "b"] * 6  # a `dataset` field: each dataset's grounded answers weigh the same under mean-fpr
    write_jsonl(train, [{**s.to_dict(), "dataset": name} for s, name in zip(fit_on, names)])
    art = tmp_path / "ppl.json"
    fitted = halwatch("fit", "--detector", "perplexity", "--input", train, "--output", art, "--max-tokens", "512",
                      "--set", "decision=mean-fpr=0.2")
    fitted_on = json.loads(art.read_text())["fitted_on"]
    assert fitted_on["n"] == 12 and "span rule: gap " in fitted.stderr
    share = fitted_on["span_fit"]["grounded_with_span"]
    assert f"a span in {share:.0%} of the grounded ones" in fitted.stderr
    # the span F1 the fit reports (perplexity is unsupervised: its probe scores are the artifact's own) is the
    # benchmark's character F1 of the spans `score` gives on the same answers
    scored = tmp_path / "train-scored.jsonl"
    quiet = halwatch("-q", "score", "--input", str(train), "--output", str(scored), "--detector", str(art))
    assert quiet.stderr == ""  # -q: nothing but errors on standard error (no progress bar, no status line)
    rows = [json.loads(line) for line in scored.read_text().splitlines()]
    gold = [s.spans for s in fit_on]
    assert span_scores([r["spans"] for r in rows], gold)["span_f1"] == pytest.approx(fitted_on["span_fit"]["f1"],
                                                                                    abs=1e-4)
    assert all(r["detector"] == "perplexity" for r in rows)
    # each dataset's operating point in the artifact is what `score`'s verdicts give on its answers
    labels = [s.label for s in fit_on]
    by_dataset = fitted_on["by_dataset"]
    for name in ("a", "b"):
        flags = [r["hallucinated"] for r, y, n in zip(rows, labels, names) if n == name and y == 0]
        assert by_dataset[name]["fpr"] == pytest.approx(sum(flags) / len(flags), abs=1e-4)
    assert (by_dataset["a"]["fpr"] + by_dataset["b"]["fpr"]) / 2 <= 0.2 and "at the threshold" in fitted.stderr

    # a bad record: one-line error naming it, exit 2, nothing written
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + '{"id": "broken", "prompt": "p"}\n')
    out3 = tmp_path / "out3.jsonl"
    proc = halwatch("score", "--input", str(bad), "--output", str(out3), "--no-cache", "--max-tokens", "512",
                    check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"halwatch: error: {bad}:5 (id=broken): missing field 'response'"
    assert not out3.exists()
    proc = halwatch("score", "--input", str(bad), "--output", str(out3), "--max-tokens", "512", "--skip-invalid")
    assert "skipped" in proc.stderr and "id=broken" in proc.stderr
    assert len(out3.read_text().splitlines()) == 4


@pytest.mark.parametrize("args,message", [
    (["score", "--response", "r", "--prompt", "p", "--model", "/no/such/model"], "unknown model '/no/such/model'"),
    (["score", "--response", "r", "--prompt", "p", "--detector", "nope"], "no artifact file 'nope'"),
    # a bad record or setting is refused before the model loads: the unknown model is never reached
    (["score", "--response", "r", "--prompt", "p", "--input-mode", "chat", "--model", "/no/such/model"],
     "fitted with input_mode=raw"),
    (["score", "--response", "", "--prompt", "p", "--model", "/no/such/model"], "empty response"),
    (["score", "--input", "x.jsonl"], "--input needs --output"),
    (["score", "--response", "r", "--prompt", "p", "--min-span-confidence", "1.5"],
     "min_span_confidence must be in [0, 1], not 1.5"),
])
def test_clear_errors(args, message, halwatch):
    proc = halwatch(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["fit", "calibrate"])
def test_unlabelled_records_are_refused_before_the_model_loads(tmp_path, command, halwatch):
    data = tmp_path / "unlabelled.jsonl"
    write_jsonl(data, [{"id": "a", "context": CONTEXT, "question": "q", "response": "r", "label": 0},
                       {"id": "b", "context": CONTEXT, "question": "q", "response": "r"}])
    proc = halwatch(command, "--input", str(data), "--output", str(tmp_path / "out.json"), "--model", "/no/such/model",
                    *(["--detector", "perplexity"] if command == "fit" else []), check=False)
    assert proc.returncode == 2 and not (tmp_path / "out.json").exists()
    assert proc.stderr.strip().splitlines()[-1].endswith("id=b: record has no label: this needs 'label' on every "
                                                         "record")


def test_models_list_shows_the_cached_default(halwatch):
    out = halwatch("models", "list", "--json")
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["smollm2-135m"]["cached"] and rows["smollm2-135m"]["size_mb"] > 100


def test_fit_map_from_carries_lookback_lens_to_another_feature_space(tmp_path, probe_by_size, halwatch):
    """`fit --map-from`: the shipped Lookback Lens (raw input) carried to the chat-template input by a linear map
    fitted on unlabelled answers; the new artifact scores in that mode and names where it came from."""
    data = tmp_path / "unlabelled.jsonl"
    write_jsonl(data, [{k: v for k, v in s.to_dict().items() if k not in ("label", "spans")}
                       for s in probe_by_size[:10]])
    art = tmp_path / "mapped.json"
    halwatch("fit", "--detector", "lookback-lens", "--map-from", "lookback-lens", "--input-mode", "chat",
             "--max-tokens", "512", "--input", str(data), "--output", str(art))
    saved = json.loads(art.read_text())
    assert saved["input_mode"] == "chat" and saved["fitted_on"]["mapped_from"] == "smollm2-135m"
    assert len(saved["state"]["feature_map"]["coef"]) == 270 and saved["fitted_on"]["map_samples"] == 10
    out = halwatch("score", "--detector", str(art), "--context", CONTEXT, "--question", "Which cells produce insulin?",
                   "--response", "Beta cells produce it.")
    assert json.loads(out.stdout)["input_mode"] == "chat"
    bad = halwatch("fit", "--detector", "toha", "--map-from", "lookback-lens", "--input", str(data), "--output",
                   str(tmp_path / "x.json"), check=False)
    assert bad.returncode == 2 and "--map-from needs a lookback-lens artifact" in bad.stderr


def test_a_file_is_scored_a_chunk_at_a_time_with_the_verdicts_of_one_batch(tmp_path, probe, monkeypatch, halwatch):
    """`score --input` holds the signals of `CHUNK` views at a time, so that memory stays flat on a long file: the
    verdicts are those of the whole file in one batch, in input order, and the windows of a long context (a 256-token
    cap cuts these contexts into several) stay together in one chunk even where they outnumber it."""
    from halwatch import pipeline

    short = [s for s in probe if len(s.response) < 400]  # responses that leave room for context under the cap
    chosen = short[:3] + short[-2:]
    data = tmp_path / "in.jsonl"
    write_jsonl(data, [s.to_dict() for s in chosen])
    outputs = []
    for chunk in (10_000, 3):
        monkeypatch.setattr(pipeline, "CHUNK", chunk)
        out = tmp_path / f"out-{chunk}.jsonl"
        halwatch("-q", "score", "--input", data, "--output", out, "--max-tokens", "256")
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outputs[1] == outputs[0]
    assert [r["id"] for r in outputs[1]] == [s.id for s in chosen]
    assert max(r["windows"] for r in outputs[1]) > 3  # one answer's windows are more than a chunk


def test_data_ragtruth_limit_is_a_prefix_of_one_shuffle(tmp_path, halwatch):
    ids = {}
    for n in (5, 12):
        out = tmp_path / f"rt-{n}.jsonl"
        halwatch("data", "ragtruth", "--generator", "llama-2-7b-chat", "--split", "test", "--limit", n, "--output", out)
        ids[n] = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids[5]) == 5 and len(ids[12]) == 12 and set(ids[5]) < set(ids[12])
    from halwatch.data.ragtruth import read_ragtruth

    position = {s.id: i for i, s in enumerate(read_ragtruth(generator="llama-2-7b-chat", split="test"))}
    assert [position[i] for i in ids[12]] == sorted(position[i] for i in ids[12])  # file order kept


def _users_answers(tmp_path):
    """A user's 27 labelled short answers (19 grounded first, then 8 made up; SQuAD-built), as a JSONL file."""
    from halwatch.data.shapes import build_squad_shapes

    shapes = [s for s in build_squad_shapes(n_questions=40, n_unanswerable=10, seed=7)
              if s.meta["shape"] in ("phrase", "phrase-swap", "unanswerable")]
    grounded = [s for s in shapes if s.label == 0][:19]
    made_up = [s for s in shapes if s.label == 1][:8]
    data = tmp_path / "mine.jsonl"
    write_jsonl(data, [s.to_dict() for s in grounded + made_up])
    return data


def test_calibrate_holds_the_asked_rate_on_the_answers_it_saw(tmp_path, halwatch):
    """`halwatch calibrate --target-fpr`: scored with the written artifact, the calibration answers' grounded ones
    above the threshold number exactly what split-conformal allows (n0 - ceil((n0 + 1)(1 - a))), and the command
    prints the guarantee with its caveat."""
    import math

    data = _users_answers(tmp_path)
    art = tmp_path / "mine.json"
    out = halwatch("calibrate", "--input", str(data), "--target-fpr", "0.2", "--output", str(art))
    assert "split-conformal" in out.stderr and "exchangeable" in out.stderr
    recal = json.loads(art.read_text())
    qa = recal["parts"]["qa"]  # the default is routed: the QA answers recalibrate its qa part alone
    assert qa["decision"] == "conformal fpr=0.2" and qa["fitted_on"]["recalibrated"]["n"] == 27
    assert qa["fitted_on"]["recalibrated"]["data"].endswith("; scored in float32")  # its thresholds hold for that
    assert recal["fitted_on"]["recalibrated"] == ["qa"]
    scored = tmp_path / "scored.jsonl"
    halwatch("score", "--input", str(data), "--output", str(scored), "--detector", str(art))
    rows = [json.loads(line) for line in scored.read_text().splitlines()]
    flagged_grounded = sum(r["hallucinated"] for r in rows[:19])
    assert flagged_grounded == 19 - math.ceil(20 * 0.8)
    assert all(r["threshold"] == pytest.approx(recal["thresholds"]["qa"], abs=1e-4) for r in rows)


def test_calibrate_prior_restates_probabilities_and_keeps_every_verdict(tmp_path, halwatch):
    """`halwatch calibrate --prior estimate` on unlabelled answers: the share it writes is the maximum of the
    label-shift likelihood of the default's probabilities (Saerens et al. 2002), found here by a bounded scalar
    search instead of EM; the written artifact's probabilities are Bayes' rule for that share, and its verdicts
    and spans are the default's. `--prior 0.3 --task qa` states a share for the QA part alone."""
    from scipy.optimize import minimize_scalar

    data = _users_answers(tmp_path)
    unlabelled = tmp_path / "traffic.jsonl"
    write_jsonl(unlabelled, [{k: v for k, v in json.loads(line).items() if k not in ("label", "spans")}
                             for line in data.read_text().splitlines()])
    art = tmp_path / "restated.json"
    out = halwatch("calibrate", "--prior", "estimate", "--input", str(unlabelled), "--output", str(art))
    assert "estimated from 27 unlabelled answers" in out.stderr and "kept as fitted" in out.stderr
    restated = json.loads(art.read_text())["parts"]["qa"]
    assumed = restated["fitted_on"]["restated"]["assumed"]

    def scored(*detector):
        path = tmp_path / f"scored-{len(detector)}.jsonl"
        halwatch("score", "--input", str(unlabelled), "--output", str(path), *detector)
        return [json.loads(line) for line in path.read_text().splitlines()]

    before, after = scored(), scored("--detector", str(art))
    p = np.array([r["score"] for r in before])
    found = minimize_scalar(lambda q: -np.log(q / assumed * p + (1 - q) / (1 - assumed) * (1 - p)).sum(),
                            bounds=(1e-4, 1 - 1e-4), method="bounded", options={"xatol": 1e-8}).x
    share = restated["calibration"]["prior"]
    assert share == pytest.approx(found, abs=2e-3) and abs(share - assumed) > 0.01
    bayes = share / assumed * p / (share / assumed * p + (1 - share) / (1 - assumed) * (1 - p))
    assert [r["score"] for r in after] == pytest.approx(bayes, abs=2e-4) and np.abs(bayes - p).max() > 0.005
    assert [r["hallucinated"] for r in after] == [r["hallucinated"] for r in before]
    assert [r["spans"] for r in after] == [r["spans"] for r in before]
    stated = tmp_path / "stated.json"
    halwatch("calibrate", "--prior", "0.3", "--task", "qa", "--output", str(stated))
    parts = json.loads(stated.read_text())["parts"]
    assert parts["qa"]["calibration"]["prior"] == 0.3 and parts["summary"]["fitted_on"].get("restated") is None
    bad = halwatch("calibrate", "--prior", "0.3", "--input", str(unlabelled), "--output", str(stated), check=False)
    assert bad.returncode == 2 and "a stated --prior needs no answers" in bad.stderr
    # an artifact written before the share was kept (shipped Lookback Lens): its training answers' share is assumed
    from halwatch.detectors import read_artifact

    halwatch("calibrate", "--detector", "lookback-lens", "--prior", "0.25", "--output", str(stated))
    shipped, moved = read_artifact("lookback-lens"), json.loads(stated.read_text())
    a, t = shipped["fitted_on"]["n_hallucinated"] / shipped["fitted_on"]["n"], shipped["threshold"]
    assert moved["threshold"] == pytest.approx(0.25 / a * t / (0.25 / a * t + 0.75 / (1 - a) * (1 - t)), rel=1e-9)


def test_score_a_summary_without_a_question(tmp_path, halwatch):
    """A record with a context and no question is scored with the summary template (or the --task given)."""
    article = ("The city council of Springfield voted on Tuesday to build a new public library on Main Street. "
               "The library will cost 12 million dollars and open in 2027.")
    from halwatch.sample import SUMMARY_TEMPLATE

    summary = "Springfield will build a new library on Main Street that opens in 2027."
    out = json.loads(halwatch("score", "--no-cache", "--context", article, "--response", summary).stdout)
    same = json.loads(halwatch("score", "--no-cache", "--prompt", SUMMARY_TEMPLATE.format(context=article),
                               "--task", "summary", "--response", summary).stdout)  # a prompt as it is: qa unless told
    assert out["score"] == same["score"] and out["spans"] == same["spans"]
    assert out["task"] == same["task"] == "summary"
    dialogue = json.loads(halwatch("score", "--no-cache", "--context", article, "--question", "Is the library big?",
                                   "--task", "dialogue", "--response", summary).stdout)
    assert dialogue["score"] != out["score"]
    bad = halwatch("score", "--no-cache", "--context", article, "--task", "qa", "--response", "x", check=False)
    assert bad.returncode == 2 and "task 'qa' needs a question" in bad.stderr


def test_bench_kinds_have_their_own_options_and_run_is_the_default(capsys):
    from halwatch.cli import _bench_default_kind, build_parser

    parser = build_parser()
    for kind, foreign in (("speed", "--protocol"), ("serve", "--map-from-model"), ("relevance", "--clients"),
                          ("invariance", "--sweeps"), ("calibration", "--lengths"), ("prior", "--target-fpr")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", kind, "--help"])
        shown = capsys.readouterr().out
        assert f"usage: halwatch bench {kind}" in shown and foreign not in shown
        with pytest.raises(SystemExit):  # an option of another kind is refused, not ignored
            parser.parse_args(["bench", kind, foreign, "x"])
        assert "unrecognized arguments" in capsys.readouterr().err
    # `halwatch bench --protocol ...`, as the published commands.txt files say, is `halwatch bench run ...`
    argv = ["-q", "bench", "--protocol", "dev", "--detectors", "toha", "--datasets", "ragtruth:all"]
    args = parser.parse_args(_bench_default_kind(argv))
    assert args.what == "run" and args.protocol == ["dev"] and args.windows == 8
    assert _bench_default_kind(["bench", "speed", "--lengths", "512"]) == ["bench", "speed", "--lengths", "512"]
    assert parser.parse_args(["bench", "speed", "--lengths", "128", "512"]).lengths == [128, 512]
    with pytest.raises(SystemExit):  # shorter than the timed answer: refused before anything loads
        parser.parse_args(["bench", "speed", "--lengths", "64"])
    assert "at least 128 tokens" in capsys.readouterr().err
    args = parser.parse_args(["bench", "serve", "--detectors", "default", "--clients", "1", "8"])
    assert args.detector == "default" and args.clients == [1, 8]


def test_each_bench_kind_reaches_its_measure_with_its_options(monkeypatch):
    """`halwatch bench KIND` calls the measure of that kind with the options given (the measures themselves are
    tested where they live; here, that the command passes each option to the right one)."""
    from halwatch.cli import main
    from halwatch.eval import calibration_check, invariance

    calls = []
    for module, name in ((calibration_check, "run_calibration_check"), (calibration_check, "run_prior_check"),
                         (invariance, "run_invariance")):
        monkeypatch.setattr(module, name, lambda _name=name, **kw: calls.append((_name, kw)))
    assert main(["-q", "bench", "prior", "--datasets", "begin", "--draws", "7", "--eval-split", "test"]) == 0
    assert main(["-q", "bench", "calibration", "--target-fpr", "0.2", "--seeds", "3", "--dtype", "float32"]) == 0
    assert main(["-q", "bench", "invariance", "--answers", "9", "--out-file", "x.json"]) == 0
    (prior, p), (calibration, c), (inv, i) = calls
    assert (prior, p["datasets"], p["draws"], p["split"]) == ("run_prior_check", ["begin"], 7, "test")
    assert (calibration, c["datasets"], c["target_fpr"], c["seeds"], c["split"]) == (
        "run_calibration_check", ["squad-shapes"], 0.2, 3, "dev")
    assert c["scorer_options"]["dtype"] == "float32" and "target_fpr" not in p and "draws" not in c
    assert (inv, i["n"], i["out"], i["detector"]) == ("run_invariance", 9, "x.json", "default")

def test_scoring_does_not_import_scikit_learn():
    """Every command builds the whole parser and `score` loads the detectors: neither imports scikit-learn (1.4 s
    of every command's start before), which only fitting and the benchmarks' metrics use."""
    code = ("import sys; from halwatch import cli, detectors; from halwatch.detectors import fused, heads; "
            "from halwatch.eval import metrics; cli.build_parser(); print(sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'sklearn'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
