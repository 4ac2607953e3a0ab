"""CPU affinity of pd-transfer's own threads.

Engines pin their worker processes to cores (vLLM's CPU worker binds itself and its OpenMP threads to one
core per rank); threads started inside such a worker inherit the pin. Our progress and transfer threads are
light but must run promptly: pinned to the core of a worker that spins between steps, a prefill's progress
thread was measured starved for over 20 s (a READ from a decode on the same core never completed, so its
lease ran out). So each of our threads widens its own affinity when it starts.

``PD_TRANSFER_THREAD_CPUS`` chooses where (``Settings.thread_cpu_set``, passed down to whoever starts threads): unset
or ``all`` (every CPU this machine has; the kernel keeps it within the process's cpuset), ``inherit`` (keep the
engine's pin), or a list such as ``0-3,8``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from functools import partial

logger = logging.getLogger(__name__)

CpuSet = AbstractSet[int] | None  # the CPUs a thread may run on; None: the ones it inherited


def unpin_current_thread(cpus: CpuSet) -> None:
    """Give the calling thread the affinity ``cpus`` (``Settings.thread_cpu_set``; None: keep what it inherited).
    Best effort: logged, never raised."""
    try:
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(threading.get_native_id(), cpus)
    except (OSError, ValueError) as error:
        logger.warning("could not set the CPU affinity of thread %s: %s", threading.current_thread().name, error)


def unpinning(cpus: CpuSet) -> Callable[[], None]:
    """:func:`unpin_current_thread` of ``cpus``, as a thread pool's ``initializer``."""
    return partial(unpin_current_thread, cpus)


@contextmanager
def threads_started_unpinned(cpus: CpuSet) -> Iterator[None]:
    """Native threads a library starts inside this block get the affinity ``cpus`` (a thread inherits
    its creator's when it starts, and ours cannot reach it after): the calling thread's own affinity is widened
    for the block and put back after (best effort, as :func:`unpin_current_thread`)."""
    native_id = threading.get_native_id()
    try:
        saved: set[int] | None = os.sched_getaffinity(native_id)
    except (OSError, AttributeError):
        saved = None
    unpin_current_thread(cpus)
    try:
        yield
    finally:
        if saved is not None:
            try:
                os.sched_setaffinity(native_id, saved)
            except OSError as error:
                logger.warning(
                    "could not restore the CPU affinity of thread %s: %s", threading.current_thread().name, error
                )


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, ascending. CPU ids need not start at 0 or be contiguous in a container's
    cpuset, so "the second core" is not always CPU 1."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def allowed_cpu(index: int) -> str:
    """The ``index``-th of :func:`allowed_cpus` (wrapping around), as a ``VLLM_CPU_OMP_THREADS_BIND`` value."""
    cpus = allowed_cpus()
    return str(cpus[index % len(cpus)])
