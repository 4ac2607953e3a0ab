"""Reading blocks out of the disk tier's group files (:mod:`.file_format`), for one load job.

Each group file a job touches is opened once and its header checked once; each block read from it is checked
against its own payload checksum right after the read. What a damaged group means:

* a header that fails (torn, truncated, another format, another group's name): every block of the file is a
  miss; the file is deleted (so a later store writes the group again) and each requested block is counted;
* a block whose bytes fail their checksum: that block is a miss and the whole file is deleted (its bytes are
  no longer trusted: a lost write without ``fsync``, a storage fault), so the group's other blocks are misses
  from then on; blocks of it this load already read passed their own checksums and are right KV.

A block that misses in its group file is then looked for in its own block file (a tail stored earlier), by
the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from .checksum import payload_checksum
from .file_format import ReadOutcome, check_group_header, group_header_bytes
from .file_io import touch
from .keys import BlockKey
from .specs import PageFormat

_Open = tuple[int, dict[BlockKey, tuple[int, int]]]  # descriptor, {key: (slot, checksum)}


class GroupReader:
    """Blocks of one load job out of group files of ``group_blocks`` blocks; a context manager that closes the
    files it opened and refreshes the age of those it read blocks from."""

    def __init__(
        self,
        page_format: PageFormat,
        group_blocks: int,
        path_of: Callable[[BlockKey], Path],
        reject: Callable[[Path, BlockKey, ReadOutcome], None],
        count_rejected: Callable[[ReadOutcome], None],
    ) -> None:
        """``path_of(file key)``: the group file; ``reject(path, key, outcome)``: warn, delete, count (once
        per damaged file); ``count_rejected(outcome)``: count a further block refused from a damaged file."""
        self._tag = page_format.tag
        self._block_bytes = page_format.block_bytes
        self._blocks = group_blocks
        self._header_bytes = group_header_bytes(group_blocks)
        self._path_of = path_of
        self._reject = reject
        self._count_rejected = count_rejected
        self._files: dict[BlockKey, _Open | ReadOutcome] = {}
        self._used: set[BlockKey] = set()

    def __enter__(self) -> GroupReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for file_key, state in self._files.items():
            if not isinstance(state, str):
                os.close(state[0])
                if file_key in self._used:
                    touch(self._path_of(file_key))
        self._files.clear()

    def load(self, file_key: BlockKey, key: BlockKey, pages: Sequence[np.ndarray]) -> ReadOutcome:
        """Read block ``key`` of the group file ``file_key`` into ``pages`` and check it. ``"missing"``: no
        such file; anything but ``"ok"`` is a miss and ``pages`` may hold garbage."""
        state = self._files.get(file_key)
        if isinstance(state, str):  # found damaged earlier in this job (and deleted then)
            self._count_rejected(state)
            return state
        if state is None:
            state = self._open(file_key, key)
            if isinstance(state, str):
                return state
        fd, entries = state
        entry = entries.get(key)
        if entry is None:
            return self._damaged(file_key, key, "foreign")
        slot, checksum = entry
        offset = self._header_bytes + slot * self._block_bytes
        if os.preadv(fd, [page.data for page in pages], offset) != self._block_bytes:
            return self._damaged(file_key, key, "truncated")
        if payload_checksum(pages) != checksum:
            return self._damaged(file_key, key, "corrupt")
        self._used.add(file_key)
        return "ok"

    def _open(self, file_key: BlockKey, key: BlockKey) -> _Open | ReadOutcome:
        """Open and check a group file (remembered for the job's other blocks); an outcome if it cannot be used.
        A damaged file is rejected here, on behalf of ``key``."""
        try:
            fd = os.open(self._path_of(file_key), os.O_RDONLY)
        except FileNotFoundError:
            return "missing"  # not remembered: a store may publish it before the job's next block
        size = os.fstat(fd).st_size
        outcome, entries = check_group_header(
            os.pread(fd, self._header_bytes, 0), file_key, self._tag, self._block_bytes, self._blocks
        )
        expected = self._header_bytes + self._blocks * self._block_bytes
        if outcome == "ok" and size != expected:
            outcome = "truncated" if size < expected else "corrupt"
        if outcome != "ok":
            os.close(fd)
            self._files[file_key] = outcome
            self._reject(self._path_of(file_key), key, outcome)
            return outcome
        self._files[file_key] = (fd, entries)
        return fd, entries

    def _damaged(self, file_key: BlockKey, key: BlockKey, outcome: ReadOutcome) -> ReadOutcome:
        """A block of an open group file failed: close and reject the file; its other blocks miss from now on."""
        state = self._files[file_key]
        if not isinstance(state, str):
            os.close(state[0])
        self._files[file_key] = outcome
        self._used.discard(file_key)
        self._reject(self._path_of(file_key), key, outcome)
        return outcome
