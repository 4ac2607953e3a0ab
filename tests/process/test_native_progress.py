"""An agent that serves reads (a prefill rank's) runs NIXL's progress thread woken by UCX's events
(:mod:`pd_transfer.transfer.progress`, :func:`pd_transfer.transfer.native.make_nixl_agent`): over TCP, where the
target's progress is what answers a READ, that thread alone serves it. The target is a child process whose
Python poller is stopped; this process reads from it over UCX's tcp transport."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import torch
from agent_peer import NUM_REGIONS, pattern, read_whole_regions, served_peer

from pd_transfer.bench.transfer.ucx_transports import ucx_transports
from pd_transfer.settings import DEFAULTS, SettingError, Settings
from pd_transfer.transfer import TransferAgent, TransferTimeout

pytestmark = pytest.mark.timeout(180)

_ENV = "PD_TRANSFER_NATIVE_PROGRESS_MS"


def test_the_wait_setting() -> None:
    assert Settings.from_environ({}).native_progress_ms == 20
    for value, expected in (("0", 0), ("2.5", 3), (" 100 ", 100), ("", 20)):
        assert Settings.from_environ({_ENV: value}).native_progress_ms == expected, value
    for bad in ("-1", "soon", "nan", "1e12"):
        with pytest.raises(SettingError, match=_ENV):
            Settings.from_environ({_ENV: bad})


def test_only_agents_that_serve_reads_run_the_thread() -> None:
    seven = Settings(native_progress_ms=7)
    with (
        TransferAgent("test-native-reader", settings=seven) as reader,
        TransferAgent("test-native-target", serves_reads=True, settings=seven) as target,
    ):
        assert (reader.native_progress_ms, target.native_progress_ms) == (0, 7)
    with TransferAgent("test-native-off", serves_reads=True, settings=Settings(native_progress_ms=0)) as target:
        assert target.native_progress_ms == 0


def _read_everything_from_unpolled_target(monkeypatch: pytest.MonkeyPatch, wait_ms: str, timeout_s: float) -> None:
    """Start a target (``PD_TRANSFER_NATIVE_PROGRESS_MS=wait_ms``) whose poller is stopped, read all its regions
    over TCP with ``timeout_s`` and check every word."""
    if "tcp" not in ucx_transports({"UCX_TLS": "tcp,self"}):
        pytest.skip("UCX has no tcp transport here")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    env = {"UCX_TLS": "tcp,self", _ENV: wait_ms}
    with (
        served_peer(env, serves_reads=True, python_progress=False) as (_, metadata, bases),
        TransferAgent("test-native-reader-tcp", settings=replace(DEFAULTS, drain_s=1.0)) as agent,  # a short drain
    ):
        order = list(range(NUM_REGIONS))
        tensors = read_whole_regions(agent, metadata, bases, order, timeout_s=timeout_s)
        for region, tensor in enumerate(tensors):
            assert torch.equal(tensor, pattern(region)), region


def test_an_unpolled_target_serves_tcp_reads_on_its_native_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 MiB in four descriptors over TCP: many messages the target's progress must answer
    _read_everything_from_unpolled_target(monkeypatch, "20", timeout_s=60.0)


def test_without_the_native_thread_an_unpolled_target_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # the control: the same target with the thread off and its poller stopped leaves the read waiting
    with pytest.raises(TransferTimeout):
        _read_everything_from_unpolled_target(monkeypatch, "0", timeout_s=3.0)


def test_the_native_thread_is_not_pinned_where_its_creator_was() -> None:
    # an engine's worker is pinned to one core; the threads NIXL starts for a serving agent made there must not be
    # (pinned beside a spinning engine a progress thread starved for tens of seconds), and the creator keeps its pin
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("one CPU here: no pin to escape")
    me = threading.get_native_id()
    pinned = {min(cpus)}
    existing = set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(me, pinned)
    try:
        # the default settings: a native thread waking every 20 ms, our threads on every CPU
        with TransferAgent("test-native-pinned", serves_reads=True, settings=Settings()) as agent:
            deadline = time.monotonic() + 10.0  # the poller unpins itself before its first poll
            while agent.poll_count == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            started = set(os.listdir("/proc/self/task")) - existing
            assert started, "the agent started no thread"
            assert {tid: os.sched_getaffinity(int(tid)) for tid in started} == {tid: cpus for tid in started}
            assert os.sched_getaffinity(me) == pinned
    finally:
        os.sched_setaffinity(me, cpus)
