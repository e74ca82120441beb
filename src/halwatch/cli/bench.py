"""``halwatch bench KIND``: fit and evaluate detectors under the papers' protocols (``run``, the default), measure
speed (``speed``, ``relevance``, ``serve``) and check the default detector (``invariance``, ``calibration``,
``prior``, ``architectures``)."""

from __future__ import annotations

import argparse
import sys

from halwatch.cli.options import (
    SET_HELP,
    add_batch_size_option,
    add_device_options,
    add_ray_options,
    add_scorer_options,
    add_windows_option,
    positive_int,
    ray_options,
    scorer_from,
)

#: The ``--parts`` each measuring subcommand of ``halwatch bench`` has.
BENCH_PARTS = {"speed": ("lengths", "split", "batched", "phases", "peer", "evidence", "adapter"),
               "serve": ("throughput", "overload", "drain", "stream")}
BENCH_KINDS = ("run", "speed", "relevance", "serve", "invariance", "calibration", "prior", "architectures",
               "report")


def bench_default_kind(argv: list[str]) -> list[str]:
    """``halwatch bench --protocol ...`` (no kind named) as ``halwatch bench run --protocol ...``."""
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is None or argv[command] != "bench":
        return argv
    rest = argv[command + 1:]
    if rest and (rest[0] in BENCH_KINDS or rest[0] in ("-h", "--help")):
        return argv
    return argv[:command + 1] + ["run"] + rest


def _scorer_options(args) -> dict:
    return {"device": args.device, "dtype": args.dtype}


def _speed(args) -> None:
    from halwatch.eval.speed import run_speed

    run_speed(model=args.model or "smollm2-135m", lengths=args.lengths, repeats=args.repeats, device=args.device,
              dtype=args.dtype, parts=args.parts or ("lengths", "split"), batches=args.batches,
              batched_answers=args.answers, phase_batch=args.batch_size, processes=args.processes)


def _serve(args) -> None:
    from halwatch.serve.bench import run_serve_bench

    run_serve_bench(detector=args.detector, n=args.answers, levels=args.clients, device=args.device,
                    dtype=args.dtype, batch_size=args.batch_size, parts=args.parts or BENCH_PARTS["serve"],
                    overload_seconds=args.overload_seconds)


def _invariance(args) -> None:
    from halwatch.eval.invariance import run_invariance

    run_invariance(detector=args.detector, dataset=args.dataset, split=args.eval_split, n=args.answers,
                   out=args.out_file, scorer_options=_scorer_options(args))


def _calibration(args) -> None:
    """``bench calibration`` and ``bench prior``: a detector's operating point checked on named sets."""
    from halwatch.eval.calibration_check import run_calibration_check, run_prior_check

    common = {"detector": args.detector, "datasets": args.datasets, "split": args.eval_split, "out": args.out_file,
              "scorer_options": _scorer_options(args)}
    if args.what == "prior":
        run_prior_check(draws=args.draws, **common)
    else:
        run_calibration_check(target_fpr=args.target_fpr, seeds=args.seeds, **common)


def _architectures(args) -> None:
    from halwatch.eval.architectures import survey

    survey(model_types=args.types)


def _relevance(args) -> None:
    from halwatch.eval.relevance_speed import run_relevance_speed

    run_relevance_speed(model=args.model or "smollm2-135m", prompt_tokens=args.prompt_tokens,
                        response_tokens=args.response_tokens, repeats=args.repeats)


def _report(args) -> None:
    from halwatch.report.speed import run_report_speed

    run_report_speed(args.scored, args.input, args.records, args.repeats, args.by)


#: The bench kinds other than ``run``, each run by one function.
_KINDS = {"report": _report, "speed": _speed, "serve": _serve, "invariance": _invariance, "calibration": _calibration,
          "prior": _calibration, "architectures": _architectures, "relevance": _relevance}


def cmd_bench(args) -> int:
    if args.what in _KINDS:
        _KINDS[args.what](args)
        return 0
    from halwatch.detectors import parse_settings
    from halwatch.eval.bench import run_bench

    remote = None
    if args.ray is not None:
        from functools import partial

        from halwatch.scale import ray_signals

        remote = partial(ray_signals, **ray_options(args))
    scorer = scorer_from(args, remote=remote)
    run_bench(scorer, args.detectors, args.protocol, args.datasets, args.out, seeds=args.seeds,
              probe_size=args.probe_size, settings=parse_settings(args.set), sweeps=args.sweeps, sweep=args.sweep,
              map_from_model=args.map_from_model, command="halwatch " + " ".join(sys.argv[1:]),
              eval_split=args.eval_split, never=args.never, hold_out=args.hold_out, artifacts=args.artifacts)
    return 0


def add_parser(sub) -> None:
    """``halwatch bench KIND``: each kind with its own options and help (``halwatch bench --protocol ...`` without a
    kind is ``halwatch bench run``, see :func:`bench_default_kind`)."""
    p = sub.add_parser("bench", help="benchmark detectors under the papers' protocols, or measure speed",
                       description="Benchmarks, one kind per subcommand: run (the default when none is named) fits "
                                   "and evaluates detectors under the papers' protocols; speed, relevance and serve "
                                   "measure time, and report the time of halwatch report; invariance and calibration "
                                   "check the default's scores across templates and its operating point. `halwatch "
                                   "bench KIND --help` for each.")
    kinds = p.add_subparsers(dest="what", metavar="KIND", required=True)
    for add in (_add_run, _add_speed, _add_architectures, _add_relevance,
                _add_serve, _add_invariance, _add_calibration, _add_prior, _add_report):
        add(kinds)
    p.set_defaults(func=cmd_bench)


def _add_run(kinds) -> None:
    from halwatch.eval.protocols import PROTOCOLS

    r = kinds.add_parser("run", help="fit and evaluate detectors under protocols (the default)",
                         description="Fit and evaluate detectors on cached signals under the papers' protocols and "
                                     "write results.json, predictions.jsonl, report.md and figures to --out.")
    r.add_argument("--protocol", nargs="+", choices=PROTOCOLS, required=True, help="one or more protocols")
    r.add_argument("--detectors", nargs="+", default=[],
                   help="detector names (halwatch.detectors.DETECTORS), or NAME:KEY=VALUE,... for a variant with "
                        "settings, e.g. lrp4rag:classifier=mlp: fitted under each protocol")
    r.add_argument("--artifacts", nargs="+", default=[], metavar="NAME|FILE",
                   help="shape-transfer: fitted artifacts (shipped names such as default, or files of `halwatch "
                        "fit --datasets ... --split ...`) scored as they are, with no fit; refused on the split they "
                        "were fitted on for the sets they were fitted on")
    r.add_argument("--datasets", nargs="+", required=True,
                   help="ragtruth:GENERATOR (llama-2-7b-chat, llama-2-13b-chat, mistral-7B-instruct), "
                        "ragtruth:G1+G2 (pooled), ragtruth:all, ragtruth-qa:GENERATOR (the same answers through the "
                        "QA template), ragtruth-chat:GENERATOR (RAGTruth's prompt in the default model's chat "
                        "template), squad-shapes, squad-shapes-ragtruth (the same answers through RAGTruth's "
                        "prompt), faithbench, xsum-hallucination, summedits, bump, diasumfact, "
                        "begin, faithdial, rotowire (NAME@K: at most K answers per source document instead of the "
                        "set's own cap, NAME@all: every one), a labelled JSONL file, or several joined by commas "
                        "(pooled)")
    r.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                   help="shape-transfer: the split scored (default dev; test once per published table)")
    r.add_argument("--never", nargs="+", default=[], metavar="NAME",
                   help="shape-transfer: datasets scored on --eval-split by the pooled fit but never trained on "
                        "(shapes the detector has not seen)")
    r.add_argument("--hold-out", nargs="*", metavar="NAME",
                   help="shape-transfer: fit without each of these datasets in turn (default: each trained one; "
                        "--hold-out alone: none, only the pooled fit)")
    r.add_argument("--seeds", type=int, default=5, help="number of seeds (default 5)")
    r.add_argument("--probe-size", type=int, help="probe samples drawn from the training part (default: all for "
                                                  "ragtruth-official and kfold, 100 for random-splits)")
    r.add_argument("--sweeps", action="store_true",
                   help="also AUROC vs probe size and vs N_max, and the Δ scatter of heads (TOHA figures)")
    r.add_argument("--sweep", metavar="KEY=V1,V2,...",
                   help="also run the first protocol on the first dataset for each value of a detector setting "
                        "(e.g. length=100,220,300 for LRP4RAG's resampling length, Table 3); table in sweep-KEY.md")
    r.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help=SET_HELP + "; applies to every detector that has the setting")
    r.add_argument("--map-from-model", metavar="MODEL",
                   help="also Lookback Lens cross-model transfer: fitted with MODEL, mapped linearly onto --model's "
                        "heads (official split; rows named lookback-lens<-MODEL)")
    add_scorer_options(r)
    add_windows_option(r)
    add_ray_options(r, "compute the signals not yet cached")


def _add_speed(kinds) -> None:
    """Times the scoring model's forward, the signal capture and the default detector per sequence length (lengths),
    and per answer the time inside and outside the model's forward for batches of RAGTruth answers (split), and
    answers/s of the whole scoring path in its own batches against a plain forward of the same batches (batched);
    milliseconds per answer of each phase of that path (phases); seconds per answer of halwatch and of
    LM-Polygraph's white-box estimators, whole processes (peer); seconds per answer without and with evidence from
    attention, one answer per pass (evidence)."""
    s = kinds.add_parser("speed", help="forward, capture and default-detector times; time inside and outside the "
                                       "forward",
                         description=_add_speed.__doc__)
    s.add_argument("--model", default=None, help="scoring model (default smollm2-135m)")
    s.add_argument("--parts", nargs="+", choices=BENCH_PARTS["speed"],
                   help="what to measure (default lengths split; batched is the GPU measure)")
    s.add_argument("--lengths", type=_speed_length, nargs="+", default=[256, 512, 1024],
                   help="lengths: sequence lengths, each at least 128 tokens (default 256 512 1024)")
    s.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (median reported; default 3)")
    s.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                   help="split: batch sizes (default 1 8 32; 32 answers)")
    s.add_argument("--answers", type=int, default=None,
                   help="batched, phases: RAGTruth test answers to score (default all 450; a seeded sample when "
                        "fewer); evidence: the same (default 32); peer: answers for halwatch and LM-Polygraph, "
                        "each a whole process (default 50)")
    add_batch_size_option(s, "phases: answers per batch (default auto: as many as fit the scorer's token budget)")
    s.add_argument("--processes", type=positive_int, default=1, metavar="N",
                   help="batched: N processes share the device, each scoring the answers with its own model and "
                        "1/N of the GPU's memory, as --ray-actors N --ray-gpus 1/N deploys them; their answers/s "
                        "together (default 1)")
    add_device_options(s)


def _add_architectures(kinds) -> None:
    """Builds a tiny random-weight model of every causal-LM architecture of the installed transformers (nothing
    downloaded) and prints what halwatch does with it: works (the capture passes its check against the model's eager
    attention and Lookback Lens fits and scores), refused in one line naming it, or not built from a small config."""
    arch = kinds.add_parser("architectures", help="every causal-LM architecture of the installed transformers: works, "
                                                  "refused by name, or not built",
                            description=_add_architectures.__doc__)
    arch.add_argument("--types", nargs="+", default=None, help="only these model types (default all)")


def _add_report(kinds) -> None:
    """Builds the HTML and the Markdown report (halwatch report) of --records scored records, made from a scored
    file's records repeated (each copy a new id; with --input, their answers too), and prints the seconds each
    took."""
    rep = kinds.add_parser("report", help="the time halwatch report takes for many scored records",
                           description=_add_report.__doc__)
    rep.add_argument("--scored", required=True, help="a file halwatch score wrote, whose records are repeated")
    rep.add_argument("--input", help="the file that was scored (the report then shows contexts and labels)")
    rep.add_argument("--records", type=positive_int, default=10_000, help="records in the report (default 10000)")
    rep.add_argument("--by", nargs="+", default=[], metavar="FIELD", help="as halwatch report --by")
    rep.add_argument("--repeats", type=positive_int, default=3, help="timed builds per format (median; default 3)")


def _add_relevance(kinds) -> None:
    """Times the LRP4RAG relevance pass on a real RAGTruth prompt against one forward + backward pass, and reports
    conservation."""
    rel = kinds.add_parser("relevance", help="the LRP4RAG relevance pass against one forward + backward pass",
                           description=_add_relevance.__doc__)
    rel.add_argument("--model", default=None, help="scoring model (default smollm2-135m)")
    rel.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default 512)")
    rel.add_argument("--response-tokens", type=int, default=128, help="response length (default 128)")
    rel.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported; default 3)")


def _add_serve(kinds) -> None:
    """Runs the scoring service in-process on real RAGTruth test answers: throughput and latency per level of
    concurrent clients, refusals under overload, the drain on shutdown and the stream policies' times."""
    sv = kinds.add_parser("serve", help="the HTTP service's throughput, latency, refusals and drain",
                          description=_add_serve.__doc__)
    _add_bench_detector(sv)
    sv.add_argument("--answers", type=int, default=100, help="RAGTruth test answers sent (default 100)")
    sv.add_argument("--clients", type=int, nargs="+", default=[1, 8, 50],
                    help="concurrent clients per level (default 1 8 50)")
    sv.add_argument("--parts", nargs="+", choices=BENCH_PARTS["serve"],
                    help="what to measure (default all): throughput per client level, overload (refusals at 2x and "
                         "5x), drain (16 in flight), stream (the policies' time to first and last token)")
    sv.add_argument("--overload-seconds", type=float, default=30.0,
                    help="how long each overload level sends (default 30)")
    add_batch_size_option(sv, "answers per forward batch of the service (default auto)")
    add_device_options(sv)


def _add_invariance(kinds) -> None:
    """Renders the same RAGTruth answers through several prompt templates and reports how far the detector's scores and
    verdicts move."""
    inv = kinds.add_parser("invariance", help="the same answers through several templates: how far scores move",
                           description=_add_invariance.__doc__)
    _add_bench_detector(inv)
    inv.add_argument("--dataset", "--datasets", dest="dataset", default="ragtruth:all",
                     help="a RAGTruth dataset name, whose answers are rendered (default ragtruth:all)")
    inv.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                     help="the split the answers come from (default dev; test once per published table)")
    inv.add_argument("--answers", type=int, default=100, help="answers rendered (default 100)")
    _add_output(inv)


def _add_calibration(kinds) -> None:
    """Recalibrates the detector on one half of each dataset's split with --target-fpr and reports the false-positive
    rate reached on the other half, averaged over seeds."""
    cal = _add_check(kinds, "calibration", "squad-shapes",
                     help="does `halwatch calibrate --target-fpr` hold the rate on held-out halves?",
                     description=_add_calibration.__doc__)
    cal.add_argument("--target-fpr", type=float, default=0.1, help="the rate asked for (default 0.1)")
    cal.add_argument("--seeds", type=int, default=5, help="random halvings per dataset (default 5)")
    _add_output(cal)


def _add_prior(kinds) -> None:
    """Estimates each dataset's share of hallucinated answers from its scores alone, as `halwatch calibrate --prior
    estimate` does, against the true share, with the calibration error before and after restating the probabilities;
    then on resamples drawn at other shares."""
    pri = _add_check(kinds, "prior", "ragtruth:all",
                     help="does `halwatch calibrate --prior estimate` find the share of hallucinated answers?",
                     description=_add_prior.__doc__)
    pri.add_argument("--draws", type=int, default=30, help="resamples at each share (default 30)")
    _add_output(pri)


def _add_check(kinds, name: str, dataset: str, **texts):
    """A bench kind that checks a detector on named sets (``--detector``, ``--datasets``, ``--eval-split``)."""
    p = kinds.add_parser(name, **texts)
    _add_bench_datasets(p, dataset)
    return p


def _add_output(p) -> None:
    """``--out-file`` and the device options, last in a bench kind's options."""
    p.add_argument("--out-file", help="also write the figures to this JSON file")
    add_device_options(p)


def _add_bench_detector(p) -> None:
    p.add_argument("--detector", "--detectors", dest="detector", default="default",
                   help="shipped artifact name or artifact file (default: default)")


def _add_bench_datasets(p, default: str) -> None:
    """``--detector``, ``--datasets`` and ``--eval-split`` of a bench kind that checks a detector on named sets."""
    _add_bench_detector(p)
    p.add_argument("--datasets", nargs="+", default=[default], help=f"datasets (default {default})")
    p.add_argument("--eval-split", choices=["dev", "test"], default="dev",
                   help="the split used (default dev; test once per published table)")


def _speed_length(text: str) -> int:
    """A sequence length of `bench speed --lengths`: room for the timed answer (about 70 tokens) and its prompt."""
    value = positive_int(text)
    if value < 128:
        raise argparse.ArgumentTypeError(f"must be at least 128 tokens (the timed answer alone has about 70), "
                                         f"got {value}")
    return value
