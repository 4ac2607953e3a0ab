"""vLLM loading our connectors through ``kv_connector_module_path``, as a server does, under another version.

Each case runs in a fresh interpreter of the vLLM venv: it sets ``vllm.__version__`` (a version vLLM could report),
then asks vLLM's own ``KVConnectorFactory`` for the connector class, which imports ``pd_transfer.integrations.vllm``.
An unsupported version must be refused right there, by our ``UnsupportedVllmVersion`` naming the supported range;
the running version must load both connectors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_servers import vllm_missing

from pd_transfer.integrations.vllm_versions import SUPPORTED_RANGE

_MISSING = vllm_missing()
pytestmark = [pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

#: loads both connectors the way a vLLM server does and prints what happened as JSON; argv: the version (or "")
LOAD = """
import json, sys
import vllm
if sys.argv[1]:
    vllm.__version__ = sys.argv[1]
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

config = KVTransferConfig(
    kv_connector="PdTransferConnector", kv_connector_module_path="pd_transfer.integrations.vllm", kv_role="kv_both"
)
try:
    loaded = [KVConnectorFactory.get_connector_class(config).__name__]
    config.kv_connector = "PdOffloadConnector"
    loaded.append(KVConnectorFactory.get_connector_class(config).__name__)
except Exception as error:
    print(json.dumps({"raised": type(error).__name__, "message": str(error)}))
else:
    print(json.dumps({"loaded": loaded, "version": vllm.__version__}))
"""


def _load(version: str) -> dict[str, object]:
    """What loading the connectors under vLLM ``version`` ("" for the installed one) did, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD, version], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.smoke
@pytest.mark.parametrize("version", ["0.30.0", "0.33.0"])
def test_an_unsupported_version_is_refused_on_load(version: str) -> None:
    outcome = _load(version)
    print(f"\nvLLM {version}: {outcome}")
    assert outcome.get("raised") == "UnsupportedVllmVersion", outcome
    message = str(outcome["message"])
    assert SUPPORTED_RANGE in message and repr(version) in message, outcome


@pytest.mark.smoke
def test_the_installed_version_loads_both_connectors() -> None:
    outcome = _load("")
    assert outcome.get("loaded") == ["PdTransferConnector", "PdOffloadConnector"], outcome
