"""The black-box yes/no judge reads the words yes and no exactly: first-token choices such as "Not", "None",
"Nobody" or "Yesterday" are neither, in the clients' P(yes) and in the two agents that use it (the evaluation
judge, entailment clustering). Expected values are worked out by hand from the probabilities written here."""

from __future__ import annotations

import asyncio
import math

import pytest

from halwatch.watchdog.clients import Completion, yes_no_word, yes_probability
from halwatch.watchdog.entropy import semantic_entropy
from halwatch.watchdog.evaluate import judge_label


def _choices(**probs):
    """First-token choices {token text: log-probability} from probabilities (keys spelled with _ for a space)."""
    return {k.replace("_", " "): math.log(p) for k, p in probs.items()}


def test_yes_no_word():
    for text in ("yes", "Yes", " YES", "Yes.", " yes,", "yes!\n"):
        assert yes_no_word(text) == "yes"
    for text in ("no", " No", "NO.", " no,", "No?"):
        assert yes_no_word(text) == "no"
    for text in ("Not", " None", "Nobody", "Yesterday", "nope", "Noah", "yes-man", "", " ", "."):
        assert yes_no_word(text) == ""


def test_first_token_choices_count_whole_words_only():
    # "Not" 0.6 is neither: P(yes) = 0.3 / (0.3 + 0.1) (a prefix match gave 0.3 / (0.3 + 0.7) = 0.3)
    c = Completion("Not", top_first=_choices(_Not=0.6, _Yes=0.3, _No=0.1))
    assert yes_probability(c) == pytest.approx(0.75)
    # "Nobody" and "None" are neither; "yes" 0.2 and "YES." 0.1 are yes, and no choice is no: P(yes) = 1
    c = Completion("Nobody", top_first=_choices(Nobody=0.5, _None=0.2, yes=0.2, **{"YES.": 0.1}))
    assert yes_probability(c) == pytest.approx(1.0)
    # "Yesterday" is neither; " no," and "No" are no: P(yes) = 0
    c = Completion("Yesterday", top_first={" Yesterday": math.log(0.5), " no,": math.log(0.25), "No": math.log(0.25)})
    assert yes_probability(c) == pytest.approx(0.0)
    # variants of one word add up: yes 0.2 + 0.1 + 0.05, no 0.35 + 0.1
    c = Completion("No", top_first={"No": math.log(0.35), " Yes": math.log(0.2), "yes": math.log(0.1),
                                    " Yes.": math.log(0.05), " no": math.log(0.1), " Nope": math.log(0.2)})
    assert yes_probability(c) == pytest.approx(0.35 / (0.35 + 0.45))


def test_text_fallback_reads_the_first_whole_word():
    expected = {"Yes.": 1.0, " yes": 1.0, "Yes, it is supported.": 1.0, "NO": 0.0, "No, it is not.": 0.0,
                "no.\n": 0.0, "Not sure": 0.5, "Nobody": 0.5, "None of them": 0.5, "Yesterday.": 0.5,
                "I think yes": 0.5, "": 0.5, "  ": 0.5}
    for text, p in expected.items():
        assert yes_probability(Completion(text)) == p, text
    # choices that are neither word fall back to the text
    assert yes_probability(Completion("Not sure", top_first=_choices(_Not=0.7, _None=0.3))) == 0.5
    assert yes_probability(Completion("No.", top_first=_choices(Nobody=0.7, Nothing=0.3))) == 0.0


class _Judge:
    """A judge client that always gives the same first token and choices."""

    def __init__(self, completion: Completion):
        self.completion = completion
        self.calls = 0

    async def chat(self, messages, n=1, temperature=0.0, max_tokens=64, seed=0, top_logprobs=0):
        self.calls += 1
        return [self.completion]


def test_the_evaluation_judge_and_entailment_clusters_read_whole_words():
    # "Not" 0.8 is neither; yes 0.05 against no 0.15: P(yes) = 0.25, not supported
    label = asyncio.run(judge_label(_Judge(Completion("Not", top_first=_choices(_Not=0.8, _No=0.15, _Yes=0.05))),
                                    "q", "a", "c"))
    assert label.hallucinated and label.method == "judge" and label.score == pytest.approx(0.25)
    # "None" 0.9 is neither (a prefix match read no, P(yes) = 0.1 / 1.0): P(yes) = 1, supported
    label = asyncio.run(judge_label(_Judge(Completion("None", top_first=_choices(_None=0.9, _Yes=0.1))),
                                    "q", "a", "c"))
    assert not label.hallucinated and label.score == pytest.approx(1.0)
    # a judge that says neither word: 0.5, not flagged
    label = asyncio.run(judge_label(_Judge(Completion("Nobody knows")), "q", "a", "c"))
    assert not label.hallucinated and label.score == 0.5
    # "Yesterday" 0.9 is not yes: P(yes) = 0, nothing entails anything, three clusters of one (a prefix match
    # read P(yes) = 0.9 and merged all three: entropy 0)
    judge = _Judge(Completion("Yesterday", top_first=_choices(_Yesterday=0.9, _No=0.1)))
    h = asyncio.run(semantic_entropy(["Paris.", "Lyon.", "Nice."], "Which city?", "entailment", judge))
    assert h == pytest.approx(math.log(3))
    assert judge.calls == 6  # both directions: answer 2 against 1, answer 3 against 1 and against 2
    judge = _Judge(Completion("Yes", top_first=_choices(_Yes=0.6, _Not=0.3, _No=0.1)))  # P(yes) = 0.6 / 0.7
    assert asyncio.run(semantic_entropy(["Paris.", "Paris!", "Paris"], "Which city?", "entailment", judge)) == 0.0
