"""The README and docs/ as a reader meets them: every `halwatch` command they show parses with the real command
line (no option or subcommand the parser lacks), and every relative link points at a file that exists and, where it
names a section, at a heading of that file (GitHub's anchors)."""

import re
import shlex
from pathlib import Path

import pytest

from halwatch.cli import _bench_default_kind, build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "results" / "README.md",
         ROOT / "docs" / "results" / "log.md"]


def _segments(text: str):
    """``(language, body)`` of each stretch of the page: ``language`` is ``None`` outside fenced blocks, else the
    fence's language ("" when it names none); fences paired line by line."""
    language, body = None, []
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if not fence:
            body.append(line)
            continue
        yield language, "\n".join(body)
        language, body = (fence.group(1) if language is None else None), []
    yield language, "\n".join(body)


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return "\n".join(body for language, body in _segments(text) if language is None)


def _commands(text: str):
    """``halwatch ...`` command lines of the fenced shell blocks (continuations joined, ``&`` and comments cut)."""
    for language, block in _segments(text):
        if language not in ("", "bash", "sh", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not re.match(r"(\.venv/bin/)?halwatch\s", line):
                continue
            words = shlex.split(line, comments=True)
            words = [w for w in words if w != "&"]
            cut = next((i for i, w in enumerate(words) if w in ("|", ">", "&&", ";")), len(words))
            yield line, words[1:cut]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", _prose(page.read_text()), flags=re.M)}


def test_the_anchor_rule_is_githubs():
    # headings of docs/results/README.md as GitHub renders their anchors (read off github.com's rendering rules:
    # lower case, backticks and punctuation gone, each space a hyphen, so ' - ' gives '---')
    assert _slug("Restating the share of hallucinated answers: `calibrate --prior` (issue 36), test split, read once") \
        == "restating-the-share-of-hallucinated-answers-calibrate---prior-issue-36-test-split-read-once"
    assert _slug("Device and precision") == "device-and-precision"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(page, capsys):
    parser = build_parser()
    seen = 0
    for line, argv in _commands(page.read_text()):
        try:
            parser.parse_args(_bench_default_kind(argv))
        except SystemExit as exc:
            if exc.code:  # --help exits 0
                pytest.fail(f"{page.name}: {line!r} does not parse: {capsys.readouterr().err.strip()[-300:]}")
        seen += 1
    if page == ROOT / "README.md":
        assert seen >= 10, f"only {seen} halwatch commands found in the README: is the extraction broken?"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page):
    text = _prose(page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_python_example_prints_what_it_shows(capsys):
    """The README's Python example, run as it stands (float32, the session's pin, in which its output was made),
    prints the output block that follows it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python\n"):]
    blocks = [body for language, body in _segments(section) if language is not None]
    code, shown = blocks[0], blocks[1]
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == shown.strip()
