"""The docs agree with the tree: the README's size, its layout block, the modules the docs and the docstrings name
(in backquotes: every one, with the file and line of each that names nothing), and every link."""

from __future__ import annotations

import ast
import importlib
import io
import re
import shutil
import tokenize
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------- modules named in backquotes
#: a name in backquotes (single or double), after a Sphinx role if any (``:mod:`.reads```, ``:class:`~.x.Y```)
BACKQUOTED = re.compile(r"(:(?:py:)?\w+:)?(``|`)([^`\n]+?)\2")
#: .reads (after a role), ~..lanes.LaneAgent: against the module's package (``.models`` alone is a folder's name)
RELATIVE = re.compile(r"~?\.+\w+(?:\.\w+)*")
MANY_PARTS = re.compile(r"~?\.+\w+(?:\.\w+)+")  # without a role, a relative name has two parts or more
PREFIXED = re.compile(r"\bpd_transfer(?:\.\w+)+")  # pd_transfer.a.b (perhaps .attribute), also inside a command
UNPREFIXED = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")  # in the docs: sim.peer, a module under pd_transfer
#: what ends a file's name, not a module's (``proxy.json``, ``decode.yaml``)
FILE_SUFFIXES = {"json", "yaml", "yml", "md", "toml", "txt", "png", "log", "csv", "sh", "html", "whl", "gz", "py"}
PY_PATH = re.compile(r"(?<![\w./-])[\w./-]*\w\.py\b")  # connector/decode/reads.py, tests/unit/test_docs.py, cli.py
PACKAGE_PATH = re.compile(r"(?<![\w./-])pd_transfer/[\w/]*/?(?![\w.])")  # pd_transfer/connector/
#: names in the docs that begin with one of our packages' names but are another project's
FOREIGN = {"connector.register_by_name"}  # vLLM's KVConnectorFactory (docs/offload.md)
#: folders of the repository that hold no file the docs or docstrings name
NOT_SOURCES = {".git", ".venv", ".venv-vllm", ".venv-deploy", ".whl", ".models", "runs", "__pycache__"}


@dataclass(frozen=True)
class Named:
    """A module, an attribute of one, or a file, named in backquotes at ``where`` (``path:line``): a dotted
    ``target`` (``pd_transfer.a.b`` or ``pd_transfer.a.b.Attribute``), or a path relative to one of ``bases``
    (a bare file name: anywhere in the repository too)."""

    where: str
    name: str
    target: str
    bases: tuple[Path, ...] = ()


def _named_in(
    text: str, first_line: int, where: Path, root: Path, package: str | None, bases: tuple[Path, ...]
) -> list[Named]:
    """The names in backquotes in ``text``, whose first line is ``first_line`` of the file ``where`` of the
    repository at ``root``. ``package``: the dotted name of the package relative names resolve against (a module's;
    None in markdown, where a dotted name whose first part is one of our packages is read under pd_transfer);
    ``bases``: the folders a path may be relative to."""
    found = []
    for match in BACKQUOTED.finditer(text):
        role, content = match.group(1), match.group(3).strip()
        at = f"{where.relative_to(root).as_posix()}:{first_line + text.count(chr(10), 0, match.start())}"
        if package is not None and (RELATIVE.fullmatch(content) if role else MANY_PARTS.fullmatch(content)):
            relative = content.lstrip("~")
            up = len(relative) - len(relative.lstrip(".")) - 1
            parts = package.split(".")
            target = ".".join([*parts[: len(parts) - up], relative.lstrip(".")]) if up < len(parts) else content
            found.append(Named(at, content, target))
            continue
        found += [Named(at, dotted, dotted) for dotted in PREFIXED.findall(content)]
        parts = content.split(".")
        if package is None and UNPREFIXED.fullmatch(content) and content not in FOREIGN:
            if (root / "pd_transfer" / parts[0] / "__init__.py").is_file() and parts[-1] not in FILE_SUFFIXES:
                found.append(Named(at, content, f"pd_transfer.{content}"))
        if not PREFIXED.search(content):
            paths = PY_PATH.findall(content) + PACKAGE_PATH.findall(content)
            ours = [path for path in paths if _ours(path, (*bases, root), bare=package is not None)]
            found += [Named(at, path, path, bases) for path in ours]
    return found


def _ours(path: str, bases: tuple[Path, ...], *, bare: bool) -> bool:
    """Whether ``path`` names a file of ours: its first folder is one of ours (one of ``bases`` holds it; another
    project's paths, ``vllm/v1/request.py``, are left alone), or, with ``bare``, it is a file's name alone."""
    first, slash, _ = path.partition("/")
    return any((base / first).is_dir() for base in bases) if slash else bare


def names_in_code(root: Path) -> list[Named]:
    """Every name in backquotes in the docstrings, comments and other strings of ``root``'s pd_transfer/: relative
    names resolved against the module's package, paths relative to the module's folder or one above it."""
    found = []
    for path in sorted((root / "pd_transfer").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        bases = tuple(folder for folder in (path.parent, *path.parent.parents) if folder.is_relative_to(root))
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING):
                found += _named_in(token.string, token.start[0], path, root, package, (*bases, root / "pd_transfer"))
    return found


def names_in_docs(root: Path) -> list[Named]:
    """Every pd_transfer module or file named in backquotes in README.md and docs/*.md (outside fenced blocks):
    dotted names under pd_transfer, paths whose first folder is one of ours, relative to the document's folder, the
    repository or pd_transfer/ (a file's name alone may be another project's: docs/architecture.md's are checked
    by :func:`test_every_module_path_in_the_architecture_doc_exists`)."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if FENCE.match(line):
                fenced = not fenced
            elif not fenced:
                found += _named_in(line, number, path, root, None, (path.parent, root, root / "pd_transfer"))
    return found


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module's (or a class's) ``body`` defines, imports included, through ``if`` and ``try`` blocks."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                names.update(_defined(block))
            for handler in getattr(node, "handlers", []):
                names.update(_defined(handler.body))
    return names


#: what :func:`_lookup` answers when it cannot tell (a module this interpreter cannot import: vLLM, in .venv)
UNKNOWN = object()


def _module_file(root: Path, module: str) -> Path | None:
    """The file of the dotted ``module`` (``pd_transfer.a.b``) under ``root``: ``a/b.py`` or ``a/b/__init__.py``."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(module: str, file: Path) -> str:
    return module if file.name == "__init__.py" else module.rpartition(".")[0]


def _imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module ``from ... import`` reads, in a module of ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _lookup(root: Path, module: str, name: str, depth: int = 0) -> object:
    """What ``name`` is in the dotted ``module``: ``(ast node, module)`` where it is defined, if that is one of ours
    (imports followed); the object itself, another project's; None where it is not there; :data:`UNKNOWN` where
    that cannot be told."""
    if module.split(".")[0] != "pd_transfer":
        try:
            return getattr(importlib.import_module(module), name, None)
        except Exception:  # another project's module this interpreter cannot import
            return UNKNOWN
    file = _module_file(root, module)
    if file is None:
        return None
    node = _defined(ast.parse(file.read_text()).body).get(name)
    if node is None and _module_file(root, f"{module}.{name}") is not None:
        return UNKNOWN  # a module of the package, not imported by it: an attribute once imported
    if isinstance(node, ast.ImportFrom) and depth < 8:
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        return _lookup(root, _imported_from(node, _package_of(module, file)), alias.name, depth + 1)
    return None if node is None else (node, module)


def _class_has(root: Path, cls: ast.ClassDef, module: str, attribute: str) -> bool:
    """Whether the class ``cls`` of ``module`` has ``attribute``: in its body, set on ``self``, or from a base class
    (ours looked into, another project's asked, one that cannot be told taken on trust)."""
    if attribute in _defined(cls.body):
        return True
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr == attribute and isinstance(node.ctx, ast.Store):
                return True
    for base in cls.bases:
        expression = base.value if isinstance(base, ast.Subscript) else base
        dotted = ast.unparse(expression)
        head, _, rest = dotted.partition(".")
        found = _lookup(root, module, head)
        if rest and isinstance(found, tuple) and isinstance(found[0], ast.Import):
            found = _lookup(root, *dotted.rsplit(".", 1))  # module.Class, the module imported whole
        elif rest and not isinstance(found, tuple) and found is not None and found is not UNKNOWN:
            found = getattr(found, rest, None)
        if found is UNKNOWN or found is None:
            return True  # cannot be told (or a base that is no name): taken on trust
        if isinstance(found, tuple):
            node, where = found
            if not isinstance(node, ast.ClassDef) or _class_has(root, node, where, attribute):
                return True
        elif hasattr(found, attribute):
            return True
    return False


def resolves(named: Named, root: Path, repo_files: set[str]) -> bool:
    """Whether ``named`` exists under ``root``: its file; or its module, and the attribute after it (a name the
    module defines or imports; a class's member, a second one)."""
    if named.bases:
        target = named.target.rstrip("/")
        return any((base / target).exists() for base in named.bases) or ("/" not in target and target in repo_files)
    parts = named.target.split(".")
    if parts[0] != "pd_transfer" or len(parts) < 2:
        return False
    end = next((end for end in range(len(parts), 1, -1) if _module_file(root, ".".join(parts[:end]))), None)
    if end is None:
        return False
    module, attributes = ".".join(parts[:end]), parts[end:]
    if not attributes:
        return True
    found = _lookup(root, module, attributes[0])
    if found is None:
        return False
    if len(attributes) == 1 or not isinstance(found, tuple) or not isinstance(found[0], ast.ClassDef):
        return True
    return _class_has(root, found[0], found[1], attributes[1])


def broken(named: list[Named], root: Path) -> list[str]:
    """``path:line name`` of every name of ``named`` that does not resolve under ``root``."""
    repo_files = {
        path.name for path in root.rglob("*") if not NOT_SOURCES & set(path.relative_to(root).parts) and path.is_file()
    }
    return [f"{n.where}: `{n.name}`" for n in named if not resolves(n, root, repo_files)]


def test_every_module_named_in_backquotes_in_the_code_exists() -> None:
    """A docstring's or comment's ``pd_transfer.x.y``, ``:mod:`.x```, ``:class:`~.x.Y``` or ``connector/x.py`` names
    a module (or a file, or a module's attribute) that exists."""
    named = names_in_code(ROOT)
    assert len(named) > 300, "the docstrings name modules in backquotes"
    missing = broken(named, ROOT)
    assert not missing, "names in backquotes that name nothing (file:line):\n" + "\n".join(missing)


def test_every_module_named_in_backquotes_in_the_docs_exists() -> None:
    named = names_in_docs(ROOT)
    assert len(named) > 100, "the docs name modules in backquotes"
    missing = broken(named, ROOT)
    assert not missing, "names in backquotes that name nothing (file:line):\n" + "\n".join(missing)


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """pd_transfer/, README.md and docs/ copied, to plant broken names in."""
    shutil.copytree(PACKAGE, tmp_path / "pd_transfer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    return tmp_path


def test_names_planted_that_name_nothing_are_each_found_with_their_line(repo_copy: Path) -> None:
    module = repo_copy / "pd_transfer" / "offload" / "keys.py"
    lines = module.read_text().count("\n")
    module.write_text(
        module.read_text()
        + "\n\n# :mod:`.nowhere` and ``pd_transfer.same_host.handles``\n"
        + "# :class:`~pd_transfer.spec.KVCacheLayout` has no :attr:`~pd_transfer.spec.KVCacheLayout.colour`\n"
        + "# (nor :func:`~..transfer.agent.nothing`); ``transfer/nowhere.py``, ``vllm/v1/request.py`` (vLLM's)\n"
    )
    doc = repo_copy / "docs" / "architecture.md"
    doc_lines = doc.read_text().count("\n")
    doc.write_text(doc.read_text() + "\n`sim.fake_agent`, `pd_transfer.sim.peer.Nope`, `connector/nowhere.py`\n")
    found = broken(names_in_code(repo_copy) + names_in_docs(repo_copy), repo_copy)
    at = [f"pd_transfer/offload/keys.py:{lines + n}" for n in (3, 4, 5)]
    doc_at = f"docs/architecture.md:{doc_lines + 2}"
    planted = [
        f"{at[0]}: `.nowhere`",
        f"{at[0]}: `pd_transfer.same_host.handles`",
        f"{at[1]}: `pd_transfer.spec.KVCacheLayout.colour`",
        f"{at[2]}: `~..transfer.agent.nothing`",
        f"{at[2]}: `transfer/nowhere.py`",
        f"{doc_at}: `sim.fake_agent`",
        f"{doc_at}: `pd_transfer.sim.peer.Nope`",
        f"{doc_at}: `connector/nowhere.py`",
    ]
    assert [name for name in found if name not in planted] == []  # the copy is as clean as the tree
    assert sorted(found) == sorted(planted), found
