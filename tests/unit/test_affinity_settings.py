"""The CPU settings of our threads (see pd_transfer.affinity): ``PD_TRANSFER_THREAD_CPUS`` parsed, and the CPUs
this process may use counted. Our threads escaping an engine's pin: tests/process/test_affinity.py."""

from __future__ import annotations

import os

import pytest

from pd_transfer.affinity import allowed_cpu
from pd_transfer.settings import SettingError, Settings


def test_cpu_settings_parse() -> None:
    def cpus(text: str) -> frozenset[int] | None:
        return Settings.from_environ({"PD_TRANSFER_THREAD_CPUS": text}).thread_cpu_set

    assert cpus("inherit") is None
    assert cpus("all") == cpus("") == set(range(os.cpu_count() or 1))
    assert cpus("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(SettingError, match="PD_TRANSFER_THREAD_CPUS"):
        cpus("most")


def test_allowed_cpu_counts_only_cpus_this_process_may_use() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert [allowed_cpu(i) for i in range(len(allowed) + 1)] == [*map(str, allowed), str(allowed[0])]
