"""``pd-transfer bench offload --end-to-end`` without vLLM: its flags parse, a setup name that is unknown is refused
(exit 2, naming it), the sizing and the saved results. Against interpreters it runs:
tests/process/test_bench_offload_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_transfer.bench.offload import end_to_end, end_to_end_sizing, tiers
from pd_transfer.cli import build_parser


def test_flags_parse() -> None:
    argv = "bench offload --end-to-end --json --output out.json --repeats 3 --setups recompute,pd_host --python py"
    args = build_parser().parse_args(argv.split())
    assert args.end_to_end and args.json and args.output == Path("out.json") and args.repeats == 3
    settings = end_to_end._settings(args)
    assert settings.setups == ("recompute", "pd_host") and settings.python == "py" and settings.repeats == 3
    assert settings.note == "" and build_parser().parse_args([*argv.split(), "--note", "3 rounds"]).note == "3 rounds"
    assert not build_parser().parse_args(["bench", "offload"]).end_to_end


def test_refuses_unknown_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert tiers.main(["--end-to-end", "--setups", "pd_host,nope"]) == 2
    assert "unknown setups ['nope']" in capsys.readouterr().err


def test_save_keeps_each_model_and_heads_with_the_largest_kv(tmp_path: Path) -> None:
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({"host": {"x": 1}, "end_to_end": None, "end_to_end_note": "to come"}))
    small = {"model": "tiny", "kv_bytes_per_token": 4096, "verified": True}
    large = {"model": "kv8b", "kv_bytes_per_token": 262144, "verified": False}
    end_to_end_sizing.save_result(path, large)
    end_to_end_sizing.save_result(path, small)  # saved later, yet the larger KV stays the headline
    assert json.loads(path.read_text()) == {
        "host": {"x": 1},
        "end_to_end": large,
        "end_to_end_by_model": {"kv8b": large, "tiny": small},
    }
    again = small | {"verified": False}
    end_to_end_sizing.save_result(path, again)  # a model's new run replaces its old one
    assert json.loads(path.read_text())["end_to_end_by_model"]["tiny"] == again


def _config(tmp_path: Path, **fields: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


def test_sizing_follows_the_kv_bytes_per_token(tmp_path: Path) -> None:
    kv8b = _config(tmp_path, num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                   hidden_size=256, max_position_embeddings=8192)  # fmt: skip
    size = end_to_end_sizing.sizing_for(kv8b)
    assert size.kv_bytes_per_token == 256 * 1024 and size.block_bytes == 32 * 2**20
    assert size.prefix_blocks == 11 and size.prefix_bytes == 352 * 2**20
    assert size.host_bytes >= 2 * size.prefix_bytes and size.vllm_cpu_bytes == size.host_bytes
    assert size.dir_bytes >= 3 * size.prefix_bytes
    assert size.kv_cache_bytes >= size.max_model_len * size.kv_bytes_per_token
    assert size.as_json()["prefix_bytes"] == size.prefix_bytes


def test_sizing_of_a_small_model_keeps_the_floors(tmp_path: Path) -> None:
    # head_dim and num_key_value_heads left out: hidden / heads and the attention heads
    tiny = _config(tmp_path, num_hidden_layers=4, num_attention_heads=4, hidden_size=256)
    size = end_to_end_sizing.sizing_for(tiny)
    assert size.kv_bytes_per_token == 2 * 4 * 4 * 64 * 4
    assert (size.host_bytes, size.dir_bytes, size.kv_cache_bytes) == (64 * 2**20, 256 * 2**20, 64 * 2**20)


@pytest.mark.parametrize(
    "fields",
    [{}, {"num_hidden_layers": 4, "num_attention_heads": 0, "hidden_size": 256},
     {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256, "max_position_embeddings": 1024},
     {"num_hidden_layers": "x", "num_attention_heads": 4, "hidden_size": 256}],
)  # fmt: skip
def test_sizing_refuses_an_unusable_config(tmp_path: Path, fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        end_to_end_sizing.sizing_for(_config(tmp_path, **fields))
    with pytest.raises(ValueError, match="cannot read"):
        end_to_end_sizing.sizing_for(tmp_path / "absent")


def test_a_yardstick_refusing_to_start_is_recorded_not_failed() -> None:
    refused = {"error": "refused to start: NotImplementedError: no CPU offloading", "refused_to_start": True}
    ran = {"rounds": []}
    setups = {"recompute": ran, "pd_host": ran, "vllm_offloading": refused, "vllm_example": ran}
    assert end_to_end.exit_code({"setups": setups, "verified": True}) == 0
    assert end_to_end.exit_code({"setups": setups, "verified": False}) == 1
    assert end_to_end.exit_code({"setups": {**setups, "pd_host": refused}, "verified": True}) == 1  # ours: a failure
    broke = {"error": "failed while serving: timed out"}
    assert end_to_end.exit_code({"setups": {**setups, "vllm_example": broke}, "verified": True}) == 1


def test_the_page_cache_state_before_b_is_recorded_and_a_cold_setup_drops_its_files(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "k.kvgroup").write_bytes(b"x" * 65536)
    (tmp_path / "ab" / ".k.kvgroup.1.tmp").write_bytes(b"x" * 4096)  # a temporary file: not counted
    assert end_to_end._page_cache(tmp_path, drop=False)() == {"files": 1, "resident_fraction": 1.0}
    cold = end_to_end._page_cache(tmp_path, drop=True)()
    assert cold["files"] == 1 and cold["resident_fraction"] in (0.0, 1.0)  # 1.0 only where the cache keeps files


def test_the_directory_goal_is_judged_against_vllms_own_hit_and_only_warm() -> None:
    def row(median: float, resident: float | None = None) -> dict:
        cached = {"page_cache": {"resident_fraction_before_b": {"min": resident, "max": resident}}}
        return {"ttft_ms": {"median": median}, "x_local_hit": median / 30} | (cached if resident is not None else {})

    rows = {"local_hit": row(30.0), "pd_disk": row(35.0, 1.0), "pd_disk_cold": row(60.0, 0.0)}
    verdict = end_to_end._disk_verdict(rows)
    assert verdict["disk_hit_ratio_vs_local_hit"] == 1.167 and verdict["disk_goal_met"] is True
    assert verdict["disk_cold_hit_ratio_vs_local_hit"] == 2.0 and verdict["disk_cold_hit_x_own_local_hit"] == 2.0
    assert verdict["disk_page_cache"] == {"pd_disk_resident_min": 1.0, "pd_disk_cold_resident_max": 0.0}
    assert end_to_end._disk_verdict({**rows, "pd_disk": row(35.0, 0.5)})["disk_goal_met"] is False  # not warm
    assert end_to_end._disk_verdict({**rows, "pd_disk": row(37.0, 1.0)})["disk_goal_met"] is False  # 1.233
    assert end_to_end._disk_verdict({"pd_disk": row(35.0, 1.0)})["disk_hit_ratio_vs_local_hit"] is None
