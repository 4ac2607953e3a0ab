"""pd-transfer installs into the environment of every supported vLLM (its GPU build) without replacing its torch or
numpy: our requirements, parsed from pyproject.toml, admit what each vLLM GPU wheel's metadata pins.

Each wheel's ``METADATA`` (about 11 KiB) is read out of the wheel with range requests, checked against the pinned
digests and cached outside the repo by ``tests/support/wheel_files.py`` (as ``test_vllm_api.py`` reads vLLM's
sources; the index here serves no PEP 658 ``.metadata`` files). vLLM requires numpy unversioned: what bounds it in
a vLLM environment is vLLM's pin of numba (0.65.0: ``numpy>=1.22,<2.5``), read the same way, and the newest numpy
release within both is the one a fresh vLLM environment gets (the index's release list, read each time). Without
the network and a cache the tests skip, saying so.
"""

from __future__ import annotations

import tomllib
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from wheel_files import WheelFile, fetch_member, release_versions

REPO = Path(__file__).resolve().parents[2]
#: vLLM's GPU wheels (x86-64 Linux); the wheels' digests are the index's, the members' were taken from them
VLLM_METADATA = {
    "0.31.0": WheelFile(
        "vllm",
        "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "39132b433967f0962d03d8a5f633b9bee6b32708f566c7d5637b79f8d0ef3433",
        "vllm-0.31.0.dist-info/METADATA",
        "a9d740caaeff8f0490b2223fe513c555b237e80fa6f8a839f14aa882d7712669",
    ),
    "0.32.0": WheelFile(
        "vllm",
        "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611",
        "vllm-0.32.0.dist-info/METADATA",
        "57db31597e39dc181de07b7b9b0838a9ea59392bf619366edbf08e6ecf03e07b",
    ),
    "0.33.0": WheelFile(
        "vllm",
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        "vllm-0.33.0.dist-info/METADATA",
        "e515819ea051d8c6edd153cbb0d357ad75d6e300fdcf36f1966dc2c96ae935a8",
    ),
}
#: the numba releases the vLLM wheels above pin (numba bounds numpy in their environments)
NUMBA_METADATA = {
    "0.65.0": WheelFile(
        "numba",
        "numba-0.65.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "032b0b8e879512cd424d79eed6d772a1399c6387ded184c2cf3cc22c08d750a6",
        "numba-0.65.0.dist-info/METADATA",
        "6d2ac1e12118ab19d78369884d9e1c32b147db6b532fc1d8f6c0eef9d888fea6",
    ),
}
#: the platform of the GPU wheels, to evaluate their requirements' markers
PLATFORM = {
    "extra": "",
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def ours() -> dict[str, Requirement]:
    """pyproject.toml's dependencies (the base install, no extra), by canonical name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(req.name): req for req in map(Requirement, project["dependencies"])}


def requirements(file: WheelFile, what: str) -> dict[str, list[Requirement]]:
    """The wheel's unconditional requirements (no extra; markers on x86-64 Linux, Python 3.11), by canonical name;
    skips when its metadata is neither cached nor downloadable."""
    try:
        text = fetch_member(file).decode()
    except OSError as error:
        pytest.skip(f"{what}'s METADATA is neither cached nor downloadable: {error}")
    found: dict[str, list[Requirement]] = {}
    for line in HeaderParser().parsestr(text).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(PLATFORM):
            found.setdefault(canonicalize_name(req.name), []).append(req)
    return found


def pins(reqs: list[Requirement]) -> list[Version]:
    """The versions ``==`` specifiers of ``reqs`` pin."""
    return [Version(spec.version) for req in reqs for spec in req.specifier if spec.operator == "=="]


def joined(reqs: list[Requirement]) -> SpecifierSet:
    """What all of ``reqs`` admit together."""
    together = SpecifierSet()
    for req in reqs:
        together &= req.specifier
    return together


@pytest.mark.parametrize("version", VLLM_METADATA)
def test_our_torch_range_admits_the_torch_each_vllm_gpu_wheel_pins(version: str) -> None:
    theirs = requirements(VLLM_METADATA[version], f"vLLM {version}")["torch"]
    pinned = pins(theirs)
    mine = ours()["torch"]
    print(f"\nvLLM {version}: {', '.join(map(str, theirs))}; ours: {mine}")
    assert pinned, f"vLLM {version} no longer pins torch ({theirs}): check that our range still admits what it takes"
    assert not any(spec.operator == "==" for spec in mine.specifier), f"ours pins torch: {mine}"
    refused = [str(pin) for pin in pinned if not mine.specifier.contains(pin)]
    assert not refused, f"our {mine} would replace vLLM {version}'s torch {refused}"


@pytest.mark.parametrize("version", VLLM_METADATA)
def test_our_numpy_range_admits_the_numpy_of_a_fresh_vllm_environment(version: str) -> None:
    vllm = requirements(VLLM_METADATA[version], f"vLLM {version}")
    numba_pins = [str(pin) for pin in pins(vllm["numba"])]
    assert len(numba_pins) == 1 and numba_pins[0] in NUMBA_METADATA, (
        f"vLLM {version} pins numba {numba_pins}: add its METADATA to NUMBA_METADATA"
    )
    numba = requirements(NUMBA_METADATA[numba_pins[0]], f"numba {numba_pins[0]}")
    bound = joined(vllm["numpy"] + numba["numpy"])
    try:
        releases = [Version(v) for v in release_versions("numpy")]
    except OSError as error:
        pytest.skip(f"numpy's release list is not downloadable: {error}")
    newest = max(bound.filter(releases))
    mine = ours()["numpy"]
    print(f"\nvLLM {version}: numpy{bound} (numba {numba_pins[0]}), newest {newest}; ours: {mine}")
    assert mine.specifier.contains(newest), f"our {mine} would replace numpy {newest} in a fresh vLLM {version}"


@pytest.mark.parametrize("version", VLLM_METADATA)
def test_our_ranges_start_within_what_vllm_requires_of_the_same_packages(version: str) -> None:
    """Where vLLM requires a package we require too without pinning it (pyzmq, msgspec, prometheus-client, numpy), the
    oldest version our range admits satisfies vLLM's requirement, so nothing our range admits is older than vLLM
    takes (torch, which vLLM pins, is the first test's)."""
    vllm = requirements(VLLM_METADATA[version], f"vLLM {version}")
    shared = {name: req for name, req in ours().items() if name in vllm and not pins(vllm[name])}
    assert {"numpy", "pyzmq", "msgspec", "prometheus-client"} <= set(shared)
    refused = []
    for name, req in sorted(shared.items()):
        oldest = [Version(spec.version) for spec in req.specifier if spec.operator == ">="]
        if len(oldest) != 1 or not joined(vllm[name]).contains(oldest[0]):
            refused.append(f"{req} against vLLM's {', '.join(map(str, vllm[name]))}")
    print(f"\nvLLM {version} requires {sorted(shared)} as we do, unpinned")
    assert not refused, f"vLLM {version} refuses the start of our ranges: {refused}"
