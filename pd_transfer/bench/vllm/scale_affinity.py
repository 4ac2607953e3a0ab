"""Where the threads of ``bench vllm --scale``'s servers run: each server's whole process on its own core, as if
each server had a one-core machine to itself, for the plain server and both connectors alike.

Why (measured here, 8B KV geometry, ``--enforce-eager``): vLLM's CPU worker with NixlConnector moves its model
thread to the last core of each NUMA node (``NixlConnectorWorker.__init__``, "reserve different cores for
start_load_kv() from model_forward()": ``os.sched_setaffinity(0, ...)`` on the worker's main thread, the one that
runs the forward pass). It picks that core from the machine's topology in ``/sys``, not from the cores the server was
given. With the prefill on core 0 and the decode on core 1 of a 2-core host, the prefill's compute lands on core 1,
where the decode's NIXL progress thread polls at about 100 % of a core: a 256-token prefill took 43.8 s (its model
thread got 2.0 s of CPU in that time, the decode's progress thread 40.1 s), against 0.55-0.78 s with no decode
running, and 2.8-3.1 s once the model thread was put back on core 0 (all at load 12-25).

So the bench, for every server of a scale run:

- starts its process bound to its core (``pinned_command``: ``sched_setaffinity`` then ``exec``, so the API server,
  the engine core, the worker and every thread they start inherit that core);
- once the servers are healthy, puts back on the server's core every thread whose affinity no longer includes it
  (``restore_strays``; here only NixlConnector's prefill model thread). Threads that widened their affinity to more
  cores *including* their server's keep it: ours do so on purpose (``pd_transfer.affinity``, as in production).

Linux only (``sched_setaffinity``, ``/proc``); elsewhere the command is left as it is and nothing is moved.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from pd_transfer.cluster.processes import group_members

__all__ = ["affinity_census", "cpu_list", "pinned_command", "restore_strays", "thread_affinities"]

#: run as ``python -c PIN CPUS COMMAND...``: bind this process to CPUS (``0`` or ``0,2``), then become COMMAND
PIN = (
    "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 3}`` as ``"0,1,3"`` (ascending)."""
    return ",".join(str(cpu) for cpu in sorted(cpus))


def pinned_command(cpus: Iterable[int], command: Sequence[str], python: str = sys.executable) -> list[str]:
    """``command`` run with its whole process bound to ``cpus`` from the start (every thread and child inherits
    it), through ``python -c``; ``command`` unchanged where there is no ``sched_setaffinity``. A bare
    ``command[0]`` is looked up on ``PATH`` first (``execv`` does not search it)."""
    if not hasattr(os, "sched_setaffinity"):
        return list(command)
    program = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
    return [python, "-c", PIN, cpu_list(cpus), program, *command[1:]]


def thread_affinities(pgid: int) -> dict[int, tuple[str, frozenset[int]]]:
    """Every live thread of the processes of group ``pgid``: thread id -> (its name, the CPUs it may run on).
    Threads that end while being read are left out."""
    threads: dict[int, tuple[str, frozenset[int]]] = {}
    for pid in group_members(pgid):
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                threads[tid] = (name, frozenset(os.sched_getaffinity(tid)))
            except OSError:  # ended meanwhile
                continue
    return threads


def affinity_census(pgid: int) -> dict[str, int]:
    """How many threads of group ``pgid`` may run on which CPUs, e.g. ``{"0": 80, "0,1": 31}``."""
    census: dict[str, int] = {}
    for _, cpus in thread_affinities(pgid).values():
        census[cpu_list(cpus)] = census.get(cpu_list(cpus), 0) + 1
    return dict(sorted(census.items()))


def restore_strays(pgid: int, cpus: Iterable[int]) -> list[str]:
    """Bind to ``cpus`` every thread of group ``pgid`` whose affinity shares no CPU with ``cpus`` (moved away by the
    server's own code); threads allowed on any of ``cpus`` are left as they are. Returns "name (was CPUS)" of
    each thread moved back; a thread that ended meanwhile is skipped."""
    wanted = frozenset(cpus)
    moved = []
    for tid, (name, allowed) in thread_affinities(pgid).items():
        if allowed & wanted:
            continue
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:  # ended meanwhile
            continue
        moved.append(f"{name} (was {cpu_list(allowed)})")
    return moved
