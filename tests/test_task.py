"""The task of an answer sent without one (issue 75): a summary sent with its instruction as the question is judged by
the summary part. The requests below were written apart from the rule (:data:`halwatch.sample.SUMMARY_REQUEST`) and
never used to change it; the real questions are every question of the shared QA and dialogue sets."""

import re

import pytest

from halwatch.data.squad import read_squad
from halwatch.eval.datasets import load_dataset
from halwatch.sample import Sample, asks_for_summary, task_of

#: Requests for a summary, phrased as users phrase them (none of them was read while the rule was written).
SUMMARY_REQUESTS = [
    "Summarise this for me.",
    "Please provide a brief summary.",
    "Can you summarize the passage in two sentences?",
    "tl;dr",
    "Give a one-paragraph synopsis of the story.",
    "What are the main points of this article?",
    "Write an executive summary of the report above.",
    "Sum it up in one line.",
    "Provide an overview of the document.",
    "Condense the text into a short summary.",
    "I need a quick recap of the meeting.",
    "Summarize the following news within 60 words.",
    "Could you give me the gist of it?",
    "List the key takeaways from the passage.",
    "Briefly summarize what happened in the conversation.",
    "Generate a concise abstract for this paper.",
    "Summarizing the article, what does it say?",
    "In a nutshell, what is this email about?",
    "Write a summary.",
    "Make a short summary of the transcript for the team.",
    "Give me the highlights of the chapter.",
    "Boil the story down to its essentials.",
    "Produce a TL;DR for the thread above.",
    "Outline the key points of the text.",
    "Condense this passage into two sentences.",
    "Explain briefly what the passage is about.",
    "Shorten the article to a few lines.",
    "What's the article about, in brief?",
]

#: Instructions and questions that ask for something else.
OTHER_REQUESTS = [
    "Who built the Eiffel Tower?",
    "What is the summary judgment standard in civil cases?",
    "How many passengers did the airline carry in 2019?",
    "Translate the passage into French.",
    "Which team won the match, and by how many points?",
    "What does the abstract say about the sample size?",
    "Answer the question using only the context.",
    "List the ingredients mentioned in the recipe.",
    "When did the company file its annual report?",
    "What are the side effects of the drug?",
    "Reply to the customer politely.",
    "Is the claim in the last sentence true?",
]


def test_requests_for_a_summary_are_read_as_summaries():
    found = [q for q in SUMMARY_REQUESTS if asks_for_summary(q)]
    missed = sorted(set(SUMMARY_REQUESTS) - set(found))
    assert len(found) / len(SUMMARY_REQUESTS) >= 0.8, missed
    for q in found:
        assert task_of(Sample(context="Some text.", question=q, response="A summary.")) == "summary"
        assert Sample(context="Some text.", question=q, response="x").prompt.startswith("Summarize the following")


def test_other_requests_stay_questions():
    wrong = [q for q in OTHER_REQUESTS if asks_for_summary(q)]
    assert len(wrong) <= 1, wrong  # "What does the abstract say": at most one such near miss
    assert task_of(Sample(context="Some text.", question="Who built it?", response="x")) == "qa"
    assert task_of(Sample(context="Some text.", response="x")) == "summary"
    assert task_of(Sample(context="Some text.", question="Summarize the text.", response="x", task="qa")) == "qa"


@pytest.mark.parametrize("name", ["ragtruth:all", "squad-shapes", "begin", "faithdial"])
def test_no_real_question_is_read_as_a_summary_request(name):
    samples = load_dataset(name)[0]
    questions = {s.question for s in samples if s.question}
    if name == "ragtruth:all":  # RAGTruth's prompts are given as they are: their question is inside
        questions = {re.search(r"question:\n(.*)\n", s.prompt).group(1) for s in samples}
        assert {task_of(s) for s in samples} == {"qa"}
    assert len(questions) > 500
    assert [q for q in questions if asks_for_summary(q)] == []


def test_no_squad_question_is_read_as_a_summary_request():
    questions = [q.question for q in read_squad()]
    assert len(questions) > 6000
    assert [q for q in questions if asks_for_summary(q)] == []


def test_a_given_prompt_asking_for_a_summary():
    text = "The council met on Monday and approved the new budget."
    asked = Sample(prompt=f"Summarize the following news within 20 words:\n{text}\noutput:", context=text,
                   response="The council approved the budget.")
    plain = Sample(prompt=f"Read this:\n{text}\nWhat did the council approve?", context=text, response="The budget.")
    unmarked = Sample(prompt=f"Summarize the following news:\n{text}", response="The council approved the budget.")
    assert (task_of(asked), task_of(plain), task_of(unmarked)) == ("summary", "qa", "qa")
