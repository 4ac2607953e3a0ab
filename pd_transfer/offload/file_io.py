"""Low-level file helpers of the disk tier: temporary names, whole writes, atomic publish, scans, ages."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def writing(fd: int, temp: Path) -> Iterator[None]:
    """Close ``fd`` after the block; on an error also delete ``temp`` (a half-written temporary file)."""
    try:
        yield
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)


def publish(temp: Path, final: Path) -> None:
    """Rename ``temp`` over ``final`` (atomic); creates ``final``'s fan-out directory if a reused file came
    from another. Raises :class:`FileNotFoundError` if ``temp`` is gone."""
    try:
        os.replace(temp, final)
    except FileNotFoundError:
        if final.parent.is_dir():
            raise
        final.parent.mkdir(exist_ok=True)
        os.replace(temp, final)


def temp_name(name: str) -> str:
    """A temporary file name no other writer uses: hidden, this process's id, random, ``.tmp``."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """``os.writev`` until every byte is written (a regular file may take fewer bytes per call)."""
    pending = [buffer.cast("B") for buffer in buffers]
    while pending:
        written = os.writev(fd, pending[:1024])
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]


def walk(directory: Path, depth: int) -> Iterator[os.DirEntry[str]]:
    """The entries ``depth`` levels below ``directory`` (``depth`` 1: its own), through directories only;
    directories that vanish meanwhile are skipped."""
    try:
        with os.scandir(directory) as scan:
            entries = list(scan)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if depth == 1:
            yield entry
        elif entry.is_dir(follow_symlinks=False):
            yield from walk(Path(entry.path), depth - 1)


def touch(path: Path) -> None:
    """Mark a block as recently used (sweeps delete the least recently touched first)."""
    try:
        os.utime(path)
    except OSError:
        pass  # swept meanwhile: the caller already has its bytes
