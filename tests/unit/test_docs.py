"""The docs agree with the tree: the README's size, its layout block, the modules the docs name, and every link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pd_transfer.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pd_transfer"
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MARKDOWN = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MODULE = re.compile(r"\b(\w+\.py)\b")


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def layout_block() -> list[str]:
    """The lines of the fenced block under the README's "## Layout of the code"."""
    text = README.read_text()
    section = text.split("\n## Layout of the code\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].splitlines()[1:]


def layout_modules() -> list[tuple[str, str]]:
    """(package path relative to pd_transfer/, "" for the top; module file) for every ``*.py`` the block names.

    A line indented by two spaces starts a package when its first word ends in "/", else it names top-level
    modules; deeper lines name modules of the package above them.
    """
    package, named = "", []
    for line in layout_block():
        indent = len(line) - len(line.lstrip(" "))
        words = line.split()
        if indent == 2 and words:
            package = words[0] if words[0].endswith("/") else ""
        named += [(package, module) for module in MODULE.findall(line)]
    return named


def packages() -> list[str]:
    """Every package under pd_transfer/, as "name/" or "name/sub/"."""
    return sorted(f"{init.parent.relative_to(PACKAGE).as_posix()}/" for init in PACKAGE.rglob("__init__.py"))[1:]


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_every_module_in_the_readme_layout_exists() -> None:
    named = layout_modules()
    assert len(named) > 50, "the layout block names the modules of each package"
    missing = [f"{package}{module}" for package, module in named if not (PACKAGE / package / module).is_file()]
    assert not missing, f"the README's layout names modules that do not exist: {missing}"


def test_every_package_is_named_in_the_readme_layout() -> None:
    block = "\n".join(layout_block())
    missing = [package for package in packages() if package not in block]
    assert not missing, f"packages missing from the README's layout: {missing}"


def test_every_module_path_in_the_architecture_doc_exists() -> None:
    named = [span.strip("`") for line in prose_lines(ARCHITECTURE.read_text()) for span in CODE_SPAN.findall(line)]
    paths = [name.removeprefix("pd_transfer/") for name in named if re.fullmatch(r"[\w/]+(/|\.py)", name)]
    # a path is the package's (agent.py, transfer/agent.py) or the repository's (tests/...)
    missing = [path for path in paths if "/" in path and not (PACKAGE / path).exists() and not (ROOT / path).exists()]
    bare = [path for path in paths if "/" not in path and not path.startswith("test_")]
    missing += [path for path in bare if not any(PACKAGE.rglob(path)) and not (ROOT / path).exists()]
    assert len(paths) > 10
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_dotted_module_name_in_the_docs_exists() -> None:
    """``pd_transfer.a.b`` (optionally ``.Attribute``) names a module or package of the tree."""
    missing = []
    for path in MARKDOWN:
        for name in set(re.findall(r"\bpd_transfer(?:\.\w+)+", path.read_text())):
            parts = name.split(".")[1:]
            found = [i for i in range(len(parts), 0, -1) if _is_module(parts[:i])]
            if not found or found[0] < len(parts) - 1:
                missing.append(f"{path.name}: {name}")
    assert not missing, f"dotted names of modules that do not exist: {missing}"


def _is_module(parts: list[str]) -> bool:
    base = PACKAGE.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_and_heading(path: Path) -> None:
    broken = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target}: no such heading")
    assert not broken, f"{path.name}: {broken}"


def test_the_readme_settings_table_is_the_one_the_settings_declare() -> None:
    """The block between the README's settings markers is ``Settings.markdown_table()`` (``pd-transfer settings
    --table``) exactly: every variable the package reads, with its default, values and meaning."""
    section = README.read_text().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert table == Settings.markdown_table(), "regenerate the block with `pd-transfer settings --table`"
