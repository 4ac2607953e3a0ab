"""What both halves of same-host IPC (:mod:`.exporting`, :mod:`.opening`) agree on: the error that refuses it, how a
shareable host buffer's memfd is named, and how a process names its pid namespace and its GPUs."""

from __future__ import annotations

import os
import re

import torch

from pd_transfer.transfer.errors import TransferError

#: A shareable host buffer's memfd is named this prefix and 32 random hex digits.
SHARED_NAME_PREFIX = "pd-transfer-kv-"
SHARED_NAME = re.compile(re.escape(SHARED_NAME_PREFIX) + r"[0-9a-f]{32}")


class IpcUnavailable(TransferError):
    """Same-host IPC cannot be used for this memory or this peer; the message says why."""


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where it cannot be read): equal in processes that share one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def device_uuid(index: int) -> str:
    """The UUID of this process's GPU ``index`` (as torch prints it), the same in every process that sees it."""
    return str(torch.cuda.get_device_properties(index).uuid)
