"""The benchmark datasets by name (:func:`load_dataset`) and the prompt renderings the protocols compare: RAGTruth
QA in its own prompt, through the QA template, and as a chat turn."""

from __future__ import annotations

from halwatch.errors import InputError

#: RAGTruth QA in its own prompt, through the QA template, and as a chat turn (:func:`load_dataset`).
RAGTRUTH_KINDS = ("ragtruth", "ragtruth-qa", "ragtruth-chat")


def dataset_names() -> list[str]:
    """Every dataset name :func:`load_dataset` takes besides a JSONL path (``ragtruth:GENERATOR`` for each
    generator and ``ragtruth:all``)."""
    from halwatch.data.ragtruth import GENERATORS
    from halwatch.data.shared import SETS

    return ([f"{kind}:{g}" for kind in RAGTRUTH_KINDS for g in (*GENERATORS, "all")]
            + ["squad-shapes", "squad-shapes-ragtruth", *SETS])


def load_dataset(name: str):
    """Samples of a named dataset and its generator (a label for result rows): ``ragtruth:GENERATOR`` (RAGTruth QA
    of one generator, both official splits; ``ragtruth:G1+G2`` several pooled; ``ragtruth:all`` all three),
    ``ragtruth-qa:GENERATOR`` (the same answers with their passages and question rendered through the QA template
    instead of RAGTruth's prompt), ``ragtruth-chat:GENERATOR`` (RAGTruth's prompt as the user turn of the default
    scoring model's chat template, :func:`in_chat_template`), ``squad-shapes`` (:mod:`halwatch.data.shapes`),
    ``squad-shapes-ragtruth`` (the same answers through RAGTruth's prompt, :func:`as_ragtruth_prompt`), a shared set
    of another shape (:data:`halwatch.data.shared.SETS`; ``NAME@K`` keeps at most ``K`` answers per source document
    instead of the set's own cap, ``NAME@all`` every answer), a generic JSONL path, or several of these joined by
    commas (pooled, each keeping its own splits). Returns ``(samples, generator)``."""
    from halwatch.data.jsonl import read_jsonl
    from halwatch.data.ragtruth import read_ragtruth
    from halwatch.data.shared import SETS, read_shared

    if "," in name:
        parts = [load_dataset(part) for part in name.split(",") if part]
        return [s for samples, _ in parts for s in samples], "+".join(g for _, g in parts)
    kind, _, generator = name.partition(":")
    if kind in RAGTRUTH_KINDS and generator:
        samples = read_ragtruth(generator=None if generator == "all" else generator.split("+"))
        if kind == "ragtruth-qa":
            samples = [as_qa_template(s) for s in samples]
        elif kind == "ragtruth-chat":
            from halwatch.models.loader import load_model
            from halwatch.models.registry import DEFAULT_MODEL

            tokenizer = load_model(DEFAULT_MODEL, device="cpu", dtype="float32").tokenizer
            samples = [in_chat_template(s, tokenizer) for s in samples]
        return samples, generator
    if name in ("squad-shapes", "squad-shapes-ragtruth"):
        from halwatch.data.shapes import build_squad_shapes

        samples = build_squad_shapes()
        return (samples if name == "squad-shapes" else [as_ragtruth_prompt(s) for s in samples]), "squad"
    shared, _, cap = name.partition("@")
    if shared in SETS:
        return read_shared(shared, per_source=_cap(cap)), shared
    samples = read_jsonl(name)
    if any(s.label is None for s in samples):
        raise InputError("every record of a benchmark dataset needs a label", name)
    return samples, str(samples[0].meta.get("model", samples[0].meta.get("generator", "-")))


def _cap(text: str):
    """The answers-per-source cap of ``NAME@CAP``: ``all`` (none), a positive number, or ``"default"`` (no ``@``)."""
    if not text:
        return "default"
    if text == "all":
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise InputError(f"after '@', give how many answers per source document to keep: a positive number or 'all', "
                     f"not {text!r}")


def as_qa_template(sample):
    """A RAGTruth sample with its passages and question rendered through :data:`halwatch.sample.QA_TEMPLATE`
    (the same answer, spans and label; ``meta["template"] = "qa"``)."""
    from halwatch.sample import Sample

    passages = sample.prompt[sample.context_span[0]:sample.context_span[1]]
    return Sample(context=passages, question=sample.meta["question"], response=sample.response, id=sample.id,
                  label=sample.label, spans=sample.spans, meta={**sample.meta, "template": "qa"}, task="qa")


def in_chat_template(sample, tokenizer):
    """``sample``'s prompt as the user turn of ``tokenizer``'s chat template, with the assistant header after it, as
    text (scored in the detector's own input mode; the same answer, spans and label, ``context_span`` moved with the
    prompt; ``meta["template"] = "chat"``): how a chat front end sends RAGTruth's prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the scoring model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    head, _, tail = text.partition(sample.prompt)
    return wrapped_prompt(sample, head, tail, "chat")


def wrapped_prompt(sample, head: str, tail: str, template: str):
    """``sample`` with its prompt between ``head`` and ``tail`` (the same answer, spans and label, ``context_span``
    moved with the prompt, ``meta["template"] = template``)."""
    from halwatch.sample import Sample

    start, end = sample.context_span or (0, len(sample.prompt))
    return Sample(prompt=head + sample.prompt + tail, response=sample.response, id=sample.id, label=sample.label,
                  spans=sample.spans, context_span=(len(head) + start, len(head) + end),
                  meta={**sample.meta, "template": template})


#: RAGTruth's QA prompt around one passage: its own words (``response.qa_open_models`` sources), with "the following
#: passage" where RAGTruth has "the following three passages".
RAGTRUTH_HEAD = ("Briefly answer the following question:\n{question}\nBear in mind that your response should be "
                 "strictly based on the following passage:\npassage 1:")
RAGTRUTH_TAIL = ("\n\nIn case the passages do not contain the necessary information to answer the question, please "
                 'reply with: "Unable to answer based on given passages."\noutput:')


def as_ragtruth_prompt(sample):
    """A ``context`` + ``question`` sample (squad-shapes) rendered through RAGTruth's QA prompt instead of
    :data:`halwatch.sample.QA_TEMPLATE`: the same answer, spans, label and source, ``context_span`` on the context
    (``meta["template"] = "ragtruth"``). Trained beside the ``qa`` rendering, the template carries no label: on the
    dev split, fitted with squad-shapes alone the verdicts on SQuAD-built answers flagged 9 % of the grounded ones in
    the ``qa`` template and 23 % in this one; with both renderings 9 % and 5 % (docs/results/log.md)."""
    from halwatch.sample import Sample

    head = RAGTRUTH_HEAD.format(question=sample.question)
    start = len(head)
    return Sample(prompt=head + sample.context + RAGTRUTH_TAIL, context_span=(start, start + len(sample.context)),
                  response=sample.response, id=sample.id, label=sample.label, spans=sample.spans,
                  meta={**sample.meta, "template": "ragtruth"})
