"""Fingerprint comparison shared by the server (refusing) and the client (double-checking replies)."""

from __future__ import annotations

from pd_transfer.spec import ModelFingerprint


def fingerprint_fields_differing(a: ModelFingerprint, b: ModelFingerprint) -> list[str]:
    """Names of the fingerprint fields whose values differ, in declaration order."""
    return [field for field in a.__struct_fields__ if getattr(a, field) != getattr(b, field)]
