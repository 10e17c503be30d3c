"""Size by meaning: the package stays small enough to hold in one's head, and its sizes follow
what the code means, not a count to be met by cramming.

- No line of ``eeserve/**/*.py`` runs over 100 characters, including the lines ruff's formatter
  leaves long (strings, comments, ``# fmt: skip`` blocks).
- Modules keep to about 400 lines as a guide; one may run to 500 where its parts belong
  together, and none runs past that.
- Functions keep to 60 lines (decorators and docstring included). No function is split only to
  pass the count: where a part has no meaning of its own, the function is written plainly and
  the count is the signal to look again, not a reason to pack lines.

Walks the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "eeserve"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_LINE_CHARS = 100


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_modules_are_at_most_500_lines() -> None:
    long = {
        str(p.relative_to(PKG)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_functions_are_at_most_60_lines() -> None:
    long: dict[str, int] = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = (node.end_lineno or node.lineno) - first + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PKG)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_lines_are_at_most_100_characters() -> None:
    long = [
        f"{p.relative_to(PKG)}:{i} ({len(line)})"
        for p in _modules()
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if len(line) > MAX_LINE_CHARS
    ]
    assert not long, f"lines over {MAX_LINE_CHARS} characters: {long}"
