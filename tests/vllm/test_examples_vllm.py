"""examples/client.py through the real proxy in front of real vLLM servers started elsewhere
(``PD_TRANSFER_VLLM_URLS``; ``python tests/vllm/vllm_servers.py MODEL`` starts them and prints the line): the KV of the
client's prompts really moved. The other examples: tests/process/test_examples.py."""

from __future__ import annotations

import os
import re

import pytest
from test_examples import proxy_in_front_of, run_client


def test_client_against_real_vllm_servers() -> None:
    """With ``PD_TRANSFER_VLLM_URLS`` (tests/vllm/vllm_servers.py): the KV of the client's prompts really moved."""
    reuse = os.environ.get("PD_TRANSFER_VLLM_URLS")
    if not reuse:
        pytest.skip("PD_TRANSFER_VLLM_URLS is not set (python tests/vllm/vllm_servers.py MODEL starts the servers)")
    pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
    urls = dict(item.split("=", 1) for item in reuse.split(","))
    with proxy_in_front_of([urls["prefill"]], [urls["decode"]]) as proxy:
        result = run_client("--proxy", proxy, "--decode-metrics", urls["decode"], timeout_s=600)
    assert result.returncode == 0, result.stdout + result.stderr
    moved = re.search(r"external_kv_transfer \+(\d+)", result.stdout)
    assert moved and int(moved[1]) > 0, result.stdout
