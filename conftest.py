"""The test suite's kinds: every test is marked with the folder of ``tests/`` it lives in (``unit``, ``process``,
``vllm``, ``docker``, ``gpu``; pyproject.toml registers them), so that ``-m`` selects a kind and nobody has to remember
the marker. A test outside those folders is a usage error. Tests marked ``gpu`` are skipped, with the reason, where
torch sees no CUDA device. The header says whether freed heap memory is poisoned (``MALLOC_PERTURB_``, which
scripts/test sets: glibc reads it when the process starts, so a conftest cannot set it for the tests themselves).

This file sits at the repository's root, not in ``tests/``: pytest puts a conftest's folder on ``sys.path``, and with
``tests/`` there ``import vllm`` would find the folder ``tests/vllm`` (a namespace package) instead of failing where
vLLM is not installed. The helpers shared by several kinds live in ``tests/support`` (pyproject's ``pythonpath``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

pytest_plugins = ["exit_bound"]  # the test process must end soon after its summary

TESTS = Path(__file__).resolve().parent / "tests"
KINDS = ("unit", "process", "vllm", "docker", "gpu")


def kind_of(path: Path) -> str | None:
    """The kind of the test file at ``path``: the folder of ``tests/`` it lives in, or None outside them."""
    try:
        folder = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return folder if folder in KINDS else None


@functools.cache
def _no_gpu() -> str | None:
    """Why tests that need CUDA cannot run here, or None when they can."""
    try:
        import torch
    except ImportError as error:
        return f"needs CUDA: torch is not importable ({error})"
    return None if torch.cuda.is_available() else "needs CUDA: torch sees no GPU here"


def pytest_report_header(config: pytest.Config) -> str:
    """One header line: whether freed heap memory is poisoned, so that a read of freed memory reads bytes no test
    expects rather than stale ones that happen to be right (issue 34)."""
    value = os.environ.get("MALLOC_PERTURB_", "")  # noqa: TID251 - glibc's, not ours: no Settings field
    if value.strip("0"):
        return f"MALLOC_PERTURB_={value}: freed heap memory is poisoned"
    return "MALLOC_PERTURB_ unset: freed heap memory is not poisoned (scripts/test sets MALLOC_PERTURB_=165)"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its folder's kind; skip ``gpu`` tests without a GPU."""
    strays = sorted({str(item.path) for item in items if kind_of(item.path) is None and _inside(item.path)})
    if strays:
        raise pytest.UsageError(f"tests must live in tests/{{{','.join(KINDS)}}}/, not in: {', '.join(strays)}")
    for item in items:
        kind = kind_of(item.path)
        if kind is not None:
            item.add_marker(kind)
        if item.get_closest_marker("gpu") is not None and (reason := _no_gpu()) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(TESTS)
