"""``bench offload --device cuda`` and ``bench topology --device cuda`` on the GPU: each verifies what it moved and
reports its ``gpu.`` ratios beside the device's name and copy rates (the ratios themselves are the benchmarks'
business, not asserted here). tests/process/test_bench_device.py runs the same flags on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU here"),
]

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("UCX_NET_DEVICES", "lo")
    command = [sys.executable, "-m", "pd_transfer.cli", "bench", *args, "--device", "cuda", "--quick", "--json"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def device_fields(gpu: dict) -> None:
    assert gpu["device"].startswith("cuda:") and gpu["name"] == torch.cuda.get_device_name(0)
    assert gpu["copy_gb_s"] > 0 and gpu["pinned_d2h_gb_s"] > 0 and gpu["pinned_h2d_gb_s"] > 0


def test_offload_on_cuda_against_a_pinned_copy() -> None:
    result = bench("offload")
    device_fields(result["gpu"])
    offload = result["gpu"]["offload"]
    assert offload["verified"] is True and offload["pool_pinned"] is True
    assert offload["store_ratio_vs_pinned_copy"] > 0 and offload["load_ratio_vs_pinned_copy"] > 0


def test_topology_on_cuda_against_the_device_copy() -> None:
    result = bench("topology")
    assert result["verified"] is True, result["verified_cases"]
    device_fields(result["gpu"])
    for case in ("homogeneous", "tp_2_to_1", "block_16_to_64"):
        assert result["gpu"]["topology"][case]["ratio_vs_device_copy"] > 0
