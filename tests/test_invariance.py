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
