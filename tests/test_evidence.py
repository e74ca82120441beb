"""Evidence (issue 76) on the real default model: the captured attention equals transformers' own eager attention of
the same heads, the sources point into the gold SQuAD sentence and into the right window of a long context, a flagged
sentence has none, batched, windowed and one-by-one evidence are equal, and the command, the service, the guard and
the page give it."""

import json

import numpy as np
import pytest

import halwatch
from halwatch import evidence
from halwatch.checker import as_sample
from halwatch.data.shapes import build_squad_shapes
from halwatch.data.squad import read_squad
from halwatch.errors import InputError
from halwatch.models import forward
from halwatch.models.signal_types import SignalRequest
from halwatch.scorer import Scorer
from halwatch.tokens import encode

EIFFEL = {"context": "The Eiffel Tower was completed in 1889 for the World's Fair. It stands on the Champ de Mars in "
                     "Paris. Gustave Eiffel's company designed and built it. The tower is 330 metres tall.",
          "question": "Who built the Eiffel Tower, and how tall is it?"}


@pytest.fixture(scope="module")
def grounded():
    """Six grounded SQuAD-built answers (the gold sentence copied) with the start of SQuAD's gold answer, shortest
    passages first, one per article."""
    starts = {q.id: q.answer_starts[0] for q in read_squad() if q.answer_starts}
    found, titles = [], set()
    shapes = [s for s in build_squad_shapes() if s.meta["shape"] == "sentence"]
    for s in sorted(shapes, key=lambda s: len(s.context)):
        if s.meta["title"] not in titles and s.context.count(". ") >= 3:
            found.append((s, starts[s.meta["question_id"]]))
            titles.add(s.meta["title"])
    return found[:6]


def test_the_captured_evidence_equals_eager_attention(smol):
    """The summed attention rows of the evidence heads, captured in the pass, equal what transformers' own eager
    attention (output_attentions=True) gives for the same heads, rows of the response tokens, prompt columns."""
    import torch
    from transformers import AutoModelForCausalLM

    heads = evidence.evidence_heads(smol)
    assert len(heads) == 27 and all(0 <= layer < smol.n_layers for layer, _ in heads)
    sample = as_sample({**EIFFEL, "response": "Gustave Eiffel's company built it."}, 0)
    view = encode(sample, smol.tokenizer)
    got = forward.run(smol, [view], SignalRequest(evidence_heads=heads))[0].evidence
    eager = AutoModelForCausalLM.from_pretrained(smol.path, attn_implementation="eager", dtype=torch.float32)
    with torch.inference_mode():
        maps = eager(torch.tensor([view.input_ids]), output_attentions=True).attentions
    expected = sum(maps[layer][0, head, view.n_prompt:, :view.n_prompt] for layer, head in heads).numpy()
    assert got.shape == (view.n_response, view.n_prompt)
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_prompt_offsets_name_each_tokens_characters(smol):
    """Every prompt token's characters, in raw and chat mode, hold the token's own text."""
    sample = as_sample({**EIFFEL, "response": "It is 330 metres tall."}, 0)
    for mode in ("raw", "chat"):
        view = encode(sample, smol.tokenizer, mode)
        offsets = evidence.prompt_offsets(view, smol.tokenizer)
        inside = [(t, a, b) for t, (a, b) in zip(view.input_ids, offsets) if a >= 0]
        assert len(inside) >= len(smol.tokenizer(sample.prompt)["input_ids"]) - 2  # the template's own: outside
        for token, a, b in inside:
            assert smol.tokenizer.decode([token]).strip() == sample.prompt[a:b].strip()


def test_sources_point_at_the_gold_sentence_and_a_flagged_sentence_has_none(hw, grounded):
    results = hw.check_many([s for s, _ in grounded], evidence="attention")
    hits = 0
    for (sample, start), result in zip(grounded, results):
        assert result.evidence and result.evidence[0].text == sample.response.strip()
        for sentence in result.evidence:
            assert sample.response[sentence.start:sentence.end] == sentence.text and 0 <= sentence.support <= 1
            for source in sentence.sources:
                assert source.field == "context" and sample.context[source.start:source.end] == source.text
            assert [s.weight for s in sentence.sources] == sorted((s.weight for s in sentence.sources), reverse=True)
        top = result.evidence[0].sources[0]
        hits += top.start <= start < top.end
    assert hits >= 5, f"{hits} of {len(grounded)} top sources hold the gold answer"
    flagged = hw.check(**EIFFEL, response="Gustave Eiffel's company built it. The tower is 500 metres tall and "
                                          "was designed by Le Corbusier.", evidence="attention")
    first, second = flagged.evidence
    assert first.supported and "Gustave Eiffel's company" in first.sources[0].text
    assert not second.supported and second.sources == [] and second.support < first.support
    assert any(first.end <= span.start for span in flagged.spans)


def test_evidence_batched_windowed_and_one_by_one_are_equal(smol, grounded):
    """A long context (the gold passage, then other passages after it) that a 256-token cap cuts into windows: the
    source lies in the gold sentence, which only the first window holds; and batched, one-per-pass and one-by-one
    evidence are equal."""
    hw = halwatch.load(model=smol, max_tokens=256)
    (sample, start), others = grounded[0], [s for s, _ in grounded[1:4]]
    long_context = "\n\n".join([sample.context] + [s.context for s in others])
    records = [{"id": "long", "context": long_context, "question": sample.question, "response": sample.response}] + [
        {"id": s.id, "context": s.context, "question": s.question, "response": s.response} for s in others[:2]]
    batched = hw.check_many(records, batch_size=None, evidence="attention")
    single = hw.check_many(records, batch_size=1, evidence="attention")
    alone = [hw.check(**r, evidence="attention") for r in records]
    assert batched[0].windows > 1
    top = batched[0].evidence[0].sources[0]
    assert top.start <= start < top.end and long_context[top.start:top.end] == top.text

    def plain(result):
        return [(s.start, s.end, s.supported, pytest.approx(s.support, abs=1e-3),
                 [(x.start, x.end, pytest.approx(x.weight, abs=2e-3)) for x in s.sources]) for s in result.evidence]

    for a, b, c in zip(batched, single, alone):
        assert plain(b) == plain(a) and plain(c) == plain(a)


def test_relevance_evidence_and_bad_modes(hw):
    found = hw.check(**EIFFEL, response="Gustave Eiffel's company built it.", evidence="relevance")
    assert "Gustave Eiffel's company" in found.evidence[0].sources[0].text
    assert hw.check(**EIFFEL, response="It is 330 metres tall.").evidence is None  # off unless asked
    with pytest.raises(InputError, match="unknown evidence mode 'nope'"):
        hw.check(**EIFFEL, response="It is tall.", evidence="nope")


def test_the_evidence_heads_are_the_top_lookback_heads(smol, grounded):
    """choose_heads is the top tenth of the heads by mean lookback ratio, here computed instead from transformers'
    eager attention maps through the formula's NumPy reference (halwatch.signals.lookback.lookback_ratios)."""
    import torch
    from transformers import AutoModelForCausalLM

    from halwatch.signals.lookback import lookback_ratios

    scorer = Scorer(model=smol, cache=None)
    samples = [s for s, _ in grounded[:2]]
    chosen = evidence.choose_heads(scorer, samples)
    eager = AutoModelForCausalLM.from_pretrained(smol.path, attn_implementation="eager", dtype=torch.float32)
    ratios = []
    for s in samples:
        view = scorer.encode(s)
        with torch.inference_mode():
            maps = torch.stack(eager(torch.tensor([view.input_ids]), output_attentions=True).attentions)[:, 0]
        p, r = view.n_prompt, view.n_response
        steps = maps[:, :, p - 1:p - 1 + r, :p + r].reshape(-1, r, p + r).double().numpy()  # [layers x heads, R, n]
        ratios.append(lookback_ratios(steps, p, view.n_header).mean(axis=1))
    order = np.argsort(-np.mean(ratios, axis=0))[:len(chosen)]
    expected = {(int(i) // smol.n_heads, int(i) % smol.n_heads) for i in order}
    assert len(chosen) == 27 and len(set(chosen) & expected) >= 25


def test_the_command_gives_evidence(capsys):
    from halwatch.cli import main

    assert main(["score", "--context", EIFFEL["context"], "--question", EIFFEL["question"], "--response",
                 "Gustave Eiffel's company built it.", "--evidence", "attention"]) == 0
    found = json.loads(capsys.readouterr().out)
    (sentence,) = found["evidence"]
    assert sentence["supported"] and "Gustave Eiffel's company" in sentence["sources"][0]["text"]
    with pytest.raises(SystemExit):
        main(["score", "--context", "x", "--response", "y", "--evidence", "nope"])


def test_the_report_shows_each_sentences_source(hw, tmp_path, capsys):
    """A file scored with evidence: the report lists each answer sentence with its heaviest source, or says that a
    flagged sentence has none, in both layouts."""
    from html import escape

    from halwatch.cli import main

    records = [{"id": "a", **EIFFEL, "response": "Gustave Eiffel's company built it. The tower is 500 metres tall "
                                                 "and was designed by Le Corbusier."}]
    results = hw.check_many(records, evidence="attention")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in results))
    for name in ("r.html", "r.md"):
        assert main(["report", str(tmp_path / "s.jsonl"), "--input", str(tmp_path / "in.jsonl"),
                     "--output", str(tmp_path / name)]) == 0
    page, text = (tmp_path / "r.html").read_text(), (tmp_path / "r.md").read_text()
    first, second = results[0].evidence
    assert escape(f'"{first.text}" <- "{first.sources[0].text}"') in page
    assert escape(f'"{second.text}" <- no evidence') in page and "sources: \"Gustave Eiffel's company" in text
