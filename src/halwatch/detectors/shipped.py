"""The fitted artifacts that ship inside the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_artifacts() -> dict[str, Path]:
    """Fitted artifacts that ship inside the package, by name (file stem)."""
    folder = resources.files("halwatch") / "artifacts"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}
