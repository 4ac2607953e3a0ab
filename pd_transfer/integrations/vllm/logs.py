"""Our log lines in a vLLM server's log: vLLM configures only its own loggers in the processes it starts."""

from __future__ import annotations

import logging


def log_to_stderr(level: str) -> None:
    """Give the ``pd_transfer`` loggers a stderr handler at ``level`` (``Settings.log_level``:
    ``PD_TRANSFER_LOG_LEVEL``, default INFO), once per process; later calls do nothing."""
    package = logging.getLogger("pd_transfer")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pd-transfer %(name)s] %(message)s"))
        package.addHandler(handler)
        package.setLevel(level)
        package.propagate = False
