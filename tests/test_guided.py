"""Guided decoding (Lookback Lens section 3) and the prompt-cache forward it scores candidates with."""

import json

import numpy as np
import pytest

from halwatch.data.generate import generate_answer
from halwatch.data.squad import read_squad
from halwatch.detectors import load_detector
from halwatch.models import forward
from halwatch.models.forward import whitebox_request
from halwatch.models.guided import _view, generate
from halwatch.tokens import answer_header_length, prompt_token_ids


@pytest.fixture(scope="module")
def question():
    return read_squad()[7]


def test_forward_with_a_cached_prompt_equals_the_full_pass(smol, question):
    import torch

    prompt_ids = prompt_token_ids(smol.tokenizer, question.sample("-").prompt, "chat")
    responses = [smol.tokenizer(t, add_special_tokens=False)["input_ids"]
                 for t in ("The answer is in the text.", "No idea at all, sorry", "Yes")]
    n_header = answer_header_length(smol.tokenizer, question.sample("-").prompt, "chat", prompt_ids)
    views = [_view(prompt_ids, r, "chat", n_header) for r in responses]
    request = whitebox_request(smol)
    full = forward.run(smol, views, request)
    cached = len(prompt_ids) - 1
    with torch.inference_mode():
        cache = smol.model(input_ids=torch.tensor([prompt_ids[:-1]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(views))
    reused = forward.run(smol, views, request, past=(cache, cached))
    assert cache.get_seq_length() == cached  # left as it was found
    for a, b in zip(full, reused):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.hidden, b.hidden, atol=1e-3)
        for name in ("lookback.ratio", "mtopdiv.d", "diag.w"):
            np.testing.assert_allclose(a.reduced[name], b.reduced[name], atol=1e-5)
    with pytest.raises(ValueError, match="no room"):
        forward.run(smol, views, request, past=(cache, len(prompt_ids)))


def test_greedy_decoding_equals_transformers_generate(smol, question):
    prompt = question.sample("-").prompt
    found = generate(smol, prompt, "chat", max_new_tokens=40)
    assert found.text == generate_answer(smol, prompt, "chat", max_new_tokens=40)
    assert found.chunk_scores == []


@pytest.mark.parametrize("guide", ["lookback-lens-chat", "toha-chat"])
def test_guided_decoding_is_reproducible_and_full_length(smol, guide):
    from halwatch.scorer import Scorer

    detector = load_detector(guide, scorer=Scorer(model=smol, input_mode="chat", cache=None))
    prompt = "Write a long story about a lighthouse keeper and his dog."
    runs = [generate(smol, prompt, "chat", detector, max_new_tokens=20, seed=s) for s in (5, 5, 6)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].text == runs[1].text
    for run in runs:
        assert len(run.token_ids) == 20 or run.ended  # never shorter than asked unless the model ended it
        chunks = -(-len(run.token_ids) // 8)  # one kept candidate per chunk of 8 (and one that only ends it)
        assert chunks <= len(run.chunk_scores) <= chunks + int(run.ended)
        assert np.isfinite(run.chunk_scores).all()


def test_the_guide_keeps_the_lowest_scoring_candidate(smol, monkeypatch):
    """Every step keeps the candidate whose raw score the detector finds lowest, and the answer is made of the kept
    candidates."""
    from halwatch.scorer import Scorer

    detector = load_detector("lookback-lens-chat", scorer=Scorer(model=smol, input_mode="chat", cache=None))
    steps = []
    real_run, real_scores = forward.run, detector.continuation_scores

    def run(model, views, request, past=None):
        steps.append({"views": views})
        return real_run(model, views, request, past=past)

    def scores(signals, start):
        steps[-1]["raw"] = np.asarray(real_scores(signals, start), dtype=float)
        return steps[-1]["raw"]

    monkeypatch.setattr(forward, "run", run)
    monkeypatch.setattr(detector, "continuation_scores", scores)
    found = generate(smol, "Write a long story about a lighthouse keeper and his dog.", "chat", detector,
                     max_new_tokens=24, n_candidates=4, chunk=6, seed=3)
    assert len(steps) == len(found.chunk_scores) >= 3
    for step, kept in zip(steps, found.chunk_scores):
        best = int(np.argmin(step["raw"]))
        assert kept == step["raw"].min()
        chosen = step["views"][best].input_ids[step["views"][best].n_prompt:]
        assert found.token_ids[: len(chosen)] == chosen
    # the candidates of a step differ, so the choice is real
    assert any(len({tuple(v.input_ids) for v in step["views"]}) > 1 for step in steps)


def test_a_guide_that_reads_every_token_decodes(smol, probe_by_size):
    """toha-mst reads the attention rows of every token, which a cached prompt cannot give: its candidates are
    scored by full passes."""
    from halwatch.detectors import create_detector
    from halwatch.scorer import Scorer

    scorer = Scorer(model=smol, input_mode="chat", max_tokens=360, cache=None)
    short = probe_by_size
    few = [s for s in short if not s.label][:3] + [s for s in short if s.label][:3]
    det = create_detector("toha-mst", scorer=scorer, n_max=2).fit(few)
    found = generate(smol, "Name a colour.", "chat", det, max_new_tokens=8, n_candidates=2, chunk=4, seed=0)
    assert 1 <= len(found.chunk_scores) <= 3 and np.isfinite(found.chunk_scores).all()


def test_generate_command_single_and_file(tmp_path, question, halwatch):
    out = halwatch("generate", "--guide", "lookback", "--context", question.context, "--question", question.question,
                   "--max-new-tokens", "16")
    found = json.loads(out.stdout)
    assert found["guide"] == "lookback-lens" and found["response"] and found["n_tokens"] <= 16
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps({"id": q.id, "context": q.context, "question": q.question,
                                           "meta": {"answers": q.answers, "is_impossible": q.is_impossible}}) + "\n"
                               for q in read_squad()[:2]))
    target = tmp_path / "out.jsonl"
    cmd = ["-q", "generate", "--input", records, "--output", target, "--max-new-tokens", "24"]
    halwatch(*cmd)
    first = target.read_text()
    halwatch(*cmd)  # resumed: nothing is answered twice
    assert target.read_text() == first
    rows = [json.loads(x) for x in first.splitlines()]
    assert [r["id"] for r in rows] == [q.id for q in read_squad()[:2]]
    assert all(r["meta"]["guide"] == "greedy" and "label" in r and r["response"] for r in rows)
    bad = halwatch("generate", "--guide", "nope", "--prompt", "hi", check=False)
    assert bad.returncode == 2 and "no artifact file 'nope'" in bad.stderr
    both = halwatch("generate", "--guide", "toha", "--sample", "--prompt", "hi", check=False)
    assert both.returncode == 2 and "not both" in both.stderr


def test_sampled_decoding_is_seeded(smol, question):
    prompt = question.sample("-").prompt
    a, b = (generate(smol, prompt, "chat", max_new_tokens=12, sample=True, seed=1) for _ in range(2))
    assert a.token_ids == b.token_ids and (len(a.token_ids) == 12 or a.ended)
