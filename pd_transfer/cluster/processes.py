"""Child processes of ``pd-transfer up``: each in its own process group (session), output to a log file,
stopped by signalling the whole group so that vLLM's engine and worker processes go with its API server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ManagedProcess", "group_members", "log_excerpt", "stop_all"]

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
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@dataclass
class ManagedProcess:
    """A command run in its own session, its output in ``log_path``; healthy when ``health_url`` answers 200."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str
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

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=timeout_s) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError, ValueError):
            return False

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
