"""Labelled data of more shapes: the SQuAD-built answers, the shared summary / dialogue / data-to-text sets, the task
templates that render a context without a question, and the splits by source that keep every fold honest."""

import gzip
import json
import re
from collections import Counter

import pytest

from halwatch import InputError
from halwatch.data import data_root
from halwatch.data.jsonl import read_jsonl, write_jsonl
from halwatch.data.ragtruth import read_ragtruth
from halwatch.data.shapes import build_squad_shapes, kind_of, sentence_around
from halwatch.data.shared import SETS, cap_per_source, read_shared
from halwatch.data.splits import split_of
from halwatch.sample import QA_TEMPLATE, SUMMARY_TEMPLATE, Sample


@pytest.fixture(scope="module")
def shapes():
    return build_squad_shapes(n_questions=120, n_unanswerable=40, seed=3)


def test_squad_swaps_are_unsupported_and_their_twins_are_the_gold_answer(shapes):
    by_question: dict = {}
    for s in shapes:
        by_question.setdefault(s.meta["question_id"], {})[s.meta["shape"]] = s
    swaps = [s for s in shapes if s.meta["shape"].endswith("swap")]
    assert len(swaps) > 150
    for s in swaps:
        span = s.spans[0]
        swapped = s.response[span["start"]:span["end"]]
        assert s.label == 1 and swapped.lower() not in s.context.lower()
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", swapped):
            assert number not in s.context  # a moved number is nowhere in the passage
        twin = by_question[s.meta["question_id"]][s.meta["shape"].replace("-swap", "")]
        assert twin.label == 0 and twin.spans == []
        # the twin and the swap differ exactly at the span: the same text before and after it
        assert s.response[:span["start"]] == twin.response[:span["start"]]
        assert s.response[span["end"]:] == twin.response[len(twin.response) - (len(s.response) - span["end"]):]
    for s in shapes:
        if s.meta["shape"] in ("phrase", "sentence"):
            assert s.response in s.context  # grounded answers are the passage's own words
        if s.meta["shape"] == "unanswerable":
            assert s.label == 1 and s.spans == [{"start": 0, "end": len(s.response)}]
    # one article, one split; the same seed gives the same data
    titles = {s.meta["title"] for s in shapes}
    assert all(len({split_of(s) for s in shapes if s.meta["title"] == t}) == 1 for t in titles)
    again = build_squad_shapes(n_questions=120, n_unanswerable=40, seed=3)
    assert [s.to_dict() for s in again] == [s.to_dict() for s in shapes]


def test_kinds_and_sentences():
    assert kind_of("1889") == "number" and kind_of("Gustave Eiffel") == "name"
    assert kind_of("red blood cells") == "phrase"
    text = "The tower was built in 1889. It is 330 metres tall. Dr. No is a film."
    a = text.index("330")
    start, end = sentence_around(text, a, a + 3)
    assert text[start:end] == "It is 330 metres tall."


def test_shared_sets_read_with_their_task_source_and_split():
    raw = {}
    for name, spec in SETS.items():
        with gzip.open(data_root() / spec.folder / f"{spec.folder}.jsonl.gz", "rt", encoding="utf-8") as f:
            raw[name] = [json.loads(line) for line in f if line.strip()]
    for name, spec in SETS.items():
        samples = read_shared(name, per_source=None)
        if name != "rotowire":
            assert len(samples) == len(raw[name])
        assert all(s.meta["dataset"] == name for s in samples)
        task_prompt = {"summary": "Summary:", "dialogue": "Reply:", "data2text": "Report:"}[spec.task]
        assert all(s.prompt.endswith(task_prompt) for s in samples)
        splits = Counter(split_of(s) for s in samples)
        if spec.trainable:
            assert set(splits) == {"train", "dev", "test"}
            by_source = {}
            for s in samples:
                by_source.setdefault(s.source, set()).add(split_of(s))
            assert all(len(v) == 1 for v in by_source.values())  # a document never spans two splits
        else:
            assert set(splits) == {"test"}  # FaithBench: evaluation only
    # the capped default keeps both labels of a document where it has them
    capped = read_shared("bump")
    assert Counter(s.label for s in capped) == {0: 198, 1: 198}
    # RotoWire: one sample per sentence, labelled by the human error spans that fall in it
    game = raw["rotowire"][0]
    sentences = [s for s in read_shared("rotowire", per_source=None) if s.id.startswith(game["id"] + "-s")]
    assert "".join(s.response for s in sentences).replace(" ", "") == game["response"].replace(" ", "")
    assert sum(len(s.spans) for s in sentences) >= len(game["spans"])
    for s in sentences:
        assert s.label == int(bool(s.spans))


def test_cap_per_source_alternates_labels():
    samples = [Sample(context="doc A", response=f"r{i}", label=int(i < 8), id=str(i)) for i in range(10)]
    kept = cap_per_source(samples, 4, seed=1)
    assert len(kept) == 4 and Counter(s.label for s in kept) == {0: 2, 1: 2}


def test_a_dataset_name_can_set_its_cap_per_source():
    from halwatch.eval.datasets import load_dataset

    capped, _ = load_dataset("summedits")
    every, _ = load_dataset("summedits@all")
    ten, _ = load_dataset("summedits@10")
    per_source = Counter(s.meta["source_id"] for s in every)
    assert max(per_source.values()) > 10  # SummEdits holds about 28 answers per document; its own cap keeps 6
    assert max(Counter(s.meta["source_id"] for s in capped).values()) == 6
    assert max(Counter(s.meta["source_id"] for s in ten).values()) == 10
    assert {s.id for s in capped} <= {s.id for s in ten} <= {s.id for s in every}
    assert {s.meta["split"] for s in every} == {"train", "dev", "test"}
    with pytest.raises(InputError, match="answers per source document"):
        load_dataset("summedits@0")


def test_ragtruth_dev_split_is_a_fifth_of_the_train_sources():
    samples = read_ragtruth()
    sources = {split: {s.meta["source_id"] for s in samples if split_of(s) == split} for split in ("train", "dev",
                                                                                                   "test")}
    assert not sources["train"] & sources["dev"] and not sources["dev"] & sources["test"]
    share = len(sources["dev"]) / (len(sources["train"]) + len(sources["dev"]))
    assert 0.15 < share < 0.25
    assert {s.meta["split"] for s in samples if split_of(s) == "dev"} == {"train"}  # carved from the official train


def test_records_without_a_question_use_their_task_template(tmp_path):
    path = tmp_path / "shapes.jsonl"
    write_jsonl(path, [
        {"id": "s", "context": "The cat sat on the mat.", "response": "A cat sat.", "label": 0},
        {"id": "d", "context": "Paris is in France.", "question": "Where is Paris?", "task": "dialogue",
         "response": "In France."},
        {"id": "q", "context": "Paris is in France.", "question": "Where is Paris?", "response": "France."},
    ])
    summary, dialogue, qa = read_jsonl(path)
    head, _, _ = SUMMARY_TEMPLATE.partition("{context}")
    assert summary.prompt == head + "The cat sat on the mat.\nSummary:"
    assert summary.prompt[slice(*summary.context_span)] == "The cat sat on the mat."
    assert dialogue.prompt.endswith("Last turn: Where is Paris?\nReply:")
    assert qa.prompt == QA_TEMPLATE.format(context="Paris is in France.", question="Where is Paris?")
    # the data2text template takes no question; qa needs one; unknown tasks are named
    with pytest.raises(InputError, match="takes no question"):
        Sample(context="x", question="y", response="z", task="data2text")
    with pytest.raises(InputError, match="needs a question"):
        Sample(context="x", response="z", task="qa")
    with pytest.raises(InputError, match="unknown task 'poem'"):
        Sample(context="x", response="z", task="poem")
    # a written record reads back to the same prompt
    write_jsonl(tmp_path / "again.jsonl", [s.to_dict() for s in (summary, dialogue, qa)])
    assert [s.prompt for s in read_jsonl(tmp_path / "again.jsonl")] == [s.prompt for s in (summary, dialogue, qa)]


def test_sources_group_answers():
    rt = read_ragtruth(generator=["llama-2-7b-chat", "mistral-7B-instruct"])
    by_id = Counter(s.source for s in rt)
    assert max(by_id.values()) == 2  # the two generators' answers to one source share it
    a = Sample(context="same text", question="q1", response="r")
    b = Sample(context="same text", question="q2", response="s")
    assert a.source == b.source != Sample(context="other", question="q1", response="r").source


def test_squad_shapes_through_ragtruths_prompt():
    """`squad-shapes-ragtruth`: each SQuAD-built answer in RAGTruth's own QA prompt, whose instruction lines are read
    from RAGTruth's source file (all but the passage count: one passage here, three there); the context is marked,
    and the answer, label, spans, split and source are those of the `qa` rendering."""
    from halwatch.eval.datasets import load_dataset

    with gzip.open(data_root() / "ragtruth" / "source_info.qa.jsonl.gz", "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    prompts = [p for p in prompts if "passages:\npassage 1:" in p]
    assert len(prompts) > 900
    first, _, rest = prompts[0].partition("\n")
    ask = rest.split("\n", 1)[1].split(" three passages:")[0]
    tails = Counter(p[p.rindex("\n\nIn case"):] for p in prompts)
    tail, count = tails.most_common(1)[0]
    assert count == len(prompts)

    shapes = build_squad_shapes()
    rendered, generator = load_dataset("squad-shapes-ragtruth")
    assert generator == "squad" and len(rendered) == len(shapes)
    for qa, rt in zip(shapes, rendered):
        lines = rt.prompt.split("\n")
        assert lines[0] == first and lines[1] == qa.question
        assert lines[2] == ask + " passage:" and rt.prompt.endswith(tail)
        assert rt.prompt[rt.context_span[0]:rt.context_span[1]] == qa.context
        assert rt.prompt[:rt.context_span[0]].endswith("passage 1:")
        assert (rt.response, rt.label, rt.spans, rt.id) == (qa.response, qa.label, qa.spans, qa.id)
        assert split_of(rt) == split_of(qa) and rt.source == qa.source and rt.meta["template"] == "ragtruth"
