"""Registered memory in huge pages: registration collapses in the background, reads from another process stay exact
while the collapse runs, and an engine's memory is left alone by default (real NIXL, real kernel). The advice on
memory alone: tests/unit/test_huge_page_advice.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import agent_peer
import numpy as np
import pytest
import torch
from agent_peer import large_pattern, serve_large
from test_huge_page_advice import MIB, needs_thp, span_of

from pd_transfer.connector.cache import zeroed_host_tensor
from pd_transfer.settings import DEFAULTS, Settings
from pd_transfer.transfer import TransferAgent
from pd_transfer.transfer.huge_pages import (
    resident_huge_page_bytes,
    thp_mode,
)

_COLLAPSE_IN_A_FRESH_PROCESS = """
import json, sys, torch
from agent_peer import large_pattern
from pd_transfer.transfer.huge_pages import advise_huge_pages, collapse_huge_pages, resident_huge_page_bytes
words = 64 * 2**20 // 4
memory = large_pattern(words)  # written on the allocator's small pages
span = (memory.data_ptr(), memory.data_ptr() + memory.numel() * memory.element_size())
advised = advise_huge_pages([span])
result = collapse_huge_pages([span])
print(json.dumps({"advised": advised, "eligible": result.eligible_bytes, "collapsed": result.collapsed_bytes,
                  "reason": result.reason, "resident": resident_huge_page_bytes([span]),
                  "same": bool(torch.equal(memory, large_pattern(words)))}))
"""


#: What a collapse's reason names when the machine, not the code, stopped it (ENOMEM: a partial collapse too).
_MACHINE_LACKS = {"EINVAL": "this kernel has no MADV_COLLAPSE", "ENOMEM": "the kernel ran out of free huge pages"}


def skip_where_the_machine_lacks(reasons: list[str], errnos: tuple[str, ...] = ("EINVAL", "ENOMEM")) -> None:
    """Skip, naming the kernel's answer, where one of a collapse's ``reasons`` names one of ``errnos``
    (:data:`_MACHINE_LACKS`). Called after every byte was checked."""
    for errno_name in errnos:
        named = [reason for reason in reasons if errno_name in reason]
        if named:
            pytest.skip(f"{_MACHINE_LACKS[errno_name]} ({named[0]})")


@needs_thp
def test_collapse_keeps_every_byte_and_leaves_the_memory_in_huge_pages() -> None:
    """``MADV_COLLAPSE`` of 64 MiB written on small pages, in a process of its own: what a long-lived test process
    has mapped before beside it can leave the smaps accounting of huge pages elsewhere (it read 0 collapsed after a
    full suite, passing alone), which says nothing of the collapse."""
    here = str(Path(agent_peer.__file__).parent)  # where the child imports agent_peer from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-c", _COLLAPSE_IN_A_FRESH_PROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    skip_where_the_machine_lacks([result["reason"]], ("EINVAL",))
    assert result["advised"] > 0 and result["same"] is True
    assert result["eligible"] >= 60 * MIB
    skip_where_the_machine_lacks([result["reason"]], ("ENOMEM",))
    assert result["collapsed"] == result["eligible"], result["reason"]
    assert result["resident"] >= result["eligible"]


@needs_thp
def test_reads_stay_exact_while_the_owner_collapses_its_registered_memory() -> None:
    """The peer registers 256 MiB written on small pages; its agent collapses them in the background while this
    process reads all of it again and again; every read is checked word for word, then the peer's memory and
    ours are in huge pages."""
    words = 256 * MIB // 4
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=serve_large, args=(child, words), daemon=True)
    process.start()
    agent = TransferAgent("huge-pages-reader", settings=DEFAULTS)
    try:
        assert conn.poll(60), "the peer did not start in 60 s"
        metadata, remote_base = conn.recv()
        target = torch.zeros(words, dtype=torch.int32)
        agent.register_spans([span_of(target)], huge_pages=True)
        peer = agent.add_peer(metadata)
        chunk = 4 * MIB
        count = words * 4 // chunk
        offsets = np.arange(count, dtype=np.uint64) * chunk
        local = agent.prepare_local(np.stack([target.data_ptr() + offsets, np.full(count, chunk), 0 * offsets], 1))
        remote = agent.prepare_remote(peer, np.stack([remote_base + offsets, np.full(count, chunk), 0 * offsets], 1))
        rows = np.arange(count, dtype=np.int32)
        expected = large_pattern(words)
        conn.send("collapse")  # answered once the peer's collapse ended
        reads = 0
        while not conn.poll(0) or reads < 3:
            target.zero_()
            agent.read(local, rows, remote, rows, timeout_s=30.0)
            assert torch.equal(target, expected), f"read {reads} differs"
            reads += 1
            assert reads < 2000, "the peer's collapse did not end"
        ended, results, peer_huge = conn.recv()
        assert ended
        assert agent.huge_pages.wait(60.0)
        local.release()
        remote.release()
        skip_where_the_machine_lacks([result.reason for result in [*results, *agent.huge_pages.results]])
        assert peer_huge >= 240 * MIB, (results, peer_huge)
        assert resident_huge_page_bytes([span_of(target)]) >= 240 * MIB
    finally:
        conn.send("stop")
        process.join(30)
        agent.close()


def test_an_agent_with_the_switch_off_advises_and_collapses_nothing() -> None:
    off = Settings.from_environ({"PD_TRANSFER_HUGE_PAGES": "0"})
    tensor = zeroed_host_tensor((32 * MIB,), torch.uint8, huge_pages=off.own_huge_pages)
    agent = TransferAgent("huge-pages-off", settings=off)
    try:
        agent.register_spans([span_of(tensor)])  # nothing advised, nothing collapsed
        assert agent.huge_pages.wait(10.0) and agent.huge_pages.results == []
    finally:
        agent.close()


@needs_thp
def test_engine_memory_is_left_alone_by_default() -> None:
    """Memory pd-transfer did not allocate (an engine's) is registered as it is unless the mode is "all"."""
    memory = large_pattern(32 * MIB // 4)
    agent = TransferAgent("huge-pages-default", settings=DEFAULTS)
    try:
        agent.register_spans([span_of(memory)])
        assert agent.huge_pages.wait(10.0) and agent.huge_pages.results == []
        assert resident_huge_page_bytes([span_of(memory)]) == 0 or thp_mode() == "always"
    finally:
        agent.close()
