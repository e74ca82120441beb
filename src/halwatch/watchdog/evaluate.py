"""HalMit's evaluation agent: is an answer hallucinated? Every label says which rule made it (``method``).

- ``gqa`` (section 4.1, with a reference answer): the mean of unigram F1 and ROUGE-L against the reference is below
  0.5 (Su et al. 2022's GQA metric; with several references, the best one counts);
- ``contains`` (with a reference; not in the paper): no reference answer occurs in the answer as a run of whole words
  (the answer-containment accuracy of Mallen et al. 2023, PopQA). GQA punishes a right answer given as a sentence,
  so a small agent's answers are nearly all "hallucinated" by it; ``watch bench`` reports both;
- ``faithfulness`` (no reference): fewer than half of the answer's content words occur in the retrieved context; an
  answer that declines ("the context does not mention ...") is not a hallucination;
- ``judge`` (no reference, a judge LLM given): the judge says the answer is not supported by the context
  (P(yes) < 0.5 on its first token, counting the choices that are the word yes or no); a judge that says neither
  word gives 0.5 and does not flag the answer.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from halwatch.data.generate import rouge_l, words
from halwatch.watchdog.clients import yes_probability

STOPWORDS = set("a an the of in on at to for by with from and or but is are was were be been being it its this that "
                "these those as which who whom what when where why how than then there their they he she his her "
                "we you i not no do does did has have had can could would should will may might also into about "
                "over such so".split())
DECLINE = re.compile(r"(does not|doesn't|do not|did not) (mention|contain|provide|say|state|specify|include)|"
                     r"no (information|mention)|not (mentioned|specified|provided|stated)"
                     r"|cannot (be )?(answer|determine)|unable to (answer|determine)")
JUDGE = ("Context:\n{context}\n\nQuestion: {question}\nAnswer: {answer}\n\nIs the answer fully supported by the "
         "context? Answer yes or no.")


@dataclass
class Label:
    hallucinated: bool
    score: float  # the rule's own number (GQA score, supported share, judge P(yes)); higher = better supported
    method: str


def unigram_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 on lower-cased word tokens."""
    p, r = words(prediction), words(reference)
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r or not common:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def gqa_score(answer: str, references) -> float:
    return max(((unigram_f1(answer, r) + rouge_l(answer, r)) / 2 for r in references), default=0.0)


def gqa_label(answer: str, references) -> Label:
    score = gqa_score(answer, references)
    return Label(score < 0.5, score, "gqa")


def contains_label(answer: str, references) -> Label:
    text = f" {' '.join(words(answer))} "
    inside = any(w and f" {' '.join(w)} " in text for w in map(words, references))
    return Label(not inside, float(inside), "contains")


LABEL_RULES = {"gqa": gqa_label, "contains": contains_label}


def faithfulness_label(answer: str, context: str) -> Label:
    if DECLINE.search(answer.lower()):
        return Label(False, 1.0, "faithfulness")
    content = [w for w in words(answer) if w not in STOPWORDS]
    known = set(words(context))
    share = sum(w in known for w in content) / len(content) if content else 0.0
    return Label(share < 0.5, share, "faithfulness")


async def judge_label(judge, question: str, answer: str, context: str) -> Label:
    out = await judge.chat([{"role": "user", "content": JUDGE.format(context=context, question=question,
                                                                        answer=answer)}], max_tokens=1, top_logprobs=5)
    p = yes_probability(out[0])
    return Label(p < 0.5, p, "judge")


class Evaluator:
    """Labels answers: ``gqa`` when a reference is given, otherwise ``judge`` when a judge client is given, otherwise
    ``faithfulness``."""

    def __init__(self, judge=None):
        self.judge = judge

    async def label(self, question: str, answer: str, context: str, references=None) -> Label:
        if references:
            return gqa_label(answer, references)
        if self.judge is not None:
            return await judge_label(self.judge, question, answer, context)
        return faithfulness_label(answer, context)
