"""Proof that a side-channel client runs on the prefill's host, asked before the prefill sends it IPC handles.

Why a token file: a CUDA IPC handle (or a memfd path) opens only on the host that made it, and torch's IPC
reference counter of a shared CUDA allocation is a file in the owner's ``/dev/shm`` that the reader must open too.
So the check is what the reader needs: the server writes 32 random bytes to ``/dev/shm/pd-transfer-host-<hex>``,
mode 0600, and names that path and its host's boot id (``/proc/sys/kernel/random/boot_id``) in its ``Challenge``. A
client whose own boot id is the same reads the file (only a process of the same user, on the same host, sharing that
``/dev/shm``, can) and returns an HMAC of both nonces under the token, never the token itself. A remote client has
another boot id and sends no proof; one that lies about it still cannot read the file. Comparing boot ids alone would
not do (they are not secret); a token over the side channel would prove nothing.

The client reads only a path of exactly that shape, a regular file it owns of exactly 32 bytes, opened without
following links: a prefill cannot make it read anything else, and what it sends back reveals nothing of the file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import weakref
from pathlib import Path

from .messages import HostIdentity

logger = logging.getLogger(__name__)

#: Where token files are made: the host's shared memory, which torch's CUDA IPC reference counters also use.
TOKEN_DIRECTORY = "/dev/shm"
TOKEN_PREFIX = "pd-transfer-host-"
TOKEN_BYTES = 32
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_PROOF_LABEL = b"pd-transfer/handshake/host-proof\x00"
_TOKEN_NAME = re.compile(re.escape(TOKEN_PREFIX) + r"[0-9a-f]{32}")


def local_boot_id() -> str:
    """This host's boot id (a UUID the kernel makes at boot), or "" where it cannot be read."""
    try:
        return Path(_BOOT_ID_PATH).read_text().strip()[:64]
    except OSError:
        return ""


def proof_of(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 under ``token`` of a domain label and both nonces (each length-prefixed)."""
    mac = hmac.new(token, digestmod=hashlib.sha256)
    mac.update(_PROOF_LABEL)
    for nonce in (server_nonce, client_nonce):
        mac.update(len(nonce).to_bytes(8, "big"))
        mac.update(nonce)
    return mac.digest()


class HostToken:
    """A server's token file (made by the constructor, removed by :meth:`close`, or at exit at the latest):
    ``identity`` names it in a ``Challenge``, :meth:`verify` checks a client's proof. Raises ``OSError`` where no
    token file can be made."""

    def __init__(self, directory: str = TOKEN_DIRECTORY) -> None:
        self.path = os.path.join(directory, f"{TOKEN_PREFIX}{secrets.token_hex(16)}")
        self._token = secrets.token_bytes(TOKEN_BYTES)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(descriptor, self._token)
        finally:
            os.close(descriptor)
        self._remove = weakref.finalize(self, _remove_token, self.path)
        self.identity = HostIdentity(boot_id=local_boot_id(), token_path=self.path)

    def verify(self, proof: bytes, server_nonce: bytes, client_nonce: bytes) -> bool:
        """Whether ``proof`` is the one a reader of the token makes for these nonces."""
        return bool(proof) and hmac.compare_digest(proof_of(self._token, server_nonce, client_nonce), proof)

    def close(self) -> None:
        """Remove the token file (idempotent)."""
        self._remove()


def _remove_token(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove the host token %s: %s", path, error)


def host_proof(identity: HostIdentity, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, str]:
    """(proof, "") when this process is on the host ``identity`` names and can read its token; else (b"", why not)."""
    mine = local_boot_id()
    if not mine or identity.boot_id != mine:
        return b"", "another host (its boot id differs from ours)"
    token, why = _read_token(identity.token_path)
    if token is None:
        return b"", why
    return proof_of(token, server_nonce, client_nonce), ""


def _read_token(path: str) -> tuple[bytes | None, str]:
    """The token at ``path`` if it is a token file of ours (see the module's docstring), else (None, why not)."""
    directory, name = os.path.split(path)
    if directory != TOKEN_DIRECTORY or not _TOKEN_NAME.fullmatch(name):
        return None, "the host token path is not one pd-transfer makes"
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        return None, f"the host token cannot be opened ({error.strerror}): another user, or another /dev/shm"
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size != TOKEN_BYTES:
            return None, "the host token is not a 32-byte file of this user"
        token = os.read(descriptor, TOKEN_BYTES + 1)
    finally:
        os.close(descriptor)
    if len(token) != TOKEN_BYTES:
        return None, "the host token is not a 32-byte file of this user"
    return token, ""
