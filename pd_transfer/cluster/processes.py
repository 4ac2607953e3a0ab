"""Server processes (vLLM, the proxy) of ``pd-transfer up``, ``pd-transfer bench vllm`` and the tests: each in its
own process group (session), output to a log file, ready when its ``/health`` answers (waited for within a bound),
stopped by signalling the whole group so that vLLM's engine and worker processes go with its API server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pd_transfer.cluster.http_client import is_healthy

__all__ = [
    "ManagedProcess",
    "StartupFailed",
    "group_members",
    "log_excerpt",
    "proc_stat_fields",
    "stop_all",
    "wait_ready",
]

POLL_S = 1.0  # between two rounds of health checks while servers start (each check is bounded by 2 s)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_FIRST_ERROR = re.compile(r"Traceback \(most recent call last\)|\bERROR\b")


def log_excerpt(log_path: Path, tail_lines: int = 40, error_lines: int = 40) -> str:
    """The part of a server's log that explains a failure: the first error block (``error_lines`` lines from the
    first ``ERROR`` or traceback, where vLLM's engine core reports a root cause that the API server's own
    traceback at the end only points to) and the last ``tail_lines`` lines, without terminal escapes."""
    try:
        text = [_ANSI.sub("", line) for line in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    tail_start = max(0, len(text) - tail_lines)
    first = next((i for i, line in enumerate(text[:tail_start]) if _FIRST_ERROR.search(line)), None)
    if first is None:
        return "\n".join(text[tail_start:])
    error_end = min(first + error_lines, tail_start)
    gap = tail_start - error_end
    middle = [f"[... {gap} lines ...]"] if gap else []
    return "\n".join([*text[first:error_end], *middle, *text[tail_start:]])


def proc_stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: ``[state, ppid, pgrp, ...]`` (field 3 of proc(5)
    onward; utime and stime, in clock ticks, are at 11 and 12). Empty when the process is gone or there is no
    procfs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ")"
    return stat[stat.rfind(")") + 2 :].split()


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose process group is ``pgid``."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel whether the group has any member
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    for entry in entries:
        fields = proc_stat_fields(entry) if entry.isdigit() else []
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@dataclass
class ManagedProcess:
    """A command run in its own session, its output in ``log_path``: an HTTP server at ``url`` (``http://host:port``),
    healthy when ``url/health`` answers 200. ``info`` is free-form (e.g. what ``cluster.json`` records)."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    info: dict[str, object] = field(default_factory=dict)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return -1 if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        """The leader's exit code, or None while it runs (or was never started)."""
        return None if self.process is None else self.process.poll()

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s`` seconds."""
        return is_healthy(self.health_url, timeout_s)

    def check_ready(self) -> bool:
        """True once healthy (remembering when it became so)."""
        if self.ready_after_s is None and self.exit_code() is None and self.healthy():
            self.ready_after_s = time.monotonic() - self.started_at
        return self.ready_after_s is not None

    def last_line(self, limit: int = 160) -> str:
        """The last non-empty line of the log, without terminal escapes, cut to ``limit`` characters."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 8192))
                chunk = log.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [_ANSI.sub("", line).strip() for line in chunk.replace("\r", "\n").splitlines()]
        lines = [line for line in lines if line]
        text = lines[-1] if lines else ""
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def log_tail(self, lines: int = 40) -> str:
        """The first error block and the last ``lines`` lines of its log (:func:`log_excerpt`)."""
        return log_excerpt(self.log_path, tail_lines=lines)

    def members(self) -> list[int]:
        """Live processes of its group (the leader's pid is the group id)."""
        return [] if self.process is None else group_members(self.process.pid)

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> None:
        if self.process is not None:
            self.process.poll()

    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """:func:`stop_all` of this one: ``[name]`` if processes of its group outlived SIGKILL, else ``[]``."""
        return stop_all([self], timeout_s)


class StartupFailed(RuntimeError):
    """A server exited while starting or was not healthy in time; the message holds its log excerpt."""


def _exited_while_starting(servers: Sequence[ManagedProcess]) -> StartupFailed | None:
    for server in servers:
        code = server.exit_code()
        if code is not None:
            return StartupFailed(
                f"{server.name} exited with code {code} while starting; the end of {server.log_path}:\n"
                + server.log_tail()
            )
    return None


def wait_ready(
    servers: Sequence[ManagedProcess],
    timeout_s: float,
    *,
    on_poll: Callable[[float, Sequence[ManagedProcess]], None] | None = None,
    hint: str = "",
) -> None:
    """Wait until every started server answers ``/health`` (each remembers ``ready_after_s``), at most ``timeout_s``
    seconds, checking about every second. ``on_poll(seconds_waited, servers_still_waited_for)`` runs after every
    round, for progress. Raises ``StartupFailed`` (with log excerpts) when a server exits or the time is up;
    ``hint`` follows the list of late servers in that message (e.g. the flag that sets ``timeout_s``)."""
    started = time.monotonic()
    while True:
        if (failure := _exited_while_starting(servers)) is not None:
            raise failure
        waiting = [server for server in servers if not server.check_ready()]
        waited = time.monotonic() - started
        if on_poll is not None:
            on_poll(waited, waiting)
        if not waiting:
            return
        if waited >= timeout_s:
            tails = "\n".join(f"--- the end of {s.log_path} ---\n{s.log_tail()}" for s in waiting)
            names = ", ".join(s.name for s in waiting)
            raise StartupFailed(f"not healthy after {timeout_s:.0f} s: {names}{hint}\n{tails}")
        time.sleep(POLL_S)


def stop_all(children: Sequence[ManagedProcess], timeout_s: float = 20.0, kill_timeout_s: float = 10.0) -> list[str]:
    """SIGTERM every child's group at once, wait up to ``timeout_s`` for all of them to be gone, SIGKILL what is
    left and wait up to ``kill_timeout_s`` more. Returns the names of children with processes still alive."""
    started = [c for c in children if c.process is not None]
    for child in started:
        child.signal_group(signal.SIGTERM)
    for sig, limit in ((None, timeout_s), (signal.SIGKILL, kill_timeout_s)):
        if sig is not None:
            for child in started:
                if child.members():
                    child.signal_group(sig)
        deadline = time.monotonic() + limit
        while True:
            for child in started:
                child.reap()
            left = [c for c in started if c.members()]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not left:
            return []
    return [c.name for c in left]
