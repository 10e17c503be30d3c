"""The package layout stays layered: no import cycles, no upward imports, no hidden imports.

Walks every module of ``eeserve`` with ``ast`` (nothing is imported). Layers, lowest first; a
module may import its own package and any lower layer, never a higher one or a sibling package
of the same layer.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "eeserve"

# Prefix -> (layer, group). A module belongs to the longest prefix that matches it; imports within
# a group are free, across groups they must go to a lower layer.
LAYERS: dict[str, tuple[int, str]] = {
    "eeserve.config": (0, "types"),
    "eeserve.sampling_params": (0, "types"),
    "eeserve.structured_outputs": (0, "types"),
    "eeserve.exit_params": (0, "types"),
    "eeserve.outputs": (0, "types"),
    "eeserve.models": (1, "models"),
    "eeserve.kernels": (2, "kernels"),
    "eeserve.engine": (3, "engine"),
    "eeserve.llm": (4, "api"),
    "eeserve.engine_args": (4, "api"),
    "eeserve": (4, "api"),  # the package's __init__: the public API
    "eeserve.tuning": (5, "tuning"),
    "eeserve.server": (5, "server"),
    "eeserve.bench": (6, "bench"),
    "eeserve.cli": (7, "cli"),
}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> tuple[int, str]:
    prefix = max((g for g in LAYERS if module == g or module.startswith(g + ".")), key=len)
    return LAYERS[prefix]


def _imports(root: Path, path: Path) -> tuple[set[str], list[str]]:
    """(eeserve modules imported at module level, eeserve imports inside functions)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    hidden: list[str] = []
    name = _module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        # ``from pkg import name``: ``name`` may itself be a module of the package.
        return [base, *(f"{base}.{a.name}" for a in node.names)]

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [n for n in targets(child) if n == "eeserve" or n.startswith("eeserve.")]
                if names and in_function:
                    hidden.append(f"{path.name}:{child.lineno} {names[0]}")
                elif names:
                    top.update(names)
            fn = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            walk(child, in_function or fn)

    walk(tree, False)
    return top, hidden


@functools.cache  # parsed once for the three checks of the package
def _graph(root: Path = PKG) -> tuple[dict[str, set[str]], list[str]]:
    modules = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    hidden: list[str] = []
    for name, path in modules.items():
        top, h = _imports(root, path)
        graph[name] = {t for t in top if t in modules}
        hidden += h
    return graph, hidden


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m == n:
                continue
            if state.get(m) == 1:
                found.append([*stack[stack.index(m) :], m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        (ls, gs) = _layer(src)
        for dst in targets:
            (ld, gd) = _layer(dst)
            if gd != gs and ld >= ls:
                bad.append(f"{src} ({gs}, layer {ls}) imports {dst} ({gd}, layer {ld})")
    return sorted(bad)


def test_no_import_cycles() -> None:
    graph, _ = _graph()
    assert len(graph) > 40, "package not found"
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_only_point_down() -> None:
    graph, _ = _graph()
    bad = _upward(graph)
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_eeserve_import_inside_a_function() -> None:
    _, hidden = _graph()
    assert not hidden, "imports hidden in functions:\n" + "\n".join(hidden)


def test_top_level_holds_only_the_public_api() -> None:
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert len(top) <= 12, top
    for name in top:
        assert _layer("eeserve" if name == "__init__" else f"eeserve.{name}")[1] in (
            "types",
            "api",
            "cli",
        )


def test_the_checker_catches_what_it_forbids(tmp_path: Path) -> None:
    """A small fake package with one of each fault: the checks must report all three."""
    root = tmp_path / "eeserve"
    for rel, text in {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/llama.py": "from eeserve.engine.sequence import Sequence\n",
        "engine/__init__.py": "",
        "engine/sequence.py": "from eeserve.models import llama\n",
        "engine/runner.py": "def f():\n    from eeserve.bench import x\n",
        "bench/__init__.py": "from ..engine import runner\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    graph, hidden = _graph(root)
    # The relative import resolved, to the package and its module.
    assert graph["eeserve.bench"] == {"eeserve.engine", "eeserve.engine.runner"}
    assert _cycles(graph) == [
        ["eeserve.engine.sequence", "eeserve.models.llama", "eeserve.engine.sequence"]
    ]
    assert _upward(graph) == [
        "eeserve.models.llama (models, layer 1) imports eeserve.engine.sequence (engine, layer 3)"
    ]
    assert hidden == ["runner.py:2 eeserve.bench"]


def test_test_modules_share_helpers_not_each_other() -> None:
    """A test module imports shared helpers from helper modules (tests/tiny_model.py,
    tests/batch_files.py, ...), never from another test module, so each one runs on its own."""
    bad = []
    for path in sorted((PKG.parent / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("tests.test_")]
    assert not bad, "test modules importing other test modules:\n" + "\n".join(bad)
