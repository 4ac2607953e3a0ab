"""CPU affinity of pd-transfer's own threads.

Engines pin their worker processes to cores (vLLM's CPU worker binds itself and its OpenMP threads to one
core per rank); threads started inside such a worker inherit the pin. Our progress and transfer threads are
light but must run promptly: pinned to the core of a worker that spins between steps, a prefill's progress
thread was measured starved for over 20 s (a READ from a decode on the same core never completed, so its
lease ran out). So each of our threads widens its own affinity when it starts.

``PD_TRANSFER_THREAD_CPUS`` chooses where: unset or ``all`` (every CPU this machine has; the kernel keeps it
within the process's cpuset), ``inherit`` (keep the engine's pin), or a list such as ``0-3,8``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

ENV = "PD_TRANSFER_THREAD_CPUS"


def thread_cpus(setting: str | None = None) -> set[int] | None:
    """The CPUs our threads should run on, from ``setting`` (default: the environment); None: inherit."""
    value = (os.environ.get(ENV, "all") if setting is None else setting).strip().lower()
    if value == "inherit":
        return None
    if value in ("", "all"):
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: expected 'all', 'inherit' or a CPU list like '0-3,8'") from None
    return cpus


def unpin_current_thread() -> None:
    """Give the calling thread the affinity of :func:`thread_cpus` (best effort: logged, never raised)."""
    try:
        cpus = thread_cpus()
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(threading.get_native_id(), cpus)
    except (OSError, ValueError) as error:
        logger.warning("could not set the CPU affinity of thread %s: %s", threading.current_thread().name, error)


@contextmanager
def threads_started_unpinned() -> Iterator[None]:
    """Native threads a library starts inside this block get the affinity of :func:`thread_cpus` (a thread inherits
    its creator's when it starts, and ours cannot reach it after): the calling thread's own affinity is widened
    for the block and put back after (best effort, as :func:`unpin_current_thread`)."""
    native_id = threading.get_native_id()
    try:
        saved: set[int] | None = os.sched_getaffinity(native_id)
    except (OSError, AttributeError):
        saved = None
    unpin_current_thread()
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
