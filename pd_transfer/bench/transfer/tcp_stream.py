"""A plain TCP stream between two processes: the raw limit of the path UCX's tcp transport reads over.

The receiver (this process, where the decode reads) listens on ``host``; the sender, a child process started
with an optional command prefix (``ip netns exec NAME`` puts it on the prefill's side of a veth), connects and,
for each repeat, waits for a one-byte go and sends ``nbytes`` from one buffer with ``sendall``. The receiver times
go-to-last-byte with ``recv_into`` into one buffer and checks it got exactly ``nbytes`` each time; both ends count
the CPU time of their side of each transfer (user and system: the kernel's copies included). Kernel socket
buffers are left to autotuning, as iperf3 leaves them. ``iperf3`` (when installed) runs the same direction.

Run as ``python -m pd_transfer.bench.transfer.tcp_stream HOST PORT NBYTES REPEATS``: the sender.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

_TIMEOUT_S = 120.0  # any one connect, go or repeat


def _send(host: str, port: int, nbytes: int, repeats: int) -> None:
    """The sender's side: ``repeats`` times, wait for a go byte and send ``nbytes``; then print the CPU seconds
    the sends took (this process, user and system) as JSON."""
    payload = memoryview(bytearray(b"\xa5" * nbytes))
    cpu_seconds = 0.0
    with socket.create_connection((host, port), timeout=_TIMEOUT_S) as sock:
        for _ in range(repeats):
            if sock.recv(1) != b"g":
                return
            started = time.process_time()
            sock.sendall(payload)
            cpu_seconds += time.process_time() - started
        sock.recv(1)  # the receiver's close
    print(json.dumps({"cpu_seconds": cpu_seconds}), flush=True)


def stream_gbps(nbytes: int, repeats: int, *, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> dict:
    """Median GiB/s of ``repeats`` transfers of ``nbytes`` from a child process (started under ``prefix``) to
    this one over TCP to ``host``; ``bytes_ok`` is True when every repeat received exactly ``nbytes``."""
    buffer = memoryview(bytearray(nbytes))
    seconds: list[float] = []
    received: list[int] = []
    receiver_cpu = 0.0
    with socket.create_server((host, 0)) as listener:
        listener.settimeout(_TIMEOUT_S)
        port = listener.getsockname()[1]
        command = [*prefix, sys.executable, "-m", "pd_transfer.bench.transfer.tcp_stream", host, str(port), str(nbytes)]
        sender = subprocess.Popen([*command, str(repeats)], stdout=subprocess.PIPE, text=True)
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(_TIMEOUT_S)
                for _ in range(repeats):
                    got = 0
                    conn.sendall(b"g")
                    started, cpu_started = time.perf_counter(), time.process_time()
                    while got < nbytes:
                        count = conn.recv_into(buffer[got:])
                        if count == 0:
                            break
                        got += count
                    seconds.append(time.perf_counter() - started)
                    receiver_cpu += time.process_time() - cpu_started
                    received.append(got)
            said, _ = sender.communicate(timeout=_TIMEOUT_S)
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait(_TIMEOUT_S)
    median = statistics.median(seconds)
    sender_cpu = _cpu_said(said)
    gib_moved = sum(received) / 2**30
    return {
        "bytes": nbytes,
        "seconds": round(median, 6),
        "gbps": round(nbytes / median / 2**30, 3),
        "bytes_ok": all(got == nbytes for got in received),
        "repeats": repeats,
        # both ends' CPU (user and system) per GiB received; None when the sender did not say its share
        "cpu_seconds_per_gib": None if sender_cpu is None else round((receiver_cpu + sender_cpu) / gib_moved, 4),
    }


def _cpu_said(said: str) -> float | None:
    """The sender's CPU seconds from its last line of output, None when it printed none."""
    try:
        return float(json.loads(said.strip().splitlines()[-1])["cpu_seconds"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


def iperf3_gbps(nbytes: int, *, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> float | None:
    """GiB/s that ``iperf3`` receives here from a client under ``prefix`` sending ``nbytes``; None when iperf3 is
    not installed or fails."""
    binary = shutil.which("iperf3")
    if binary is None:
        return None
    with socket.socket() as probe:  # a free port for the one-off server
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [binary, "-s", "-1", "--forceflush", "-B", host, "-p", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        deadline = time.monotonic() + _TIMEOUT_S
        said = b""
        while b"listening" not in said.lower():  # until the server says it listens (--forceflush), bounded
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([server.stdout], [], [], remaining)[0]:
                return None
            chunk = os.read(server.stdout.fileno(), 4096)
            if not chunk:
                return None
            said += chunk
        client = subprocess.run(
            [*prefix, binary, "-c", host, "-p", str(port), "-n", str(nbytes), "-J"],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
        if client.returncode != 0:
            return None
        bits = json.loads(client.stdout)["end"]["sum_received"]["bits_per_second"]
        return round(float(bits) / 8 / 2**30, 3)
    except (subprocess.TimeoutExpired, ValueError, KeyError):
        return None
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(_TIMEOUT_S)


if __name__ == "__main__":
    _send(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
