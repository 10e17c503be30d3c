"""The README, docs/ and the benchmark results stay true to the repository.

- Every relative link and image in README.md, docs/*.md, CHANGELOG.md and bench/results/README.md
  points at a file that exists, and an anchor into a markdown page names one of its headings.
- Every ``eeserve ...`` line in a shell code block (```bash, ```sh, ```shell) of those pages
  names a real subcommand (``eeserve bench report --help`` exits 0 and prints its usage), and
  every ``--option`` on that line is one the subcommand accepts.
- The repository speaks in the present tense: no numbered history labels, issue numbers or lost
  runs in the README, docs/, the package's source or any path or text under bench/results/ (the
  history is CHANGELOG.md's), and no citation of a design document other than docs/design.md.
- Every result JSON states where it came from, and every table of the README's headline results
  links to the result file it comes from.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from eeserve import cli

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "CHANGELOG.md",
    RESULTS / "README.md",
]
SHELL_LANGS = {"bash", "sh", "shell"}

_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
# [text](target) and ![alt](target), with an optional "title"; the text may hold `code`.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_OPTION = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")


def _split_fences(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Prose lines (fenced blocks blanked out) and the fenced blocks as (language, lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if current is None and m:
            current = []
            blocks.append((m.group(2).lower(), current))
            prose.append("")
        elif current is not None and m and not m.group(2):
            current = None
            prose.append("")
        elif current is not None:
            current.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose, _ = _split_fences(page.read_text(encoding="utf-8"))
    anchors: set[str] = set()
    for line in prose:
        m = _HEADING.match(line)
        if m:
            slug = _slug(m.group(2))
            n = 1
            unique = slug
            while unique in anchors:  # GitHub numbers repeated headings: slug, slug-1, ...
                unique = f"{slug}-{n}"
                n += 1
            anchors.add(unique)
    return anchors


def _links() -> list[tuple[Path, int, str]]:
    found = []
    for page in PAGES:
        prose, _ = _split_fences(page.read_text(encoding="utf-8"))
        for number, line in enumerate(prose, 1):
            for m in _LINK.finditer(line):
                found.append((page, number, m.group(1)))
    return found


def _is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, https:, mailto:


def test_pages_exist() -> None:
    for page in PAGES:
        assert page.is_file(), f"{page.relative_to(ROOT)} is missing"
    names = {p.name for p in PAGES}
    for page in ("api", "engine", "early-exit", "tuning", "calibration", "server", "benchmarks"):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"
    assert (ROOT / "docs" / "design.md").is_file(), "docs/design.md is missing"


def test_relative_links_point_at_files() -> None:
    broken = []
    for page, number, target in _links():
        if _is_external(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_anchors_name_headings() -> None:
    broken = []
    for page, number, target in _links():
        if _is_external(target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        dest = (page.parent / path) if path else page
        if dest.suffix != ".md" or not dest.is_file():
            continue  # a missing file is test_relative_links_point_at_files's failure
        if anchor not in _anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "anchors that name no heading:\n" + "\n".join(broken)


def _command_lines() -> list[tuple[str, str]]:
    """(where, line) for every line of a shell block that runs `eeserve`, continuations joined."""
    found = []
    for page in PAGES:
        _, blocks = _split_fences(page.read_text(encoding="utf-8"))
        for lang, lines in blocks:
            if lang not in SHELL_LANGS:
                continue
            joined: list[str] = []
            for line in lines:
                if joined and joined[-1].endswith("\\"):
                    joined[-1] = joined[-1][:-1] + " " + line.strip()
                else:
                    joined.append(line.strip())
            found += [(page.name, line) for line in joined if line.startswith("eeserve ")]
    return found


COMMANDS = _command_lines()


def test_readme_shows_commands() -> None:
    assert any(where == "README.md" for where, _ in COMMANDS), "no eeserve command in the README"


def _subcommand_words(line: str) -> list[str]:
    """The words after `eeserve` up to the first option or [optional part]: `bench report`,
    `serve smollm2` (a positional argument is harmless: --help still answers first)."""
    words = []
    for word in shlex.split(line, comments=True)[1:]:
        if word.startswith(("-", "[")):
            break
        words.append(word)
    return words


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[line for _, line in COMMANDS])
def test_documented_command_exists(where: str, line: str, capsys: pytest.CaptureFixture) -> None:
    words = _subcommand_words(line)
    assert words, f"{where}: `{line}` names no subcommand"
    with pytest.raises(SystemExit) as exc:
        cli.main([*words, "--help"])
    out, err = capsys.readouterr()
    assert exc.value.code == 0, (
        f"{where}: `eeserve {' '.join(words)} --help` exited {exc.value.code}; the command "
        f"documented as `{line}` does not exist: {err.strip().splitlines()[-1:]}"
    )
    assert out.startswith("usage: eeserve "), out[:200]
    prog = out.split("\n", 1)[0][len("usage: ") :].split(" [", 1)[0].split()
    assert prog[1:] == words[: len(prog) - 1] and len(prog) > 1, (
        f"{where}: `{line}`: --help answered for `{' '.join(prog)}`"
    )
    code = line.split(" #", 1)[0]  # options named in a trailing comment are prose
    # A quoted value (``--server-args "--x 1"``, ``--server-args=--x``) is not an option here.
    words_ = [w.split("=", 1)[0] for w in shlex.split(code) if " " not in w]
    unknown = [
        opt
        for opt in _OPTION.findall(" ".join(words_))
        if opt != "--help" and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", out)
    ]
    assert not unknown, (
        f"{where}: `{line}`: `eeserve {' '.join(prog[1:])}` has no option {', '.join(unknown)}"
    )


# History narration that belongs in CHANGELOG.md (and git), not in what describes the project now.
_NARRATION = [
    re.compile(r"(?i)(?<![a-z])sessions?[ _-]?\d+"),  # "session 6", "Session 9", "_session10"
    re.compile(r"(?i)\bissues? #?\d+"),  # "issue 13", "issues 16 and 18"
    re.compile(r"(?i)\bfiles were lost\b|\blost to a checkout\b"),
    re.compile(r"(?i)\bthe issue'?s (targets?|target of)\b"),
]
# The external design brief is not in the repository; docs/design.md is the design it cites.
_OUTSIDE_DESIGN = re.compile(r"DESIGN\.md")


def _narrated_files() -> list[Path]:
    """README, docs/, bench/results/README.md, the source of the package, the scripts and the
    tests (but this one, which names the patterns), and every text file under bench/results/
    (CHANGELOG.md is where history belongs)."""
    files = [p for p in PAGES if p.name != "CHANGELOG.md"]
    files += sorted((ROOT / "eeserve").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    files += [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]
    text_kinds = {".json", ".md", ".txt", ".log", ".csv"}
    files += [p for p in sorted(RESULTS.rglob("*")) if p.suffix in text_kinds and p not in files]
    return files


def test_no_history_narration() -> None:
    found = []
    paths = sorted(RESULTS.rglob("*")) + sorted((ROOT / "bench" / "scripts").rglob("*"))
    for path in paths:
        name = str(path.relative_to(ROOT))
        found += [f"{name}: named {m.group(0)!r}" for rx in _NARRATION for m in rx.finditer(name)]
    for path in _narrated_files():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            for rx in _NARRATION:
                found += [
                    f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}" for m in rx.finditer(line)
                ]
    assert not found, "history narration (it goes to CHANGELOG.md):\n" + "\n".join(found)


def test_design_citations_point_at_docs_design() -> None:
    files = [p for p in PAGES if p.name != "CHANGELOG.md"] + sorted(
        (ROOT / "eeserve").rglob("*.py")
    )
    files += sorted((ROOT / "tests").glob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _OUTSIDE_DESIGN.search(line)
    ]
    assert not found, "cites a design document outside the repository (use docs/design.md):\n" + (
        "\n".join(found)
    )


def test_result_files_state_their_provenance() -> None:
    missing = []
    for path in sorted(RESULTS.rglob("*.json")):
        prov = json.loads(path.read_text(encoding="utf-8")).get("provenance", {})
        lacking = [k for k in ("commit", "date", "machine", "command") if not prov.get(k)]
        if lacking:
            missing.append(f"{path.relative_to(ROOT)}: no {', '.join(lacking)}")
    assert not missing, "result files without provenance:\n" + "\n".join(missing)


def _headline_tables() -> list[tuple[int, list[str]]]:
    """(line number, links in the prose since the previous table) for each table of the README's
    "Headline results" section."""
    prose, _ = _split_fences((ROOT / "README.md").read_text(encoding="utf-8"))
    start = next(i for i, line in enumerate(prose) if line.startswith("## Headline results"))
    tables, links, in_table = [], [], False
    for number, line in enumerate(prose[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if line.startswith("|") and not in_table:
            tables.append((number, links))
            links, in_table = [], True
        elif not line.startswith("|"):
            in_table = False
            links += [m.group(1) for m in _LINK.finditer(line)]
    return tables


def test_headline_tables_link_their_result_files() -> None:
    tables = _headline_tables()
    assert len(tables) >= 3, "the README's headline results lost their tables"
    problems = []
    for number, links in tables:
        results = [t.split("#", 1)[0] for t in links if t.startswith("bench/results/")]
        if not results:
            problems.append(f"README.md:{number}: the table links no result file before it")
        for target in results:
            path = ROOT / target
            record = path if path.suffix == ".json" else path.parent / "report.json"
            if path.is_dir() or not record.is_file():
                problems.append(f"README.md:{number}: {target} is not a result file with a JSON")
                continue
            prov = json.loads(record.read_text(encoding="utf-8")).get("provenance", {})
            if not (prov.get("command") and prov.get("commit")):
                problems.append(f"README.md:{number}: {target} states no command and commit")
    assert not problems, "\n".join(problems)
