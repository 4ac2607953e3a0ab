"""``pd-transfer bench vllm --scale``'s CPU placement on a real process: bound to one CPU from its start, its
stray threads put back (the rest of ``bench vllm`` without servers: tests/unit/test_bench_vllm.py)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from pd_transfer.bench.vllm.scale_affinity import affinity_census, pinned_command, restore_strays, thread_affinities

#: a child that reports its process's CPUs, starts one thread that moves itself to CPU argv[1] only and one that
#: widens itself to argv[1] and argv[2], says where both are, then waits for its stdin to close
_STRAY_CHILD = """
import os, sys, threading
first, second = int(sys.argv[2]), int(sys.argv[1])
ready = threading.Barrier(3)
def run(cpus):
    os.sched_setaffinity(0, cpus)
    ready.wait()
    sys.stdin.read()
threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in ({second}, {first, second})]
for t in threads:
    t.start()
ready.wait()
print(sorted(os.sched_getaffinity(0)), threads[0].native_id, threads[1].native_id, flush=True)
sys.stdin.read()
"""


def test_pinned_server_and_its_stray_threads_put_back() -> None:
    """``bench vllm --scale``'s placement on a real process: bound to one CPU from its start (every thread
    inherits it); a thread that moved itself to another CPU only is put back, one that widened to more CPUs
    including its own keeps that."""
    if not hasattr(os, "sched_setaffinity") or len(cpus := sorted(os.sched_getaffinity(0))) < 2:
        pytest.skip("needs Linux sched_setaffinity and two allowed CPUs")
    first, second = cpus[0], cpus[1]
    command = pinned_command({first}, [sys.executable, "-c", _STRAY_CHILD, str(second), str(first)])
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        readable, _, _ = select.select([child.stdout], [], [], 30.0)
        assert readable, "the child did not report within 30 s"
        own, stray, widened = child.stdout.readline().decode().strip().rsplit(" ", 2)
        assert own == f"[{first}]"  # the process was bound before its program ran
        before = thread_affinities(child.pid)
        assert before[int(stray)][1] == {second} and before[int(widened)][1] == {first, second}
        assert len(restore_strays(child.pid, {first})) == 1
        after = thread_affinities(child.pid)
        assert after[int(stray)][1] == {first} and after[int(widened)][1] == {first, second}
        census = affinity_census(child.pid)
        assert census == {str(first): len(after) - 1, f"{first},{second}": 1}, census
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
