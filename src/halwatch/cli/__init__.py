"""The ``halwatch`` command: one module per command, each with its ``add_parser`` and the function that runs it;
what several commands share is in :mod:`halwatch.cli.options`."""

from __future__ import annotations

import argparse
import os
import sys

from halwatch.cli import bench, calibrate, data, fit, generate, models, report, score, serve, watch
from halwatch.cli.bench import bench_default_kind as _bench_default_kind
from halwatch.errors import HalwatchError
from halwatch.progress import configure_logging, set_quiet

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from halwatch import __version__

    parser = argparse.ArgumentParser(
        prog="halwatch",
        description="Detect hallucinations in retrieval-augmented LLM answers: a probability per answer and the "
                    "unsupported character spans.",
    )
    parser.add_argument("--version", action="version", version=f"halwatch {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in (models, score, fit, calibrate, report, data, generate, bench, serve, watch):
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_bench_default_kind(list(sys.argv[1:] if argv is None else argv)))
    configure_logging(args.quiet)
    set_quiet(args.quiet)
    try:
        return args.func(args)
    except HalwatchError as exc:
        print(f"halwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("halwatch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
