"""A spawned child process driven over a pipe: the shared plumbing of the prefill stand-ins that the
benchmarks, the demo and the tests run in their own OS processes; and the two ends of a stand-in run as a command
(:func:`die_with_parent` before its exec, :func:`stop_process` after)."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

#: Seconds between checks that a child that has not answered yet is still running.
_ALIVE_CHECK_S = 0.5


def commands(conn: multiprocessing.connection.Connection, poll_s: float = 1.0) -> Iterator[tuple[Any, ...]]:
    """In the child: the parent's commands, until it sends ``("stop", ...)`` or dies (an orphaned child
    never outlives its parent)."""
    parent = os.getppid()
    while True:
        if not conn.poll(poll_s):
            if os.getppid() != parent:
                return
            continue
        command = conn.recv()
        if command[0] == "stop":
            return
        yield command


class ChildProcess:
    """Starts ``target(conn, payload)`` in a spawned process and waits for its first message (its "ready"
    reply, kept in ``ready``). Every wait is bounded; ``close`` asks the child to stop, then kills it."""

    stop_command: tuple[object, ...] = ("stop",)

    def __init__(
        self,
        target: Callable[[multiprocessing.connection.Connection, bytes], None],
        payload: bytes,
        *,
        what: str,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.what = what
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=target, args=(child_conn, payload), daemon=True)
        self._process.start()
        self.ready: Any = self.receive(ready_timeout_s)

    @property
    def pid(self) -> int:
        return self._process.pid or -1

    def send(self, *command: object) -> None:
        self._conn.send(command)

    def receive(self, timeout_s: float) -> Any:
        """The child's next message, within ``timeout_s``; ``ChildProcessError`` at once if the child exited first
        (its traceback is on its stderr), ``TimeoutError`` if it is still silent then."""
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(max(0.0, min(_ALIVE_CHECK_S, deadline - time.monotonic()))):
            if not self._process.is_alive():
                code = self._process.exitcode
                raise ChildProcessError(f"{self.what} (pid {self.pid}) exited with {code} before it answered")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.what} (pid {self.pid}) did not answer within {timeout_s:.0f} s")
        return self._conn.recv()

    def kill(self) -> None:
        self._process.kill()
        self._process.join(10)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(self.stop_command)
            except OSError:
                pass
            self._process.join(15)
        if self._process.is_alive():
            self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def die_with_parent() -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: the child gets SIGKILL when its parent dies (kept across exec, also
    through ``ip netns exec``)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; closes its stdout pipe."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)
    if process.stdout is not None:
        process.stdout.close()
