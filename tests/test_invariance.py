"""The renderings of the template-invariance benchmark: the same answer, context and question in every one."""

import re

from halwatch.data.ragtruth import read_ragtruth
from halwatch.eval.invariance import RENDERINGS, render


def _passages(text):
    return sorted(p.strip() for p in re.split(r"passage \d+:", text) if p.strip())


def test_every_rendering_keeps_the_answer_the_passages_and_the_question(smol):
    samples = read_ragtruth(generator="llama-2-13b-chat", split="train")[:25]
    for sample in samples:
        original = sample.prompt[slice(*sample.context_span)]
        for how in RENDERINGS:
            r = render(sample, how, smol.tokenizer, seed=1)
            assert (r.response, r.label, r.spans) == (sample.response, sample.label, sample.spans)
            context = r.prompt[slice(*r.context_span)]
            assert _passages(context) == _passages(original)  # the same passages, perhaps in another order
            assert sample.meta["question"] in r.prompt
        shuffled = render(sample, "shuffled", seed=1).prompt
        if len(_passages(original)) > 1:
            assert shuffled != sample.prompt and shuffled.startswith(sample.prompt[:sample.context_span[0]])
        chat = render(sample, "chat", smol.tokenizer)
        assert chat.prompt.startswith("<|im_start|>") and sample.prompt in chat.prompt
        assert render(sample, "qa").prompt.endswith("\nAnswer:")
        assert render(sample, "inst").prompt == f"[INST] {sample.prompt} [/INST]"


def test_ragtruth_chat_is_ragtruths_prompt_as_a_chatml_user_turn(smol):
    """`ragtruth-chat:GENERATOR`: the same answers, labels, spans, splits and sources as `ragtruth:GENERATOR`, each
    prompt the user turn of SmolLM2's ChatML template (checked against the format written out here, not the
    tokenizer) with the context span on the same passages; the benchmark's `chat` rendering is the same text, so
    one cached pass serves both."""
    from halwatch.data.splits import split_of
    from halwatch.eval.datasets import dataset_names, load_dataset

    assert "ragtruth-chat:all" in dataset_names()
    plain, generator = load_dataset("ragtruth:llama-2-13b-chat")
    chat, same = load_dataset("ragtruth-chat:llama-2-13b-chat")
    assert generator == same == "llama-2-13b-chat" and len(plain) == len(chat)
    for p, c in zip(plain, chat):
        assert (c.response, c.label, c.spans, c.id, c.source) == (p.response, p.label, p.spans, p.id, p.source)
        assert split_of(c) == split_of(p) and c.meta["template"] == "chat"
        head, _, turn = c.prompt.partition("<|im_start|>user\n")
        assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n")
        assert turn == p.prompt + "<|im_end|>\n<|im_start|>assistant\n"
        assert c.prompt[slice(*c.context_span)] == p.prompt[slice(*p.context_span)]
    assert all(render(p, "chat", smol.tokenizer).prompt == c.prompt for p, c in zip(plain[:20], chat))


def test_invariance_figures_are_those_of_scoring_each_rendering(smol, scorer, probe_by_size):
    """`halwatch bench invariance`'s figures against the public scoring path: each rendering's probabilities are
    `Detector.score`'s on the rendered answers, the median change and the flips are recomputed here from them; a
    scoring model whose tokenizer has no chat template (a base model) skips the chat rendering instead of failing."""
    import copy
    import dataclasses

    import numpy as np

    from halwatch.detectors import load_detector
    from halwatch.eval.invariance import invariance
    from halwatch.scorer import Scorer

    def fits(sample):  # one view in every rendering: score's windows and the benchmark's one view agree
        return all(len(scorer.encode_windows(render(sample, how, smol.tokenizer, 0))) == 1 for how in RENDERINGS)

    small = [s for s in probe_by_size if fits(s)]
    samples = [s for s in small if s.label == 1][:3] + [s for s in small if s.label == 0][:3]
    detector = load_detector("perplexity", scorer=scorer)
    found = invariance(detector, samples, progress=False)
    assert found["skipped"] == [] and list(found["renderings"]) == list(RENDERINGS)
    base = detector.score(samples)
    for how in RENDERINGS:
        p = detector.score([render(s, how, smol.tokenizer, 0) for s in samples])
        np.testing.assert_allclose(found["probabilities"][how], p, atol=1e-5)
        r = found["renderings"][how]
        assert r["median_abs_change"] == round(float(np.median(np.abs(p - base))), 4)
        flipped = sum((a >= detector.threshold) != (b >= detector.threshold) for a, b in zip(p, base))
        assert r["flips"] == round(flipped / len(samples), 4)
    assert found["renderings"]["chat"]["median_abs_change"] > 0  # the chat wrapper does move a perplexity

    tokenizer = copy.deepcopy(smol.tokenizer)
    tokenizer.chat_template = None
    base_model = dataclasses.replace(smol, tokenizer=tokenizer)
    plain = load_detector("perplexity", scorer=Scorer(model=base_model, max_tokens=512, cache=scorer.cache.root))
    without = invariance(plain, samples, progress=False)
    assert without["skipped"] == ["chat"] and list(without["renderings"]) == ["ragtruth", "qa", "shuffled", "inst"]
    assert without["probabilities"]["qa"] == found["probabilities"]["qa"]
