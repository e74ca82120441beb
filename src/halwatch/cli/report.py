"""``halwatch report``: a page people can look at for a file of scored answers."""

from __future__ import annotations

import shlex

from halwatch.progress import note


def add_parser(sub) -> None:
    """One self-contained page (HTML: every figure inline, no script, no network; or Markdown with PNG figures
    beside it) for a file that halwatch score wrote: how many answers were flagged, with a 95 % interval, by task and
    by each --by field; the spread of the scores with the threshold; against the labels of --input where it has
    them, AUROC, FPR and TPR at the threshold, F1, a reliability diagram, the calibration error and the thresholds
    halwatch calibrate --target-fpr would pick; the answers to read first with their flagged words highlighted; and
    what produced it. A record that is not a scored result, or whose answer --input lacks, stops the command with
    one line naming it, and nothing is written."""
    p = sub.add_parser("report", help="a page (HTML or Markdown) for a file of scored answers",
                       description=add_parser.__doc__)
    p.add_argument("scored", metavar="SCORED.jsonl", help="what halwatch score wrote (--output)")
    p.add_argument("--input", help="the file that was scored: each answer's context, question, response, label and "
                                   "meta, joined by id")
    p.add_argument("--by", nargs="+", default=[], metavar="FIELD",
                   help="also break the flagged share down by these fields: a field of the results (detector, "
                        "scoring_model) or a meta key of --input's records (say, the generating model or the day)")
    p.add_argument("--output", required=True, help="where to write the report (report.html, or report.md)")
    p.add_argument("--format", choices=["html", "md"], default=None,
                   help="html (one self-contained file) or md (Markdown, PNG figures beside it); default: from "
                        "--output's suffix, else html")
    p.add_argument("--title", help="the page's title (default: halwatch report: SCORED)")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from halwatch.report.build import build

    words = ["halwatch", "report", args.scored] + (["--input", args.input] if args.input else []) + (
        ["--by", *args.by] if args.by else []) + ["--output", args.output] + (
        ["--format", args.format] if args.format else []) + (["--title", args.title] if args.title else [])
    command = " ".join(shlex.quote(w) for w in words)
    summary = build(args.scored, args.output, args.input, args.by, args.format, args.title, command)
    o = summary.overall
    note(f"{o.n} answers, {o.flagged} flagged ({100 * o.share:.1f} %)"
         + (f", AUROC {summary.labelled['auroc']:.3f} on {summary.labelled['answers']} labelled"
            if summary.labelled else "") + f" -> {args.output}")
    return 0
