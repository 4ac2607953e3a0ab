"""The same-host proof asked before IPC handles are sent: a token file only this user on this host can read, a
proof that is an HMAC of both nonces under it, and a client that reads nothing but a token file of that shape."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_transfer.handshake.auth import new_nonce
from pd_transfer.handshake.host_identity import (
    TOKEN_DIRECTORY,
    TOKEN_PREFIX,
    HostToken,
    host_proof,
    local_boot_id,
)
from pd_transfer.handshake.messages import HostIdentity

pytestmark = pytest.mark.skipif(not Path(TOKEN_DIRECTORY).is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def token() -> Iterator[HostToken]:
    made = HostToken()
    try:
        yield made
    finally:
        made.close()


def test_the_token_file_is_private_to_this_user_and_removed_on_close(token: HostToken) -> None:
    info = os.stat(token.path)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid() and info.st_size == 32
    assert token.identity.boot_id == local_boot_id() != ""
    token.close()
    assert not os.path.exists(token.path)
    token.close()  # idempotent


def test_a_reader_on_this_host_proves_it_for_these_nonces_only(token: HostToken) -> None:
    server_nonce, client_nonce = new_nonce(), new_nonce()
    proof, why_not = host_proof(token.identity, server_nonce, client_nonce)
    assert why_not == "" and token.verify(proof, server_nonce, client_nonce)
    assert not token.verify(proof, new_nonce(), client_nonce)
    assert not token.verify(proof, server_nonce, new_nonce())
    assert not token.verify(b"", server_nonce, client_nonce)


def test_another_boot_id_sends_no_proof(token: HostToken) -> None:
    elsewhere = HostIdentity(boot_id="00000000-0000-4000-8000-000000000000", token_path=token.path)
    assert host_proof(elsewhere, new_nonce(), new_nonce()) == (b"", "another host (its boot id differs from ours)")


def test_a_gone_token_sends_no_proof(token: HostToken) -> None:
    token.close()
    proof, why_not = host_proof(token.identity, new_nonce(), new_nonce())
    assert proof == b"" and "cannot be opened" in why_not


@pytest.mark.parametrize("where", ["/etc/passwd", f"/tmp/{TOKEN_PREFIX}{'0' * 32}", f"{TOKEN_DIRECTORY}/other"])
def test_a_client_reads_no_path_but_a_token_file_s(where: str) -> None:
    named = HostIdentity(boot_id=local_boot_id(), token_path=where)
    assert host_proof(named, new_nonce(), new_nonce()) == (b"", "the host token path is not one pd-transfer makes")


def test_a_link_or_a_file_of_another_size_named_like_a_token_is_not_read(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 32)
    name = f"{TOKEN_DIRECTORY}/{TOKEN_PREFIX}{secrets.token_hex(16)}"
    os.symlink(target, name)
    try:
        proof, why_not = host_proof(HostIdentity(boot_id=local_boot_id(), token_path=name), new_nonce(), new_nonce())
        assert proof == b"" and "cannot be opened" in why_not
    finally:
        os.unlink(name)
    with open(name, "wb") as handle:
        handle.write(b"x" * 64)
    try:
        proof, why_not = host_proof(HostIdentity(boot_id=local_boot_id(), token_path=name), new_nonce(), new_nonce())
        assert proof == b"" and "32-byte file" in why_not
    finally:
        os.unlink(name)
