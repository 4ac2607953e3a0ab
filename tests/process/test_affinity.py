"""Our threads escape the engine's CPU pin (see pd_transfer.affinity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, threading
os.sched_setaffinity(0, {0})  # as an engine pins its worker
from pd_transfer.settings import read_settings
from pd_transfer.transfer.progress import AdaptivePoller
cpus = read_settings().thread_cpu_set  # this child's edge: PD_TRANSFER_THREAD_CPUS from its environment
seen = []
event = threading.Event()
def poll():
    if not seen:
        seen.append(sorted(os.sched_getaffinity(threading.get_native_id())))
        event.set()
    return False
poller = AdaptivePoller("test", poll, thread_cpus=cpus)
poller.start()
assert event.wait(10), "the poller never polled"
poller.stop()
print(json.dumps([seen[0], sorted(os.sched_getaffinity(0))]))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to tell pinned from unpinned")
@pytest.mark.parametrize(("setting", "expected"), [("all", "every"), ("inherit", "pinned")])
def test_progress_thread_leaves_the_pinned_core(setting: str, expected: str) -> None:
    env = {**os.environ, "PD_TRANSFER_THREAD_CPUS": setting}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    poller_cpus, main_cpus = json.loads(out.stdout)
    assert main_cpus == [0]
    assert poller_cpus == ([0] if expected == "pinned" else sorted(os.sched_getaffinity(0)))
