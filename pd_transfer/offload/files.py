"""The disk tier: one file per block in a directory that several processes and machines may share.

A block is written to a temporary file (new, or an evicted one reused) and renamed over its final name, so a
reader sees either no file or a whole one; two writers of one key both rename and the last rename wins
(both wrote the same key, so either file is right). A file is checked before its bytes count as KV: its
header (magic, version, header checksum), its key and page format (another model, rank or layout is
*foreign*), its length (*truncated*) and its payload checksum (*corrupt*, :mod:`.checksum`). Any failure is a miss,
logged with the key's first digits and the reason; the bytes it may have left in the engine blocks must be
recomputed (the load reports failure). A writer killed before its rename leaves only a temporary file,
which no reader opens and :meth:`DirectoryTier.sweep` deletes once it is ``stale_temp_seconds`` old.

Layout: ``root/<format tag, 16 hex>/<key[:1] hex>/<key hex>.kvblock``. File format (little-endian):

====== ===== ===================================================================
offset bytes field
====== ===== ===================================================================
0      8     magic ``b"PDKVBLK1"``
8      2     format version (2; version 1 files, whose checksum was row and column sums, are foreign)
10     2     header bytes (64)
12     4     flags (0)
16     16    block key
32     8     page format tag (:attr:`PageFormat.tag`)
40     8     payload bytes (the page format's ``block_bytes``)
48     8     payload checksum (:func:`~.checksum.payload_checksum`, XXH3-64)
56     4     CRC-32 of bytes 0..55
60     4     zero
64     ...   payload: page 0 of the block, page 1, ... (one per engine cache tensor)
====== ===== ===================================================================

A store checksums each block right before writing it and a load right after reading it, on the worker's
thread, while the block's bytes are in the CPU's caches (2 MiB blocks, a 32 MiB L3 here). A second thread
checksumming the next block while this one was written helped the numpy checksum of version 1 on an idle
machine (167 -> 115 ms per 256 MiB); with XXH3, measured under load, it was slower (full tier: 560 against
469 ms, store ratio 0.50 against 0.66), and it only ever helps where a core is free.

The size bound covers every ``*.kvblock`` under ``root``. Before a batch of new blocks is written, a sweep
scans them when this process's estimate plus the batch passes ``max_bytes`` and after every 10% of
``max_bytes`` it wrote (other processes write too), and evicts the files least recently written or loaded
(loads refresh the mtime) until the total plus the batch is under 90% of the bound; one sweep per batch. So N
processes sharing the directory overshoot it by at most about N x 10%. Up to one evicted file per new block
is not deleted but renamed to a temporary name of this process (gone from its key at once) and overwritten
whole with a new block, then renamed to that block's name: a full tier creates and deletes no files (on
ext4 without a journal, creating a file right after others were deleted cost 0.4-0.5 ms here, as much as
writing 2 MiB). Processes sweep independently. A reader that opened a file before it was evicted reads it
whole if the file was deleted (POSIX); if it was rewritten meanwhile, its header or checksum no longer
matches: a miss (``foreign`` or ``corrupt``), never another block's bytes. A reused file another process
deleted meanwhile (a sweep takes it for a stale temporary file) is replaced by a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from .checksum import payload_checksum
from .errors import OffloadInputError
from .keys import BlockKey, check_key, short
from .metrics import OffloadMetrics
from .specs import PageFormat, TierBlocks

logger = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
VERSION = 2  # 1: the payload checksum was row and column sums (checksum.py)
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sHHI16s8sQQ")  # up to the header CRC
_SUFFIX = ".kvblock"
_TEMP_SUFFIX = ".tmp"
_LOW_WATERMARK = 0.9
_RESCAN_FRACTION = 0.1

ReadOutcome = Literal["ok", "missing", "truncated", "corrupt", "foreign"]


def encode_header(key: BlockKey, tag: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The 64-byte header of a block file."""
    fields = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, 0, key, tag, payload_bytes, checksum)
    return (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")


def check_header(header: bytes, key: BlockKey, tag: bytes, payload_bytes: int) -> tuple[ReadOutcome, int]:
    """``("ok", payload checksum)`` if ``header`` is a valid header of ``key`` in format ``tag``, else the reason."""
    if len(header) < HEADER_BYTES:
        return "truncated", 0
    fields = header[: _HEADER.size]
    if header[:8] != MAGIC or struct.unpack_from("<I", header, _HEADER.size)[0] != zlib.crc32(fields):
        return "corrupt", 0
    _magic, version, header_bytes, _flags, file_key, file_tag, file_payload, checksum = _HEADER.unpack(fields)
    if version != VERSION or header_bytes != HEADER_BYTES or file_tag != tag or file_payload != payload_bytes:
        return "foreign", 0
    if file_key != key:
        return "foreign", 0
    return "ok", checksum


class DirectoryTier:
    """Blocks of one page format as files under ``root``; at most ``max_bytes`` of block files there."""

    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        page_format: PageFormat,
        *,
        max_bytes: int,
        fsync: bool = False,
        stale_temp_seconds: float = 600.0,
        metrics: OffloadMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``fsync``: flush each file before its rename (survives power loss, costs a disk flush per block;
        without it a process crash still never leaves a torn file). ``clock`` is wall time, compared with
        file mtimes to find stale temporary files."""
        if max_bytes < page_format.block_bytes + HEADER_BYTES:
            raise OffloadInputError(f"max_bytes {max_bytes} holds no block of {page_format.block_bytes} bytes")
        self.root = Path(root)
        self.page_format = page_format
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self.stale_temp_seconds = stale_temp_seconds
        self._metrics = metrics
        self._clock = clock
        self._tag = page_format.tag
        self.directory = self.root / self._tag.hex()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._estimated_bytes: int | None = None  # unknown until the first sweep
        self._written_since_scan = 0

    @property
    def file_bytes(self) -> int:
        """Bytes of one block file."""
        return HEADER_BYTES + self.page_format.block_bytes

    def path_of(self, key: BlockKey) -> Path:
        hexkey = check_key(key).hex()
        return self.directory / hexkey[:2] / f"{hexkey}{_SUFFIX}"

    def exists(self, key: BlockKey) -> bool:
        """Whether a file for ``key`` exists (it is checked only when loaded): the scheduler's probe."""
        return self.path_of(key).is_file()

    # ------------------------------------------------------------------ one block
    def write_temp(
        self, key: BlockKey, pages: Sequence[np.ndarray], checksum: int | None = None, *, reuse: Path | None = None
    ) -> Path:
        """Write ``key``'s block to a temporary file and return its path: a new file beside the block's final
        name, or ``reuse`` (a temporary file of this process, e.g. an evicted block file, overwritten whole).
        ``checksum``: the pages' :func:`payload_checksum` if the caller has it (else computed here)."""
        self._check_pages(pages)
        if checksum is None:
            checksum = payload_checksum(pages)
        header = encode_header(key, self._tag, self.page_format.block_bytes, checksum)
        temp, fd = self._open_temp(key, reuse)
        try:
            _write_all(fd, [memoryview(header), *(page.data for page in pages)])
            if reuse is not None and os.fstat(fd).st_size != self.file_bytes:
                os.ftruncate(fd, self.file_bytes)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return temp

    def _open_temp(self, key: BlockKey, reuse: Path | None) -> tuple[Path, int]:
        """``reuse`` opened for writing, or (when not given or gone) a new temporary file for ``key``."""
        if reuse is not None:
            try:
                return reuse, os.open(reuse, os.O_WRONLY)
            except FileNotFoundError:
                pass  # swept by another process meanwhile
        final = self.path_of(key)
        temp = final.parent / _temp_name(final.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return temp, os.open(temp, flags, 0o644)
        except FileNotFoundError:  # the first block of this fan-out directory
            final.parent.mkdir(exist_ok=True)
            return temp, os.open(temp, flags, 0o644)

    def publish(self, temp: Path, key: BlockKey) -> None:
        """Rename a file made by :meth:`write_temp` to ``key``'s name (atomic; replaces any older file).
        Raises :class:`FileNotFoundError` if ``temp`` is gone."""
        final = self.path_of(key)
        try:
            os.replace(temp, final)
        except FileNotFoundError:
            if final.parent.is_dir():
                raise
            final.parent.mkdir(exist_ok=True)  # a reused file came from another fan-out directory
            os.replace(temp, final)

    def store(self, key: BlockKey, pages: Sequence[np.ndarray]) -> int:
        """Write one block (pages in format order) unless a file of its key is there already (a key names
        its bytes; a damaged file is deleted when a load finds it). Returns bytes written (0: kept the
        file there). Makes room first when over the bound."""
        self._check_pages(pages)
        if self.exists(key):
            _touch(self.path_of(key))
            return 0
        self._store_new([(key, pages)])
        return self.file_bytes

    def _store_new(self, new: Sequence[tuple[BlockKey, Sequence[np.ndarray]]]) -> None:
        """Write and publish blocks not on disk yet. One sweep for the whole batch makes room first when it
        is due, and the files it evicts are rewritten with the new blocks (no file created or deleted)."""
        spares = self._make_room(len(new)) if new else []
        try:
            for key, pages in new:
                self._write_new(key, pages, payload_checksum(pages), spares.pop() if spares else None)
        finally:
            for spare in spares:  # a batch cut short by an error
                spare.unlink(missing_ok=True)

    def _make_room(self, count: int) -> list[Path]:
        """Sweep before writing ``count`` new files if the bound or the periodic rescan is due; returns the
        evicted files kept for reuse (at most ``count``)."""
        incoming = count * self.file_bytes
        due = self._estimated_bytes is None or self._estimated_bytes + incoming > self.max_bytes
        if due or self._written_since_scan + incoming >= self.max_bytes * _RESCAN_FRACTION:  # others write too
            return self._sweep(count)[1]
        return []

    def _write_new(self, key: BlockKey, pages: Sequence[np.ndarray], checksum: int, spare: Path | None) -> None:
        """Write and publish one block (into ``spare``, an evicted file, if given); account for it."""
        temp = self.write_temp(key, pages, checksum, reuse=spare)
        try:
            self.publish(temp, key)
        except FileNotFoundError:  # another process's sweep took the reused file for a stale temporary one
            self.publish(self.write_temp(key, pages, checksum), key)
            temp.unlink(missing_ok=True)
        self._written_since_scan += self.file_bytes
        if self._estimated_bytes is not None:
            self._estimated_bytes += self.file_bytes
            if self._estimated_bytes > self.max_bytes:  # a batch larger than the room its sweep made
                self.sweep()

    def load(self, key: BlockKey, pages: Sequence[np.ndarray]) -> ReadOutcome:
        """Read ``key``'s block into ``pages`` (writable, format order) and check it. Anything but ``"ok"``
        is a miss, and ``pages`` may then hold garbage."""
        outcome, checksum = self._read_unchecked(key, pages)
        if outcome == "ok" and payload_checksum(pages) != checksum:
            outcome = "corrupt"
        return self._settle(key, outcome)

    def _read_unchecked(self, key: BlockKey, pages: Sequence[np.ndarray]) -> tuple[ReadOutcome, int]:
        """Read ``key``'s payload into ``pages`` after checking header and length: ``("ok", the checksum the
        payload must have)``, or why not."""
        self._check_pages(pages)
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            return "missing", 0
        try:
            return self._read_payload(fd, key, pages)
        finally:
            os.close(fd)

    def _settle(self, key: BlockKey, outcome: ReadOutcome) -> ReadOutcome:
        """After a load: refresh a good file's age; delete (and count) a bad one, so a later store rewrites it."""
        path = self.path_of(key)
        if outcome == "ok":
            _touch(path)
        elif outcome != "missing":
            logger.warning("disk tier: block %s is %s; deleted, treated as a miss", short(key), outcome)
            path.unlink(missing_ok=True)
            if self._metrics is not None:
                self._metrics.rejected_blocks.labels(self.name, outcome).inc()
        return outcome

    # ------------------------------------------------------------------ batches (the worker's interface)
    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int:
        """Store engine block ``block_ids[i]`` as ``blocks.keys[i]``; returns payload bytes written (headers
        and blocks already there not counted)."""
        new: list[tuple[BlockKey, list[np.ndarray]]] = []
        for key, block in zip(blocks.keys, block_ids, strict=True):
            pages = [cache[block] for cache in caches]
            self._check_pages(pages)
            if self.exists(key):
                _touch(self.path_of(key))
            else:
                new.append((key, pages))
        self._store_new(new)
        return len(new) * self.page_format.block_bytes

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[BlockKey]]:
        """Load ``blocks.keys[i]`` into engine block ``block_ids[i]``; returns (bytes loaded, keys that missed).
        Each block is checksummed right after it is read, while its bytes are still in the CPU's caches."""
        missed = [
            key for key, b in zip(blocks.keys, block_ids, strict=True) if self.load(key, [c[b] for c in caches]) != "ok"
        ]
        return (len(blocks.keys) - len(missed)) * self.page_format.block_bytes, missed

    def close(self) -> None:
        """Nothing to release (the tier holds no thread, file or buffer between calls); for the worker's interface."""

    # ------------------------------------------------------------------ size bound
    def sweep(self) -> int:
        """Delete stale temporary files, then the oldest block files while the total is over 90% of
        ``max_bytes`` (only when it is over ``max_bytes``). Returns block files deleted."""
        return self._sweep(0)[0]

    def _sweep(self, reuse: int) -> tuple[int, list[Path]]:
        """:meth:`sweep` before ``reuse`` new block files are written: the bound counts them, and up to
        ``reuse`` evicted files of this format are renamed to temporary names and returned, for those
        blocks to overwrite, instead of being deleted. Returns (block files evicted, those kept)."""
        files, total = self._scan()
        incoming = reuse * self.file_bytes
        evicted: list[Path] = []
        spares: list[Path] = []
        if total + incoming > self.max_bytes:
            for _mtime, size, path in sorted(files):
                if total + incoming <= self.max_bytes * _LOW_WATERMARK:
                    break
                reusable = len(spares) < reuse and size == self.file_bytes and path.parent.parent == self.directory
                kept = self._keep_for_reuse(path) if reusable else None
                if kept is not None:
                    spares.append(kept)
                    evicted.append(path)
                else:
                    with contextlib.suppress(FileNotFoundError):  # another process swept it first
                        path.unlink()
                        evicted.append(path)
                total -= size
        self._estimated_bytes = total
        self._written_since_scan = 0
        if evicted and self._metrics is not None:
            self._metrics.evictions.labels(self.name).inc(len(evicted))
        return len(evicted), spares

    def _keep_for_reuse(self, path: Path) -> Path | None:
        """Rename an evicted block file to a temporary name of this process (gone from its key at once);
        None if another process took it first."""
        spare = path.parent / _temp_name(path.name)
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            return None
        return spare

    # ------------------------------------------------------------------ internals
    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """Every block file under ``root`` as (mtime, size, path), and their total size; deletes stale
        temporary files on the way."""
        files: list[tuple[float, int, Path]] = []
        stale_before = self._clock() - self.stale_temp_seconds
        for entry in _entries(self.root, depth=3):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.endswith(_SUFFIX):
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
            elif entry.name.endswith(_TEMP_SUFFIX) and stat.st_mtime < stale_before:
                Path(entry.path).unlink(missing_ok=True)
        return files, sum(size for _, size, _ in files)

    def _read_payload(self, fd: int, key: BlockKey, pages: Sequence[np.ndarray]) -> tuple[ReadOutcome, int]:
        size = os.fstat(fd).st_size
        outcome, checksum = check_header(os.pread(fd, HEADER_BYTES, 0), key, self._tag, self.page_format.block_bytes)
        if outcome != "ok":
            return outcome, 0
        if size != self.file_bytes:
            return ("truncated" if size < self.file_bytes else "corrupt"), 0
        if os.preadv(fd, [page.data for page in pages], HEADER_BYTES) != self.page_format.block_bytes:
            return "truncated", 0
        return "ok", checksum

    def _check_pages(self, pages: Sequence[np.ndarray]) -> None:
        sizes = tuple(page.nbytes for page in pages)
        if sizes != self.page_format.page_bytes:
            raise OffloadInputError(
                f"pages of {sizes[:8]} bytes do not match the format's {self.page_format.page_bytes[:8]}"
            )


def _temp_name(name: str) -> str:
    """A temporary file name no other writer uses: hidden, this process's id, random, ``.tmp``."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """``os.writev`` until every byte is written (a regular file may take fewer bytes per call)."""
    pending = [buffer.cast("B") for buffer in buffers]
    while pending:
        written = os.writev(fd, pending[:1024])
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]


def _entries(directory: Path, depth: int) -> Iterator[os.DirEntry[str]]:
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
            yield from _entries(Path(entry.path), depth - 1)


def _touch(path: Path) -> None:
    """Mark a block as recently used (sweeps delete the least recently touched first)."""
    try:
        os.utime(path)
    except OSError:
        pass  # swept meanwhile: the caller already has its bytes
