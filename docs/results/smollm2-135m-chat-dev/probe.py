"""Diagnostic (dev split, no adoption decision): which half of the chat wrapping moves artifact A's inputs and
verdicts? The invariance benchmark's code with two more renderings: chat-head (the chat template's text before the
prompt: system turn and user header; the prompt still ends with RAGTruth's "\noutput:" cue) and chat-tail (only the
text after the prompt: end of the user turn and the assistant header)."""
import sys

import halwatch.eval.invariance as inv
from halwatch.eval.datasets import in_chat_template, wrapped_prompt

_render = inv.render


def render(sample, how, tokenizer=None, seed=0):
    if how in ("chat-head", "chat-tail"):  # the two halves of the benchmark's own chat rendering
        head, _, tail = in_chat_template(sample, tokenizer).prompt.partition(sample.prompt)
        return wrapped_prompt(sample, head, "", how) if how == "chat-head" else wrapped_prompt(sample, "", tail, how)
    return _render(sample, how, tokenizer, seed)


inv.render = render
inv.RENDERINGS = ("ragtruth", "chat", "chat-head", "chat-tail", "inst")
inv.run_invariance(detector=sys.argv[1], split="dev", n=150, out=sys.argv[2])
