"""Reading a child process's stdout line by line, each line bounded in time (the offload tests' writer processes)."""

from __future__ import annotations

import select
import subprocess


def read_line(process: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    """The next line ``process`` prints, stripped; fails if none comes within ``timeout`` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no line from pid {process.pid} within {timeout} s"
    return process.stdout.readline().decode().strip()
