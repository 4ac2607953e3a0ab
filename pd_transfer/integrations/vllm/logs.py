"""Our log lines in a vLLM server's log: vLLM configures only its own loggers in the processes it starts."""

from __future__ import annotations

import logging
import os


def log_to_stderr() -> None:
    """Give the ``pd_transfer`` loggers a stderr handler (INFO and up, or ``PD_TRANSFER_LOG_LEVEL``), once per
    process; later calls do nothing."""
    package = logging.getLogger("pd_transfer")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pd-transfer %(name)s] %(message)s"))
        package.addHandler(handler)
        package.setLevel(os.environ.get("PD_TRANSFER_LOG_LEVEL", "INFO").upper())
        package.propagate = False
