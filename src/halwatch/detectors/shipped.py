"""The fitted artifacts that ship inside the package, and reading an artifact's JSON by file or shipped name."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from halwatch.errors import HalwatchError


def shipped_artifacts() -> dict[str, Path]:
    """Fitted artifacts that ship inside the package, by name (file stem)."""
    folder = resources.files("halwatch") / "artifacts"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}


def artifact_json(source: str | Path, hint: str = "") -> tuple[object, Path]:
    """The parsed JSON of an artifact file, or of a shipped artifact by name, and its path (unchecked: the caller
    checks what it holds). ``hint`` ends the message of a name that is neither."""
    path = Path(source)
    if not path.is_file():
        shipped = shipped_artifacts()
        if str(source) not in shipped:
            raise HalwatchError(f"no artifact file {str(source)!r} and no shipped artifact of that name "
                                f"(shipped: {', '.join(sorted(shipped)) or 'none'}){hint}")
        path = shipped[str(source)]
    try:
        return json.loads(path.read_text(encoding="utf-8")), path
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise HalwatchError(f"{path}: not a readable detector artifact ({exc})") from exc
