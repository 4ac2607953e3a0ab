"""``pd-transfer bench topology --device`` and ``bench offload --device`` on the CPU (the same logic as on a GPU, on
CPU tensors, small): each runs as a command, verifies what it moved and reports its ``gpu.`` keys beside the
device's name and copy rate; a CUDA device that is not here is refused with exit 2. tests/gpu/test_gpu_bench.py
runs them on a CUDA device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    command = [sys.executable, "-m", "pd_transfer.cli", "bench", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def device_fields(gpu: dict) -> None:
    assert gpu["device"] == "cpu" and isinstance(gpu["name"], str) and gpu["copy_gb_s"] > 0


def test_offload_device_cpu_reports_the_pinned_copy_ratios() -> None:
    run = bench("offload", "--device", "cpu", "--quick", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    gpu = result["gpu"]
    device_fields(gpu)
    offload = gpu["offload"]
    assert result["verified"] is True and offload["verified"] is True and offload["pool_pinned"] is False
    assert offload["store_ratio_vs_pinned_copy"] > 0 and offload["load_ratio_vs_pinned_copy"] > 0
    assert offload["job_bytes"] == result["shape"]["blocks"] * result["shape"]["num_tensors"] * 65536


def test_topology_device_cpu_reports_each_case_against_the_device_copy() -> None:
    run = bench("topology", "--device", "cpu", "--quick", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["verified"] is True
    gpu = result["gpu"]
    device_fields(gpu)
    for case in ("homogeneous", "tp_2_to_1", "block_16_to_64"):
        part = gpu["topology"][case]
        assert part["ratio_vs_device_copy"] > 0 and part["device_copy_bytes"] == part["bytes"] == result[case]["bytes"]
        assert part["gather_limit_bytes"] == part["bytes"]  # the same rows, gathered by one kernel over a flat view
        assert part["gather_limit_gbps"] > 0 and part["ratio_vs_gather_limit"] > 0
        ceiling = result["cma_ceiling"]  # CPU tensors: the same rows read by process_vm_readv, beside the pulls
        assert ceiling["verified"] is True and ceiling["bytes"] == result[case]["bytes"]
        assert ceiling[case]["gbps"] > 0 and ceiling[case]["ours_vs_ceiling"] > 0
    assert result["cma_ceiling"]["homogeneous"]["ratio_vs_homogeneous"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: --device cuda runs (tests/gpu)")
def test_a_cuda_device_that_is_not_here_is_refused() -> None:
    for which in ("offload", "topology"):
        run = bench(which, "--device", "cuda:0", "--quick", "--json", timeout_s=60.0)
        assert run.returncode == 2 and "has no CUDA device" in run.stderr and run.stdout == ""
