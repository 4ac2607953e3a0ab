"""Fingerprint comparison shared by the server (refusing) and the client (double-checking replies), and the
fingerprint's short name for ``pd_transfer_info``."""

from __future__ import annotations

import hashlib

import msgspec

from pd_transfer.spec import ModelFingerprint


def fingerprint_fields_differing(a: ModelFingerprint, b: ModelFingerprint) -> list[str]:
    """Names of the fingerprint fields whose values differ, in declaration order."""
    return [field for field in a.__struct_fields__ if getattr(a, field) != getattr(b, field)]


def fingerprint_digest(fingerprint: ModelFingerprint) -> str:
    """A short stable name of a fingerprint: 16 hex digits of BLAKE2b over its msgpack encoding."""
    return hashlib.blake2b(msgspec.msgpack.encode(fingerprint), digest_size=8).hexdigest()


def info_labels(fingerprint: ModelFingerprint, protocol_version: int) -> dict[str, str]:
    """The labels of ``pd_transfer_info`` for a process serving or reading ``fingerprint``."""
    return {
        "protocol_version": str(protocol_version),
        "fingerprint": fingerprint_digest(fingerprint),
        "model": fingerprint.model[-200:],
        "dtype": fingerprint.dtype,
    }
