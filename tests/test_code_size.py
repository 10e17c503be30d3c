"""The package stays small enough to hold in one's head: no module over 400 lines, no function
over 60 (decorators and docstring included). Walks the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "eeserve"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_modules_are_at_most_400_lines() -> None:
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
