"""Which UCX transports a read between two agents uses under the current environment.

UCX logs, at ``UCX_LOG_LEVEL=info``, one line per endpoint configuration a worker builds, naming the transport and
device of each lane, e.g. ``a intra-node cfg#1 rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo)  ka(tcp/lo)``
(``rma_am``: reads emulated with active messages, served by the target's progress; ``rma``: a one-sided
transport such as ``cma``). :func:`ucx_transports` runs two agents in a child process with this process's
environment, reads once from one to the other, and returns what the reader's peer configuration named.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping

from pd_transfer.settings import apply_process_defaults, child_environment, read_settings

_TIMEOUT_S = 120.0
_CONFIG_LINE = re.compile(r"\breader (?:intra|inter)-node cfg#\d+ (.*)$")


def ucx_transports(env: Mapping[str, str] | None = None) -> str:
    """The lanes of the reader's endpoint to a peer (e.g. ``"rma_am(tcp/lo) amo_am(tcp/lo) am(tcp/lo)
    ka(tcp/lo)"``), or ``"unknown"`` when UCX logged none; ``env`` overrides this process's environment."""
    child_env = child_environment({**(env or {}), "UCX_LOG_LEVEL": "info"})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pd_transfer.bench.transfer.ucx_transports"],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "unknown"
    for line in (done.stdout + done.stderr).splitlines():
        match = _CONFIG_LINE.search(line)
        if match:
            return " ".join(match.group(1).split())
    return "unknown"


def _read_once() -> None:
    """Two agents in this process, with this process's settings (its edge); "reader" reads 64 KiB from "target"
    (the target polling fast meanwhile)."""
    import numpy as np

    from pd_transfer.transfer import TransferAgent

    settings = apply_process_defaults(read_settings())
    nbytes = 1 << 16
    source, target_buffer = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    with (
        TransferAgent("reader", settings=settings) as reader,
        TransferAgent("target", serves_reads=True, settings=settings) as target,
    ):
        target.register_spans([(source.ctypes.data, source.ctypes.data + nbytes)])
        reader.register_spans([(target_buffer.ctypes.data, target_buffer.ctypes.data + nbytes)])
        peer = reader.add_peer(target.metadata)
        target.set_expecting_reads(True)
        local = reader.prepare_local(np.array([[target_buffer.ctypes.data, nbytes, 0]], dtype=np.uint64))
        remote = reader.prepare_remote(peer, np.array([[source.ctypes.data, nbytes, 0]], dtype=np.uint64))
        zero = np.zeros(1, dtype=np.int32)
        reader.read(local, zero, remote, zero, timeout_s=_TIMEOUT_S)


if __name__ == "__main__":
    _read_once()
