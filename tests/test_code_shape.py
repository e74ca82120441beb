"""The shape of the code, kept: small modules and functions, no module importing another's private names or reaching
into another object's private members outside detectors/, and no import cycle (../shared/tools/import_cycles.py,
where the shared tools are beside the checkout)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = sorted((SRC / "halwatch").rglob("*.py"))
#: The most lines of a module and of a function.
MODULE_LINES, FUNCTION_LINES = 500, 80


def _trees():
    return [(path, ast.parse(path.read_text(encoding="utf-8"))) for path in MODULES]


def test_no_module_over_500_lines_and_no_function_over_80():
    long_modules = [f"{p.relative_to(SRC)}: {n}" for p in MODULES
                    if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES]
    long_functions = [f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                      for path, tree in _trees() for node in ast.walk(tree)
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
    assert len(MODULES) > 100 and not long_modules and not long_functions, long_modules + long_functions


def test_no_private_name_crosses_a_module():
    """No ``from halwatch.x import _name``; outside detectors/ no ``obj._member`` of another object (attributes that
    halwatch itself keeps on a library's object are named ``_halwatch...``)."""
    found = []
    for path, tree in _trees():
        inside_detectors = "detectors" in path.relative_to(SRC / "halwatch").parts
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("halwatch"):
                found += [f"{path.relative_to(SRC)}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not node.attr.startswith("_halwatch") and not inside_detectors
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not found, found


def test_no_import_cycle():
    tool = SRC.parents[1] / "shared" / "tools" / "import_cycles.py"
    if not tool.exists():
        pytest.skip("../shared/tools is not beside this checkout")
    out = subprocess.run([sys.executable, str(tool), str(SRC)], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith("no import cycles"), out
