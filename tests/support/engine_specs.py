"""The engines of the connector lifecycle tests: model fingerprints, cache layouts and the decode's settings, shared by
the process tests (prefill engines in a child process, real NIXL: tests/process/conftest.py) and the unit tests
(prefill engines in the test process, fake agents: tests/unit/conftest.py)."""

from __future__ import annotations

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import EngineSpec
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

FINGERPRINT = ModelFingerprint(
    model="lifecycle-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=4, head_size=16
)
ONE_HEAD = ModelFingerprint(
    model="lifecycle-llama-1h", dtype="bfloat16", num_layers=2, total_num_kv_heads=1, head_size=16
)
BLOCK = 16
SHORT_LEASE_S = 1.5


def kv_layout(
    fingerprint: ModelFingerprint, block_size: int = BLOCK, tp: int = 1, rank: int = 0, layout: str = "HND"
) -> KVCacheLayout:
    """One rank's layout of ``fingerprint``'s cache."""
    return KVCacheLayout(
        fingerprint=fingerprint,
        tp_size=tp,
        tp_rank=rank,
        block_size=block_size,
        layout=layout,  # type: ignore[arg-type]
    )


def layouts(fingerprint: ModelFingerprint, tp: int, block_size: int = BLOCK) -> list[KVCacheLayout]:
    return [KVCacheLayout(fingerprint=fingerprint, tp_size=tp, tp_rank=r, block_size=block_size) for r in range(tp)]


def decode_config(**overrides: object) -> ConnectorConfig:
    settings: dict[str, object] = {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 0,
        "handshake_timeout_s": 2.0,
        "confirm_timeout_s": 5.0,
        "read_timeout_s": 10.0,
    }
    settings.update(overrides)
    return ConnectorConfig.from_dict(settings, env={}, settings=DEFAULTS)


def prefill_specs() -> list[EngineSpec]:
    """``p1``: TP 1; ``p2``: TP 2; ``pshort``: TP 1 with a short lease; ``prep``: TP 2 of a one-KV-head model
    (both ranks hold the head: a TP 1 decode reads rank 0 only)."""
    return [
        EngineSpec(engine_id="p1", layouts=layouts(FINGERPRINT, 1), num_blocks=256, seed=11),
        EngineSpec(engine_id="p2", layouts=layouts(FINGERPRINT, 2), num_blocks=128, seed=12),
        EngineSpec(
            engine_id="pshort", layouts=layouts(FINGERPRINT, 1), num_blocks=64, seed=13, lease_seconds=SHORT_LEASE_S
        ),
        EngineSpec(engine_id="prep", layouts=layouts(ONE_HEAD, 2), num_blocks=32, seed=14),
    ]
