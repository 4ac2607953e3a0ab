"""The setting of the exit bound of tests/support/exit_bound.py (``PD_TRANSFER_TEST_EXIT_BOUND_S``): its default, a
value, and bad values refused naming it. The bound at work: tests/process/test_exit_bound.py."""

from __future__ import annotations

import pytest
from exit_bound import exit_bound_s


def test_the_bound_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_TRANSFER_TEST_EXIT_BOUND_S", raising=False)
    assert exit_bound_s() == 120.0
    monkeypatch.setenv("PD_TRANSFER_TEST_EXIT_BOUND_S", "30")
    assert exit_bound_s() == 30.0
    for bad in ("0", "-1", "nan", "soon"):
        monkeypatch.setenv("PD_TRANSFER_TEST_EXIT_BOUND_S", bad)
        with pytest.raises(ValueError, match="PD_TRANSFER_TEST_EXIT_BOUND_S"):
            exit_bound_s()
