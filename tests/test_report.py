"""`halwatch report` on real scores: what `halwatch score` returned for 50 labelled RAGTruth test answers with the
shipped default (tests/reference/verdicts.json, which test_reference.py keeps equal to what the command returns
today), opened in headless Chromium; its figures checked against ones computed here with scikit-learn."""

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from halwatch.cli import main

REFERENCE = Path(__file__).resolve().parent / "reference" / "verdicts.json"


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """``(scored file, input file, results, labels, generators)`` of the 50 RAGTruth answers."""
    from halwatch.data.jsonl import sample_record
    from halwatch.data.ragtruth import read_ragtruth

    by_id = {s.id: s for s in read_ragtruth(split="test")}
    results = [r for r in json.loads(REFERENCE.read_text())["command"] if r["id"] in by_id]
    folder = tmp_path_factory.mktemp("report")
    scored_path, input_path = folder / "scored.jsonl", folder / "input.jsonl"
    scored_path.write_text("".join(json.dumps(r) + "\n" for r in results))
    input_path.write_text("".join(json.dumps({**sample_record(by_id[r["id"]]), "label": by_id[r["id"]].label,
                                              "meta": {"model": by_id[r["id"]].meta["model"]}}) + "\n"
                                  for r in results))
    labels = np.array([by_id[r["id"]].label for r in results])
    return scored_path, input_path, results, labels, [by_id[r["id"]].meta["model"] for r in results]


def test_the_report_in_headless_chromium(scored, chromium, tmp_path):
    """The page opens offline with no script error and asks for nothing from the network; its three figures draw;
    the flagged share, the AUROC and each generator's share equal those computed here; each highlighted answer's
    marks are its spans, with their confidence on hover."""
    scored_path, input_path, results, labels, models = scored
    out = tmp_path / "report.html"
    assert main(["-q", "report", str(scored_path), "--input", str(input_path), "--by", "model",
                 "--output", str(out)]) == 0
    flagged = np.array([r["hallucinated"] for r in results])
    auroc = roc_auc_score(labels, [r["score"] for r in results])
    page = chromium.new_page()
    errors, requests = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(out.as_uri())
        assert not errors and not [u for u in requests if not u.startswith("file:")]
        for name in ("scores", "roc", "reliability"):
            box = page.locator(f"#figure-{name} svg").bounding_box()
            assert box["width"] > 200 and box["height"] > 200
        share = float(page.get_attribute("#overall [data-share]", "data-share"))
        assert share == pytest.approx(flagged.mean(), abs=1e-6)
        assert page.inner_text('#metrics [data-metric="AUROC"]') == f"{auroc:.3f}"
        rows = page.locator("table").nth(1).locator("tr")  # the second table: by model
        shown = {rows.nth(i).locator("td").nth(0).inner_text(): rows.nth(i).locator("td").nth(3).inner_text()
                 for i in range(1, rows.count())}
        for model in set(models):
            mine = flagged[[m == model for m in models]]
            assert shown[model] == f"{100 * mine.mean():.1f} %"
        answers = page.locator(".answer")
        checked = 0
        for i in range(answers.count()):
            result = next(r for r in results if r["id"] == answers.nth(i).get_attribute("data-id"))
            marks = answers.nth(i).locator("mark")
            assert [marks.nth(k).inner_text() for k in range(marks.count())] == [s["text"] for s in result["spans"]]
            assert [marks.nth(k).get_attribute("title") for k in range(marks.count())] == [
                f"confidence {s['confidence']:.2f}" for s in result["spans"]]
            checked += bool(result["spans"])
        assert checked >= 5
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    finally:
        page.close()
    assert (tmp_path / "report.png").stat().st_size > 20_000


def test_markdown_report_and_bad_input_write_nothing(scored, tmp_path, capsys):
    """`--format md` (or a .md output) writes Markdown with its PNG figures beside it; a record that is not a scored
    result, an answer the input lacks, or a --by field no answer has stops the command with one line naming it, and
    nothing is written."""
    scored_path, input_path, results, labels, _ = scored
    out = tmp_path / "r.md"
    assert main(["-q", "report", str(scored_path), "--input", str(input_path), "--output", str(out)]) == 0
    text = out.read_text()
    assert f"**{sum(r['hallucinated'] for r in results)}** flagged" in text
    assert f"{roc_auc_score(labels, [r['score'] for r in results]):.3f}" in text
    assert all((tmp_path / f"r-{name}.png").stat().st_size > 5_000 for name in ("scores", "roc", "reliability"))
    # without --input: no labels, no context; the figures of the scores alone
    assert main(["-q", "report", str(scored_path), "--output", str(tmp_path / "alone.html")]) == 0
    alone = (tmp_path / "alone.html").read_text()
    assert 'id="figure-scores"' in alone and 'id="figure-roc"' not in alone and "give --input" in alone

    bad = tmp_path / "bad.jsonl"
    lines = scored_path.read_text().splitlines()
    cases = [
        (lines[:3] + ['{"id": "x", "score": "high"}'] + lines[3:], [], "bad.jsonl:4 (id=x): not a scored result"),
        (lines[:2] + ["not json"], [], "bad.jsonl:3: not valid JSON"),
        (lines + [json.dumps({**results[0], "id": "elsewhere"})], [], "id=elsewhere: no answer with this id"),
        (lines, ["--by", "route"], "--by route: no answer has this field"),
    ]
    capsys.readouterr()
    bad.write_text("")
    before = set(tmp_path.iterdir())
    for content, extra, message in cases:
        bad.write_text("\n".join(content) + "\n")
        target = tmp_path / "never.html"
        assert main(["-q", "report", str(bad), "--input", str(input_path), *extra, "--output", str(target)]) == 2
        assert message in capsys.readouterr().err
        assert set(tmp_path.iterdir()) == before  # nothing written, nothing left half-written
