"""The README and docs/ stay true to the repository.

- Every relative link and image in README.md and docs/*.md points at a file that exists, and an
  anchor into a markdown page names one of its headings.
- Every ``eeserve ...`` line in a shell code block (```bash, ```sh, ```shell) of those pages
  names a real subcommand (``eeserve bench report --help`` exits 0 and prints its usage), and
  every ``--option`` on that line is one the subcommand accepts.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from eeserve import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
    assert (ROOT / "README.md").is_file()
    names = {p.name for p in PAGES}
    for page in ("api", "engine", "early-exit", "tuning", "calibration", "server", "benchmarks"):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"


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
