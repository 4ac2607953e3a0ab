"""The exit bound of tests/support/exit_bound.py, in a real pytest process: a session whose last test leaves a
thread the interpreter waits for at exit ends within the bound, its summary printed, the hung thread's stack on
stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # where exit_bound.py lives

HANGING_TEST = textwrap.dedent(
    """
    import threading

    def wait_forever_at_exit() -> None:
        threading.Event().wait()

    def test_leaves_a_thread_behind() -> None:
        threading.Thread(target=wait_forever_at_exit, daemon=False).start()
        assert True
    """
)


def test_a_hang_at_exit_ends_within_the_bound(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "PD_TRANSFER_TEST_EXIT_BOUND_S": "1.5"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "exit_bound", "-p", "no:cacheprovider", "test_hang.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # without the bound it would never end
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout  # the summary was flushed before the wait
    assert "wait_forever_at_exit" in done.stderr, done.stderr  # the stack of the thread it hung on
