"""A pytest plugin (loaded by conftest.py) that bounds the test process's exit. Once the session's summary is printed,
the process has ``PD_TRANSFER_TEST_EXIT_BOUND_S`` seconds (default 120) to end; if it has not, faulthandler prints
every thread's stack to stderr and ends it with exit code 1.

Why: a hang after the last test (a ZMQ context ended at exit while one of its sockets still held an unsent message)
kept CI waiting until its 90 minutes ran out, with the summary's last lines still in the stdout buffer. With this
bound the run fails within minutes, and says where it hung."""

from __future__ import annotations

import faulthandler
import sys

import pytest

from pd_transfer.transfer.progress import env_number

DEFAULT_EXIT_BOUND_S = 120.0


def exit_bound_s() -> float:
    """``PD_TRANSFER_TEST_EXIT_BOUND_S`` in seconds (a positive number), else ``DEFAULT_EXIT_BOUND_S``."""
    seconds = env_number("PD_TRANSFER_TEST_EXIT_BOUND_S", DEFAULT_EXIT_BOUND_S)  # ValueError naming it if no number
    if not seconds > 0:  # NaN too
        raise ValueError(f"PD_TRANSFER_TEST_EXIT_BOUND_S must be a positive number of seconds, got {seconds}")
    return seconds


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Flush what the session printed, then arm the exit bound."""
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback_later(exit_bound_s(), exit=True)
