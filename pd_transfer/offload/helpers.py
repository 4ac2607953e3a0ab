"""The offload package's helper threads: one per job kind and process, started on first use, idle on its queue.

A disk store hands file checksums to the ``checksum`` helper (:mod:`.hash_ahead`), a disk load half of its files to
the ``read`` helper (:mod:`.two_readers`). Each is a one-thread executor, so a process never runs more than one
helper of a kind however many tiers or jobs it has; a forked child starts its own (the parent's threads do not exist
there). Helpers only pay where the process may run on more than one CPU (:func:`helper_useful`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from pd_transfer.affinity import allowed_cpus

_lock = threading.Lock()
_helpers: dict[str, ThreadPoolExecutor] = {}


def _forget_helpers() -> None:
    """In a forked child: the parent's helper threads do not exist there, and the lock may have been held."""
    global _lock, _helpers
    _lock, _helpers = threading.Lock(), {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def helper_useful() -> bool:
    """Whether this process may run on more than one CPU (else a helper thread only adds hand-offs)."""
    return len(allowed_cpus()) > 1


def helper(kind: str) -> ThreadPoolExecutor:
    """The process's helper thread for ``kind`` (``pd-offload-<kind>``), started on first use."""
    with _lock:
        pool = _helpers.get(kind)
        if pool is None:
            pool = _helpers[kind] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pd-offload-{kind}")
        return pool
