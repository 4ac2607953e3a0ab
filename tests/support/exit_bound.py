"""A pytest plugin (loaded by conftest.py) that bounds the test process's exit. Once the session's summary is printed,
the process has ``PD_TRANSFER_TEST_EXIT_BOUND_S`` seconds (default 120) to end; if it has not, faulthandler prints
every thread's stack to stderr and ends it with exit code 1.

Why: a hang after the last test (a ZMQ context ended at exit while one of its sockets still held an unsent message)
kept CI waiting until its 90 minutes ran out, with the summary's last lines still in the stdout buffer. With this
bound the run fails within minutes, and says where it hung."""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

DEFAULT_EXIT_BOUND_S = 120.0
_ENV = "PD_TRANSFER_TEST_EXIT_BOUND_S"  # the test suite's own setting, not the package's


def exit_bound_s() -> float:
    """``PD_TRANSFER_TEST_EXIT_BOUND_S`` in seconds (a positive number; blank or unset: ``DEFAULT_EXIT_BOUND_S``).
    Raises ``ValueError`` naming the variable for anything else."""
    text = os.environ.get(_ENV, "").strip()
    try:
        seconds = float(text) if text else DEFAULT_EXIT_BOUND_S
    except ValueError:
        raise ValueError(f"{_ENV} must be a number, not {text[:40]!r}") from None
    if not seconds > 0:  # NaN too
        raise ValueError(f"PD_TRANSFER_TEST_EXIT_BOUND_S must be a positive number of seconds, got {seconds}")
    return seconds


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Flush what the session printed, then arm the exit bound."""
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback_later(exit_bound_s(), exit=True)
