"""The disk tier: blocks as files in a directory that several processes and machines may share.

A store writes each whole aligned group of ``group_blocks`` blocks of a prompt to one *group file* named by
the group's last key, and every other block (a prompt's tail, a group split across store jobs) to its own
*block file* (formats: :mod:`.file_format`). Layout: ``root/<format tag, 16 hex>/<name key[:1] hex>/`` then
``<key hex>.kvblock`` or ``<last key hex>.g<group_blocks>.kvgroup``. Why groups: on ext4 creating a file cost
0.1-0.5 ms here whenever files were deleted in the last minute, as much as writing a 2 MiB block; a group of
8 creates one file where blocks created 8.

A file is written to a temporary name (new, or an evicted file of the same size reused) and renamed over its
final name, so a reader sees no file or a whole one; two writers of one name both rename, the last wins
(both wrote the same blocks, so either file is right). Before its bytes count as KV a file's header is
checked (magic, version, CRC, format tag: another model, rank or layout is *foreign*; its name key), its
length (*truncated*) and each block read against its own payload checksum (*corrupt*, :mod:`.checksum`).
Any failure is a miss, logged with the key's first digits and the reason, and the file is deleted (for a
group file, what that means for its other blocks: :mod:`.groups`); the engine blocks a failed load wrote
must be recomputed. A writer killed before its rename leaves only a temporary file, which no reader opens
and :meth:`DirectoryTier.sweep` deletes once it is ``stale_temp_seconds`` old. Files of the per-block
format (version 2) written before groups existed are block files: still read, and swept like any other.

A file's payload is written first and its header, which holds the payload checksums, last, at offset 0, before
the rename. With two or more CPUs a file's checksums are computed on a helper thread while its payload is written
(:mod:`.hash_ahead`: the checksum off the write's critical path); else each block's right before its write. A
load checks each block right after its read, while its bytes are in the CPU's caches; with two or more CPUs a
load job's files are read by two threads at once (:mod:`.two_readers`). :meth:`DirectoryTier.cached` tells whether
the page cache holds the files a load would read (:mod:`.page_cache`).

The size bound covers every block and group file under ``root``. Before a batch of new files is written, a
sweep scans them when this process's estimate plus the batch passes ``max_bytes`` and after every 10% of
``max_bytes`` it wrote (other processes write too), and evicts the files least recently written or loaded
(loads refresh the mtime) until the total plus the batch is under 90% of the bound: whole files, so a
group's blocks leave together. N processes sharing the directory overshoot it by at most about N x 10%.
Up to one evicted file of the same size per new file is renamed to a temporary name of this process (gone
from its name at once) and overwritten whole: a full tier creates and deletes no files. A reader that opened
a file before it was evicted reads it whole if it was deleted (POSIX); if it was rewritten meanwhile its
header or checksums no longer match: a miss, never another block's bytes. A reused file another process
deleted meanwhile (taken for a stale temporary file) is replaced by a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checksum import payload_checksum
from .errors import OffloadInputError
from .file_format import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    ReadOutcome,
    check_group_blocks,
    check_header,
    encode_group_header,
    encode_header,
    group_header_bytes,
)
from .file_io import TEMP_SUFFIX, publish, temp_name, touch, walk, write_all, writing
from .groups import GroupReader
from .hash_ahead import MIN_AHEAD_BYTES, ChecksumsAhead
from .helpers import helper_useful
from .keys import BlockKey, check_key, short
from .metrics import OffloadMetrics
from .page_cache import resident_fraction
from .specs import PageFormat, TierBlocks
from .two_readers import by_file, read_groups

__all__ = ["HEADER_BYTES", "MAGIC", "VERSION", "DirectoryTier", "ReadOutcome", "check_header", "encode_header"]

logger = logging.getLogger(__name__)

_SUFFIX = ".kvblock"
_GROUP_SUFFIX = ".kvgroup"
_LOW_WATERMARK = 0.9
_RESCAN_FRACTION = 0.1
#: blocks per group file unless told otherwise (measured: docs/offload.md, "Benchmark")
DEFAULT_GROUP_BLOCKS = 8

Pages = Sequence[np.ndarray]


@dataclass(frozen=True)
class _NewFile:
    """A file a store writes: ``blocks`` (key, pages) in order, one block file or one group file at ``final``."""

    final: Path
    name_key: BlockKey
    blocks: list[tuple[BlockKey, Pages]]
    grouped: bool = False


class DirectoryTier:
    """Blocks of one page format as files under ``root``; at most ``max_bytes`` of block and group files there.
    ``group_blocks`` > 1: a store job's whole aligned groups of that many blocks go to one group file each
    (named by the group's last key: :func:`~.file_format.file_keys`), the other blocks to block files."""

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
        group_blocks: int = DEFAULT_GROUP_BLOCKS,
        checksum_thread: bool | None = None,
        read_thread: bool | None = None,
    ) -> None:
        """``fsync``: flush each file before its rename (survives power loss, costs a disk flush per file;
        without it a process crash still never leaves a torn file). ``clock`` is wall time, compared with
        file mtimes to find stale temporary files. ``group_blocks``: blocks per group file (1: none).
        ``checksum_thread``: compute a store job's checksums on a helper thread while it writes
        (:mod:`.hash_ahead`); ``read_thread``: a load job's files are read by its thread and a helper thread at
        once (:mod:`.two_readers`); None for either: when this process may use more than one CPU."""
        if max_bytes < page_format.block_bytes + HEADER_BYTES:
            raise OffloadInputError(f"max_bytes {max_bytes} holds no block of {page_format.block_bytes} bytes")
        self.root = Path(root)
        self.page_format = page_format
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self.stale_temp_seconds = stale_temp_seconds
        self.group_blocks = check_group_blocks(group_blocks)
        self.checksum_thread = helper_useful() if checksum_thread is None else bool(checksum_thread)
        self.read_thread = helper_useful() if read_thread is None else bool(read_thread)
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

    @property
    def group_file_bytes(self) -> int:
        """Bytes of one group file (``group_blocks`` blocks)."""
        return group_header_bytes(self.group_blocks) + self.group_blocks * self.page_format.block_bytes

    def path_of(self, key: BlockKey) -> Path:
        """The block file of ``key``."""
        hexkey = check_key(key).hex()
        return self.directory / hexkey[:2] / f"{hexkey}{_SUFFIX}"

    def group_path_of(self, file_key: BlockKey) -> Path:
        """The group file named by ``file_key`` (its last block's key) in this tier's group size."""
        hexkey = check_key(file_key).hex()
        return self.directory / hexkey[:2] / f"{hexkey}.g{self.group_blocks}{_GROUP_SUFFIX}"

    def exists(self, key: BlockKey, file: BlockKey | None = None) -> bool:
        """Whether a file holding ``key`` exists (checked only when loaded): the group file named ``file`` (the
        key :func:`~.file_format.file_keys` gives ``key``; ``key`` itself for a group's last block) or ``key``'s
        block file. The scheduler's probe."""
        if file is not None and self.group_blocks > 1 and self.group_path_of(file).is_file():
            return True
        return self.path_of(key).is_file()

    def files_holding(self, keys: Sequence[BlockKey], files: Sequence[BlockKey] = ()) -> list[Path] | None:
        """The files a load of ``keys`` would read (``files``: each key's file key, as for :meth:`exists`: its group
        file if there, else its block file), each once, in order; None when some block has neither."""
        found: dict[Path, None] = {}
        for key, file in zip(keys, files or keys, strict=True):
            group = self.group_path_of(file) if self.group_blocks > 1 else None
            if group is not None and (group in found or group.is_file()):
                found[group] = None
            elif self.path_of(key).is_file():
                found[self.path_of(key)] = None
            else:
                return None
        return list(found)

    def cached(self, keys: Sequence[BlockKey], files: Sequence[BlockKey] = ()) -> bool:
        """Whether every file a load of ``keys`` would read (:meth:`files_holding`) is wholly in the page cache, so
        the load reads no storage (:mod:`.page_cache`; a page evicted after this answer is read from storage by the
        load). False when a block has no file or it cannot be told."""
        paths = self.files_holding(keys, files)
        return paths is not None and all(resident_fraction(path) == 1.0 for path in paths)

    # ------------------------------------------------------------------ writing files
    def write_temp(self, key: BlockKey, pages: Pages, *, reuse: Path | None = None) -> Path:
        """Write ``key``'s block to a temporary block file and return its path: a new file beside the block's
        final name, or ``reuse`` (a temporary file of this process, e.g. an evicted file, overwritten whole)."""
        self._check_pages(pages)
        with ChecksumsAhead([[pages]], ahead=False) as hashes:
            return self._write_file(_NewFile(self.path_of(key), key, [(key, pages)]), reuse, hashes, 0)

    def _write_file(self, new: _NewFile, reuse: Path | None, hashes: ChecksumsAhead, index: int) -> Path:
        """Write ``new`` (file ``index`` of ``hashes``) to a temporary file (new, or ``reuse`` overwritten
        whole) and return its path: the payload first, then the header with the blocks' checksums at offset 0.
        Until that header is written the file has none (a hole, or a reused file's old header, which the new
        payload fails); no reader opens a temporary file anyway."""
        header_bytes = self._size_of(new) - len(new.blocks) * self.page_format.block_bytes
        temp, fd = self._open_temp(new.final, reuse)
        with writing(fd, temp):
            os.lseek(fd, header_bytes, os.SEEK_SET)
            if hashes.start(index):  # the helper hashes the file while this one call writes it
                write_all(fd, [page.data for _key, pages in new.blocks for page in pages])
                checksums = hashes.result(index)
            else:  # each block right before its write, so the write reads its bytes from the CPU's caches
                checksums = []
                for _key, pages in new.blocks:
                    checksums.append(payload_checksum(pages))
                    write_all(fd, [page.data for page in pages])
            header = self._header_of(new, checksums)
            if os.pwrite(fd, header, 0) != len(header):
                raise OSError(f"short write of the header of {new.final.name}")
            self._finish(fd, reuse is not None, self._size_of(new))
        return temp

    def _header_of(self, new: _NewFile, checksums: list[int]) -> bytes:
        """The header of ``new``, given its blocks' payload checksums in order."""
        block_bytes = self.page_format.block_bytes
        if not new.grouped:
            return encode_header(new.name_key, self._tag, block_bytes, checksums[0])
        entries = [(key, checksum) for (key, _pages), checksum in zip(new.blocks, checksums, strict=True)]
        return encode_group_header(new.name_key, self._tag, block_bytes, entries)

    def _finish(self, fd: int, reused: bool, size: int) -> None:
        """Cut a reused file to ``size`` bytes; fsync if configured."""
        if reused and os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        if self.fsync:
            os.fsync(fd)

    def _open_temp(self, final: Path, reuse: Path | None) -> tuple[Path, int]:
        """``reuse`` opened for writing, or (when not given or gone) a new temporary file beside ``final``."""
        if reuse is not None:
            try:
                return reuse, os.open(reuse, os.O_WRONLY)
            except FileNotFoundError:
                pass  # swept by another process meanwhile
        temp = final.parent / temp_name(final.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return temp, os.open(temp, flags, 0o644)
        except FileNotFoundError:  # the first file of this fan-out directory
            final.parent.mkdir(exist_ok=True)
            return temp, os.open(temp, flags, 0o644)

    def publish(self, temp: Path, key: BlockKey) -> None:
        """Rename a file made by :meth:`write_temp` to ``key``'s name (atomic; replaces any older file).
        Raises :class:`FileNotFoundError` if ``temp`` is gone."""
        publish(temp, self.path_of(key))

    def store(self, key: BlockKey, pages: Pages) -> int:
        """Write one block file (pages in format order) unless a file of its key is there already (a key names
        its bytes; a damaged file is deleted when a load finds it). Returns bytes written (0: kept the
        file there). Makes room first when over the bound."""
        self._check_pages(pages)
        if self._stored(self.path_of(key)):
            return 0
        self._store_new([_NewFile(self.path_of(key), key, [(key, pages)])])
        return self.file_bytes

    def _store_new(self, new: Sequence[_NewFile]) -> None:
        """Write and publish files not on disk yet. One sweep for the whole batch makes room first when it
        is due, and the files it evicts are rewritten with new ones of the same size (none created or deleted)."""
        if not new:
            return
        ahead = (
            self.checksum_thread and sum(len(f.blocks) for f in new) * self.page_format.block_bytes >= MIN_AHEAD_BYTES
        )
        spares: dict[int, list[Path]] = {}
        with ChecksumsAhead([[pages for _key, pages in f.blocks] for f in new], ahead=ahead) as hashes:
            try:
                spares = self._make_room([self._size_of(f) for f in new])
                for index, file in enumerate(new):
                    pool = spares.get(self._size_of(file))
                    self._write_new(file, pool.pop() if pool else None, hashes, index)
            finally:
                for pool in spares.values():  # a batch cut short by an error
                    for spare in pool:
                        spare.unlink(missing_ok=True)

    def _make_room(self, sizes: list[int]) -> dict[int, list[Path]]:
        """Sweep before writing files of ``sizes`` bytes if the bound or the periodic rescan is due; returns the
        evicted files kept for reuse, by size (at most as many of a size as ``sizes`` has)."""
        incoming = sum(sizes)
        due = self._estimated_bytes is None or self._estimated_bytes + incoming > self.max_bytes
        if due or self._written_since_scan + incoming >= self.max_bytes * _RESCAN_FRACTION:  # others write too
            return self._sweep(Counter(sizes))[1]
        return {}

    def _write_new(self, new: _NewFile, spare: Path | None, hashes: ChecksumsAhead, index: int) -> None:
        """Write and publish one file (into ``spare``, an evicted file of its size, if given); account for it."""
        temp = self._write_file(new, spare, hashes, index)
        try:
            publish(temp, new.final)
        except FileNotFoundError:  # another process's sweep took the reused file for a stale temporary one
            publish(self._write_file(new, None, hashes, index), new.final)
            temp.unlink(missing_ok=True)
        size = self._size_of(new)
        self._written_since_scan += size
        if self._estimated_bytes is not None:
            self._estimated_bytes += size
            if self._estimated_bytes > self.max_bytes:  # a batch larger than the room its sweep made
                self.sweep()

    def _size_of(self, new: _NewFile) -> int:
        if not new.grouped:
            return self.file_bytes
        return group_header_bytes(len(new.blocks)) + len(new.blocks) * self.page_format.block_bytes

    # ------------------------------------------------------------------ reading files
    def load(self, key: BlockKey, pages: Pages) -> ReadOutcome:
        """Read ``key``'s block file into ``pages`` (writable, format order) and check it. Anything but
        ``"ok"`` is a miss, and ``pages`` may then hold garbage."""
        outcome, checksum = self._read_unchecked(key, pages)
        if outcome == "ok" and payload_checksum(pages) != checksum:
            outcome = "corrupt"
        return self._settle(key, outcome)

    def _read_unchecked(self, key: BlockKey, pages: Pages) -> tuple[ReadOutcome, int]:
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
            touch(path)
        elif outcome != "missing":
            self._reject(path, key, outcome)
        return outcome

    def _reject(self, path: Path, key: BlockKey, outcome: ReadOutcome) -> None:
        """A damaged file: warn (naming the key's first digits and the reason), delete it, count the block."""
        logger.warning(
            "disk tier: %s of block %s is %s; deleted, treated as a miss", path.suffix[1:], short(key), outcome
        )
        path.unlink(missing_ok=True)
        self._count_rejected(outcome)

    def _count_rejected(self, outcome: ReadOutcome) -> None:
        if self._metrics is not None:
            self._metrics.rejected_blocks.labels(self.name, outcome).inc()

    # ------------------------------------------------------------------ batches (the worker's interface)
    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int:
        """Store engine block ``block_ids[i]`` as ``blocks.keys[i]``; returns payload bytes written (headers
        and blocks already there not counted). Runs of ``group_blocks`` blocks sharing one ``blocks.files``
        key, that key their last block's, go to one group file; the others to block files."""
        files = self._files_of(blocks)
        pending: list[tuple[BlockKey, BlockKey, Pages]] = []
        for key, file, block in zip(blocks.keys, files, block_ids, strict=True):
            pages = [cache[block] for cache in caches]
            self._check_pages(pages)
            pending.append((key, file, pages))
        new = self._new_files(pending)
        self._store_new(new)
        return sum(len(f.blocks) for f in new) * self.page_format.block_bytes

    def _new_files(self, pending: list[tuple[BlockKey, BlockKey, Pages]]) -> list[_NewFile]:
        """The files to write for (key, file key, pages) in job order, leaving out what is on disk already."""
        new: list[_NewFile] = []
        start = 0
        while start < len(pending):
            end = start + 1
            while end < len(pending) and pending[end][1] == pending[start][1]:
                end += 1
            run, name = pending[start:end], pending[start][1]
            if self.group_blocks > 1 and len(run) == self.group_blocks and run[-1][0] == name:
                if not self._stored(self.group_path_of(name)):
                    new.append(_NewFile(self.group_path_of(name), name, [(k, p) for k, _, p in run], grouped=True))
            else:
                for key, file, pages in run:
                    held = self.group_blocks > 1 and self._stored(self.group_path_of(file))
                    if not held and not self._stored(self.path_of(key)):
                        new.append(_NewFile(self.path_of(key), key, [(key, pages)]))
            start = end
        return new

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[BlockKey]]:
        """Load ``blocks.keys[i]`` into engine block ``block_ids[i]``, from its group file ``blocks.files[i]``
        if that exists, else from its block file; returns (bytes loaded, keys that missed). Each block is
        checksummed right after it is read, while its bytes are still in the CPU's caches. With ``read_thread``
        (and a job of 1 MiB or more) the job's files are read by this thread and a helper at once."""
        files = self._files_of(blocks)
        grouped = self.group_blocks > 1  # a group's last block has file == key: try its group first
        with GroupReader(
            self.page_format, self.group_blocks, self.group_path_of, self._reject, self._count_rejected
        ) as groups:

            def read(index: int) -> bool:
                key, file = blocks.keys[index], files[index]
                pages = [cache[block_ids[index]] for cache in caches]
                self._check_pages(pages)
                return (grouped and groups.load(file, key, pages) == "ok") or self.load(key, pages) == "ok"

            two = self.read_thread and len(blocks.keys) * self.page_format.block_bytes >= MIN_AHEAD_BYTES
            missed = read_groups(by_file(files), read, two=two)
        failed = [key for index, key in enumerate(blocks.keys) if index in missed]
        return (len(blocks.keys) - len(failed)) * self.page_format.block_bytes, failed

    def _files_of(self, blocks: TierBlocks) -> tuple[BlockKey, ...]:
        if not blocks.files:
            return blocks.keys
        if len(blocks.files) != len(blocks.keys):
            raise OffloadInputError(f"{len(blocks.files)} file keys for {len(blocks.keys)} blocks")
        return blocks.files

    def close(self) -> None:
        """Nothing to release (the tier holds no thread, file or buffer between calls); for the worker's interface."""

    # ------------------------------------------------------------------ size bound
    def sweep(self) -> int:
        """Delete stale temporary files, then the oldest block and group files while the total is over 90% of
        ``max_bytes`` (only when it is over ``max_bytes``). Returns files deleted."""
        return self._sweep(Counter())[0]

    def _sweep(self, reuse: Counter[int]) -> tuple[int, dict[int, list[Path]]]:
        """:meth:`sweep` before new files are written (``reuse``: how many of each size): the bound counts
        them, and up to that many evicted files of this format and size are renamed to temporary names and
        returned, for them to overwrite, instead of being deleted. Returns (files evicted, those kept by size)."""
        files, total = self._scan()
        incoming = sum(size * count for size, count in reuse.items())
        wanted = Counter(reuse)
        evicted = 0
        spares: dict[int, list[Path]] = {}
        if total + incoming > self.max_bytes:
            for _mtime, size, path in sorted(files):
                if total + incoming <= self.max_bytes * _LOW_WATERMARK:
                    break
                reusable = wanted[size] > 0 and path.parent.parent == self.directory
                kept = self._keep_for_reuse(path) if reusable else None
                if kept is not None:
                    spares.setdefault(size, []).append(kept)
                    wanted[size] -= 1
                    evicted += 1
                else:
                    with contextlib.suppress(FileNotFoundError):  # another process swept it first
                        path.unlink()
                        evicted += 1
                total -= size
        self._estimated_bytes = total
        self._written_since_scan = 0
        if evicted and self._metrics is not None:
            self._metrics.evictions.labels(self.name).inc(evicted)
        return evicted, spares

    def _keep_for_reuse(self, path: Path) -> Path | None:
        """Rename an evicted file to a temporary name of this process (gone from its key at once);
        None if another process took it first."""
        spare = path.parent / temp_name(path.name)
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            return None
        return spare

    # ------------------------------------------------------------------ internals
    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """Every block and group file under ``root`` as (mtime, size, path), and their total size; deletes stale
        temporary files on the way."""
        files: list[tuple[float, int, Path]] = []
        stale_before = self._clock() - self.stale_temp_seconds
        for entry in walk(self.root, depth=3):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.endswith((_SUFFIX, _GROUP_SUFFIX)):
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
            elif entry.name.endswith(TEMP_SUFFIX) and stat.st_mtime < stale_before:
                Path(entry.path).unlink(missing_ok=True)
        return files, sum(size for _, size, _ in files)

    def _read_payload(self, fd: int, key: BlockKey, pages: Pages) -> tuple[ReadOutcome, int]:
        size = os.fstat(fd).st_size
        outcome, checksum = check_header(os.pread(fd, HEADER_BYTES, 0), key, self._tag, self.page_format.block_bytes)
        if outcome != "ok":
            return outcome, 0
        if size != self.file_bytes:
            return ("truncated" if size < self.file_bytes else "corrupt"), 0
        if os.preadv(fd, [page.data for page in pages], HEADER_BYTES) != self.page_format.block_bytes:
            return "truncated", 0
        return "ok", checksum

    def _stored(self, path: Path) -> bool:
        """Whether ``path`` exists; if so its age is refreshed (a store of what is held counts as use)."""
        if not path.is_file():
            return False
        touch(path)
        return True

    def _check_pages(self, pages: Pages) -> None:
        sizes = tuple(page.nbytes for page in pages)
        if sizes != self.page_format.page_bytes:
            raise OffloadInputError(
                f"pages of {sizes[:8]} bytes do not match the format's {self.page_format.page_bytes[:8]}"
            )
