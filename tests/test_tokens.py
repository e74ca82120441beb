import logging

import pytest

from halwatch import InputError, Sample
from halwatch.sample import QA_TEMPLATE
from halwatch.tokens import encode, encode_many, encode_windows, runs_within, window_groups

TRICKY = [
    "Plain answer.",
    " leading space and  double  spaces",
    "Ünïcödé wörds, naïve café, Straße",
    "emoji 😀 inside 👩‍🔬 and after",
    "中文字符和日本語のテキスト",
    "line one\nline two\n\n  indented\ttab",
    "math: x² + y² = z², 10 µm, −5 °C",
]


@pytest.mark.parametrize("mode", ["raw", "chat"])
@pytest.mark.parametrize("response", TRICKY)
def test_response_tokens_map_to_characters(smol, mode, response):
    sample = Sample(prompt="Say something.", response=response)
    view = encode(sample, smol.tokenizer, mode)
    tok = smol.tokenizer
    resp_ids = view.input_ids[view.n_prompt :]
    assert tok.decode(resp_ids) == response  # the response tokens are exactly the response
    covered = set()
    for (start, end), tid in zip(view.offsets, resp_ids):
        assert 0 <= start <= end <= len(response)
        covered.update(range(start, end))
        piece = tok.decode([tid])
        if "\ufffd" not in piece:  # a whole-character token: its span is its text
            assert response[start:end] == piece
    assert covered == set(range(len(response)))  # every character belongs to some token
    starts = [s for s, _ in view.offsets]
    assert starts == sorted(starts)


def test_chat_mode_uses_the_template_and_raw_does_not(smol):
    sample = Sample(prompt="What is 2+2?", response="4")
    raw = encode(sample, smol.tokenizer, "raw")
    chat = encode(sample, smol.tokenizer, "chat")
    assert smol.tokenizer.decode(raw.input_ids[: raw.n_prompt]) == "What is 2+2?"
    prefix = smol.tokenizer.decode(chat.input_ids[: chat.n_prompt])
    assert prefix.startswith("<|im_start|>system") and prefix.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in prefix
    assert raw.input_ids[raw.n_prompt :] == chat.input_ids[chat.n_prompt :]


def test_spans_merge_consecutive_tokens_and_trim_space(smol):
    sample = Sample(prompt="p", response="The tower was built by Napoleon Bonaparte in 1921.")
    view = encode(sample, smol.tokenizer)
    start = sample.response.index("Napoleon")
    scores = [1.0 if s >= start - 1 and e <= sample.response.index(" in") else 0.0 for s, e in view.offsets]
    spans = view.spans(scores, 0.5)
    assert [s["text"] for s in spans] == ["Napoleon Bonaparte"]
    assert sample.response[spans[0]["start"] : spans[0]["end"]] == "Napoleon Bonaparte"
    assert spans[0]["confidence"] == 1.0


def test_gold_spans_become_token_labels(smol):
    sample = Sample(prompt="p", response="Paris is in Germany.", spans=[{"start": 12, "end": 19}])
    view = encode(sample, smol.tokenizer)
    flagged = "".join(sample.response[s:e] for (s, e), y in zip(view.offsets, view.token_labels()) if y)
    assert flagged.strip() == "Germany"


def test_long_prompt_is_cut_inside_the_context_from_the_left(smol, caplog):
    context = " ".join(f"Sentence number {i} of the context." for i in range(300))
    sample = Sample(context=context, question="Which sentence comes last?", response="Sentence 299.", id="long")
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        view = encode(sample, smol.tokenizer, "raw", max_tokens=200)
    assert len(view.input_ids) <= 200 and view.cut_chars > 0
    prompt_text = smol.tokenizer.decode(view.input_ids[: view.n_prompt])
    assert prompt_text.startswith(QA_TEMPLATE.split("{context}")[0])  # instructions kept
    assert prompt_text.endswith("Question: Which sentence comes last?\nAnswer:")  # question kept
    assert "Sentence number 299 of the context." in prompt_text and "Sentence number 0 " not in prompt_text
    assert "id=long: prompt cut" in caplog.text
    assert smol.tokenizer.decode(view.input_ids[view.n_prompt :]) == "Sentence 299."  # response untouched


def test_chat_mode_cut_keeps_the_template(smol):
    context = "word " * 2000
    sample = Sample(context=context, question="Q?", response="A.")
    view = encode(sample, smol.tokenizer, "chat", max_tokens=300)
    assert len(view.input_ids) <= 300
    assert smol.tokenizer.decode(view.input_ids[: view.n_prompt]).endswith("<|im_start|>assistant\n")


def test_response_longer_than_the_cap_is_an_error(smol):
    sample = Sample(prompt="p", response="word " * 400, id="r1")
    with pytest.raises(InputError, match=r"id=r1: the response alone has \d+ tokens"):
        encode(sample, smol.tokenizer, max_tokens=256)


def test_prompt_without_context_span_is_cut_from_the_left(smol):
    sample = Sample(prompt="start " + "filler " * 500 + "the question?", response="ok")
    view = encode(sample, smol.tokenizer, max_tokens=100)
    assert len(view.input_ids) <= 100
    assert smol.tokenizer.decode(view.input_ids[: view.n_prompt]).endswith("the question?")


def test_long_context_is_scored_in_overlapping_windows_that_cover_it(smol):
    context = " ".join(f"Sentence number {i} of the context." for i in range(70))
    sample = Sample(context=context, question="Which sentence comes first?", response="Sentence 0.", id="long")
    views = encode_windows(sample, smol.tokenizer, "raw", max_tokens=200)
    texts = [smol.tokenizer.decode(v.input_ids[: v.n_prompt]) for v in views]
    assert len(views) > 2 and [v.window for v in views] == [(k, len(views)) for k in range(len(views))]
    assert all(len(v.input_ids) <= 200 for v in views)
    assert all(smol.tokenizer.decode(v.input_ids[v.n_prompt:]) == "Sentence 0." for v in views)  # whole response
    assert all(t.endswith("Question: Which sentence comes first?\nAnswer:") for t in texts)
    # every sentence of the context is whole in some window, the first window holds the first one, and the last
    # window is the one view that cutting from the left gives
    for i in range(70):
        assert any(f"Sentence number {i} of the context." in t for t in texts), i
    assert "Sentence number 0 of the context." in texts[0]
    assert views[-1].input_ids == encode(sample, smol.tokenizer, "raw", max_tokens=200).input_ids
    # neighbouring windows overlap: the sentence that ends one window opens part of the next
    for left, right in zip(texts, texts[1:]):
        shared = [i for i in range(70) if f"number {i} of" in left and f"number {i} of" in right]
        assert len(shared) >= 2
    assert all(v.cut_tokens == 0 for v in views)
    # each view knows the prompt text it holds (LM-Polygraph's estimators read it)
    for view in views:
        again = smol.tokenizer(view.prompt_text(), add_special_tokens=True)["input_ids"]
        assert again == view.input_ids[: view.n_prompt]


def test_a_context_beyond_the_windows_loses_its_left_part_and_says_how_much(smol, caplog):
    context = " ".join(f"Sentence number {i} of the context." for i in range(300))
    sample = Sample(context=context, question="Q?", response="A.", id="huge")
    whole = len(smol.tokenizer(context, add_special_tokens=False)["input_ids"])
    with caplog.at_level(logging.WARNING, logger="halwatch"):
        views = encode_windows(sample, smol.tokenizer, "raw", max_tokens=200, max_windows=3)
    assert len(views) == 3 and "id=huge: context of" in caplog.text
    held = smol.tokenizer.decode(views[0].input_ids[: views[0].n_prompt])
    first_kept = min(i for i in range(300) if f"number {i} of" in held)
    dropped = len(smol.tokenizer(context[: context.index(f"Sentence number {first_kept} ")],
                                 add_special_tokens=False)["input_ids"])
    assert first_kept > 0 and abs(views[0].cut_tokens - dropped) <= 0.05 * dropped and views[0].cut_tokens < whole
    assert encode_windows(sample, smol.tokenizer, "raw", max_tokens=200, max_windows=1)[0].window == (0, 1)


def test_a_context_that_fits_is_one_view(smol):
    sample = Sample(context="Paris is the capital of France.", question="Capital?", response="Paris.")
    (view,) = encode_windows(sample, smol.tokenizer, "raw", max_tokens=200)
    assert view.window == (0, 1) and view.input_ids == encode(sample, smol.tokenizer, "raw", 200).input_ids


def test_window_groups_keep_one_answers_windows_together(smol):
    long = Sample(context=" ".join(f"Sentence {i}." for i in range(400)), question="Q?", response="A.")
    short = Sample(context="C.", question="Q?", response="A.")
    views = [*encode_windows(long, smol.tokenizer, max_tokens=200), encode(short, smol.tokenizer)]
    assert window_groups(views) == [list(range(len(views) - 1)), [len(views) - 1]]
    with pytest.raises(ValueError, match="windows of one answer"):
        window_groups(views[1:])


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_tokenizing_many_together_gives_the_views_of_one_at_a_time(smol, probe, mode):
    """The batched tokenizer calls of encode_many against encode_windows sample by sample: real RAGTruth answers
    (under 700 characters) at a cap that cuts or windows most of their contexts, a context long enough to be cut
    before tokenizing, and the tricky responses."""
    long = Sample(context=" ".join(f"Sentence number {i} of the context." for i in range(3000)), question="Q?",
                  response="Sentence 5.", id="huge")
    samples = probe[:24] + [long] + [Sample(prompt="Say something.", response=r) for r in TRICKY]
    for cap, windows in ((1024, 1), (400, 4)):
        together = encode_many(samples, smol.tokenizer, mode, cap, windows)
        alone = [encode_windows(s, smol.tokenizer, mode, cap, windows) for s in samples]
        assert sum(len(v) > 1 for v in together) >= (5 if windows > 1 else 0)
        assert sum(v[-1].cut_chars > 0 for v in together) >= (10 if cap < 1024 else 1)
        for a, b in zip(together, alone):
            assert [(v.input_ids, v.n_prompt, v.n_header, v.offsets, v.cut_chars, v.cut_tokens, v.window, v.kept)
                    for v in a] == [(v.input_ids, v.n_prompt, v.n_header, v.offsets, v.cut_chars, v.cut_tokens,
                                     v.window, v.kept) for v in b]
    mixed = [samples[0], Sample(prompt="Q?", response="word " * 400, id="too-long"), samples[1]]
    with pytest.raises(InputError, match="id=too-long"):
        encode_many(mixed, smol.tokenizer, mode, 300)
    kept = encode_many(mixed, smol.tokenizer, mode, 300, keep_errors=True)  # the failing one in its place
    assert isinstance(kept[1], InputError) and "id=too-long" in str(kept[1])
    assert [kept[0][0].input_ids, kept[2][0].input_ids] == [encode(s, smol.tokenizer, mode, 300).input_ids
                                                            for s in (samples[0], samples[1])]
    assert encode_many([], smol.tokenizer, mode) == []
    # only samples cut before tokenizing (the service encodes one request's answer at a time): no empty prompt batch
    (alone,) = encode_many([long], smol.tokenizer, mode, 400, 2)
    assert [v.input_ids for v in alone] == [v.input_ids for v in encode_windows(long, smol.tokenizer, mode, 400, 2)]


def test_runs_within_a_limit_keep_order_and_give_an_oversized_item_its_own_run():
    assert runs_within([3, 1, 1, 5, 1], 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert runs_within([1] * 5, 10) == [range(0, 5)] and runs_within([], 4) == []
