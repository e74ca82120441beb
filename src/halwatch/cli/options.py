"""What more than one ``halwatch`` command takes: the scorer's options (``--model``, ``--input-mode``,
``--max-tokens``, ``--batch-size``, ``--no-cache``, ``--device`` and ``--dtype``), ``--windows``, the labelled-input,
question and task options, ``--min-span-confidence``, the Ray options, their argparse types, and the helpers that
read a command's input and build its scorer."""

from __future__ import annotations

import argparse
import logging

from halwatch.errors import InputError
from halwatch.models.loader import DTYPES

log = logging.getLogger("halwatch")

SET_HELP = ("a detector setting, repeatable: n_max=5 (TOHA heads), divergence=mst, n_samples=20 and judge=MODEL "
            "(sampling baselines), C=0.1 (probes), window=8 and window_stride=4 (Lookback Lens span windows), "
            "method=lrp|lrp-cp|ixg, target=token|max, classifier=svm|mlp|random_forest|lstm|threshold, "
            "features=response|prompt|both and length=220 (LRP4RAG); of every detector: "
            "decision=f1|fpr=0.2|mean-fpr=0.2 (the threshold: best F1, or a share of grounded answers flagged, pooled "
            "or on average over datasets) and prior=0.3 (the share of hallucinated answers the probabilities assume)")

SCORER_BATCH_HELP = ("samples per forward pass (default auto: one on a CPU, where batching gains nothing and in "
                     "bfloat16 would move scores with their batch-mates; on a GPU samples of similar length, as "
                     "many as fit 32768 padded tokens)")


def add_device_options(parser) -> None:
    """``--device`` and ``--dtype`` on a command that loads a model (:func:`halwatch.models.loader.load_model`'s
    choices)."""
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]|mps",
                        help="where the model runs (default auto: the GPU where there is one, else the CPU)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="the model's precision (default auto: $HALWATCH_DTYPE where set, else bfloat16 on a "
                             "GPU or CPU that computes it natively, float16 on other GPUs and MPS, float32 on other "
                             "CPUs)")


def add_batch_size_option(p: argparse.ArgumentParser, help_text: str = SCORER_BATCH_HELP) -> None:
    """``--batch-size N|auto`` (default auto: None), the one declaration of every command's, with its help."""
    p.add_argument("--batch-size", type=batch_size, default=None, metavar="N|auto", help=help_text)


def add_scorer_options(p: argparse.ArgumentParser, defaults_from_artifact: bool = False,
                       mode_default: str = "raw") -> None:
    from halwatch.tokens import DEFAULT_MAX_TOKENS, INPUT_MODES

    p.add_argument("--model", default=None,
                   help="scoring model: a registered name (smollm2-135m, gemma3-270m), a local Hugging Face model "
                        "folder, or a hub id" + ("; default: the artifact's model" if defaults_from_artifact
                                                 else "; default: smollm2-135m"))
    p.add_argument("--input-mode", choices=INPUT_MODES, default=None,
                   help="raw: prompt tokens + response tokens; chat: the model's chat template"
                        + ("; default: the artifact's" if defaults_from_artifact else f"; default: {mode_default}"))
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"token cap per sample (prompt and response); a longer context is scored in windows where "
                        f"the command takes --windows, else cut from its left end (default "
                        f"{'the artifact' + chr(39) + 's' if defaults_from_artifact else DEFAULT_MAX_TOKENS})")
    add_batch_size_option(p, SCORER_BATCH_HELP)
    p.add_argument("--no-cache", action="store_true", help="do not read or write the signal cache")
    add_device_options(p)


def add_labelled_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", help="labelled generic JSONL (label 1 = hallucinated)")
    p.add_argument("--datasets", nargs="+", metavar="NAME",
                   help="instead of --input: named datasets (as halwatch bench takes them), the parts of --split")
    p.add_argument("--split", default="train", choices=["train", "dev", "test", "train+dev"],
                   help="with --datasets: which split(s) (default train)")
    add_task_option(p)


def batch_size(text: str) -> int | None:
    return None if text == "auto" else positive_int(text, "or 'auto'")


def positive_int(text: str, other: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number{' ' + other if other else ''}: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_question_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="the prompt of a single answer")
    p.add_argument("--context", help="the retrieved context (or the document summarised, the knowledge of a dialogue "
                                     "reply, the data of a report) of a single answer")
    p.add_argument("--question", help="the question of a single answer (with --context; none for a summary)")


def add_task_option(p: argparse.ArgumentParser) -> None:
    from halwatch.sample import TASKS

    p.add_argument("--task", choices=TASKS, default=None,
                   help="how a context is turned into a prompt where a record names no task: qa (context and "
                        "question), summary, dialogue (knowledge and the last turn as question) or data2text "
                        "(default: qa with a question, summary without one or where it asks for a summary)")


def add_min_span_confidence(p: argparse.ArgumentParser, where: str = "") -> None:
    p.add_argument("--min-span-confidence", type=float, default=None, metavar="P",
                   help="leave out flagged spans whose confidence (the calibrated chance that the span marks "
                        f"unsupported words) is below P{where} (default: the artifact's, 0 for the shipped ones)")


def add_windows_option(p: argparse.ArgumentParser) -> None:
    from halwatch.tokens import MAX_WINDOWS

    p.add_argument("--windows", type=positive_int, default=MAX_WINDOWS, metavar="N",
                   help="a context longer than the token cap is scored in up to N overlapping windows, the answer "
                        "against each, and the most supportive window's verdict kept; 1 cuts the context from the "
                        f"left instead (default {MAX_WINDOWS})")


def add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help=f"{what} on a Ray cluster: its ADDRESS (host:port, auto, ray://...), or none to start a local "
                        f"one on this machine (needs the extra: pip install -e '.[ray]')")
    p.add_argument("--ray-actors", type=int, default=1, help="Ray: actors, each loading the model once (default 1)")
    p.add_argument("--ray-cpus", type=float, default=1, help="Ray: CPUs per actor, its torch threads (default 1)")
    p.add_argument("--ray-gpus", type=float, default=None,
                   help="Ray: GPUs per actor (default 1 with --device cuda, else 0); a fraction also holds the "
                        "actor to that share of the GPU's memory")
    p.add_argument("--ray-batch", type=int, default=8, help="Ray: records per Ray batch (default 8)")
    p.add_argument("--ray-timeout", type=float, default=30,
                   help="Ray: seconds to wait for the cluster's address to answer (default 30)")


def read_input(path: str, skip_invalid: bool, task: str | None = None):
    from halwatch.data.jsonl import read_jsonl

    skipped = []
    samples = read_jsonl(path, skip_invalid=skip_invalid, on_skip=skipped.append, task=task)
    for err in skipped:
        log.warning("skipped %s", err)
    if not samples:
        raise InputError("no usable records", path)
    return samples


def encode_all(scorer, samples, skip_invalid: bool):
    """The samples that fit the token cap (:meth:`halwatch.scorer.Scorer.encode`'s one view, as fitting reads
    them), and their views; the others are an error or, skipped, reported."""
    kept, views = [], []
    for s, found in zip(samples, scorer.encode_many(samples, False, keep_errors=skip_invalid)):
        if isinstance(found, InputError):
            log.warning("skipped %s", found)
            continue
        views += found
        kept += [s] * len(found)
    if not kept:
        raise InputError("no usable records")
    return kept, views


def scorer_options(args, input_mode: str | None = None) -> dict:
    """A command's ``--model``, ``--input-mode`` (or ``input_mode``), ``--max-tokens``, ``--batch-size``,
    ``--device``, ``--dtype`` and ``--windows`` (where it takes them), as
    :meth:`halwatch.scorer.Scorer.from_options` takes them."""
    return {"model": args.model, "input_mode": input_mode or args.input_mode, "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
            **({"windows": args.windows} if getattr(args, "windows", None) else {})}


def scorer_from(args, identity: dict | None = None, input_mode: str | None = None, remote=None):
    """The scorer of a command's options (:func:`scorer_options` and ``--no-cache``), falling back to an
    artifact's ``identity``."""
    from halwatch.scorer import Scorer

    return Scorer.from_options(**scorer_options(args, input_mode), cache=not args.no_cache, identity=identity,
                               remote=remote)


def ray_options(args) -> dict:
    gpus = args.ray_gpus if args.ray_gpus is not None else float(args.device.startswith("cuda"))
    return {"address": None if args.ray == "local" else args.ray, "actors": args.ray_actors,
            "cpus_per_actor": args.ray_cpus, "gpus_per_actor": gpus, "batch_size": args.ray_batch,
            "timeout": args.ray_timeout}


def labelled_input(args, scorer, labelled: bool = True):
    """The labelled samples of ``fit`` and ``calibrate``: ``--input`` (generic JSONL) or ``--datasets`` (named
    datasets, the parts of ``--split``), encodable with ``scorer``; with a description for the artifact. With
    ``labelled`` false, labels are not needed (nor read)."""
    if bool(args.input) == bool(getattr(args, "datasets", None)):
        raise InputError("give either --input FILE or --datasets NAME ...")
    if args.input:
        samples = read_input(args.input, args.skip_invalid, args.task)
        describe = args.describe or str(args.input)
    else:
        from halwatch.data.splits import describe_fit_data, split_of
        from halwatch.eval.datasets import load_dataset

        parts = args.split.split("+")
        samples = [s for name in args.datasets for s in load_dataset(name)[0] if split_of(s) in parts]
        if not samples:
            raise InputError(f"no samples of the split(s) {args.split} in {', '.join(args.datasets)}")
        describe = describe_fit_data(args.datasets, args.split, args.describe)
    unlabelled = [s for s in samples if s.label is None]
    if unlabelled and labelled:
        raise InputError("record has no label: this needs 'label' on every record", unlabelled[0].where)
    samples, _ = encode_all(scorer, samples, args.skip_invalid)
    return samples, describe
