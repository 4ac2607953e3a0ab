"""Stand-in prefill and decode servers that move real KV, served over HTTP from the command line:
:mod:`pd_transfer.sim.http_standin`'s HTTP surface and ``kv_transfer_params`` flow, with a real KV cache, real NIXL
reads and a real ZMQ side channel. For tests and demos of the whole P/D path (proxy included) without a model, on one
host or across hosts.

- role ``prefill`` (:mod:`.kv_prefill`): a prompt with ``do_remote_decode`` gets blocks filled with the KV of its
  tokens (:mod:`.kv_model`), held under a lease for a decode; the answer carries the ``kv_transfer_params``.
- role ``decode`` (:mod:`.kv_decode`): the KV named by ``kv_transfer_params`` is pulled and compared with the KV of
  *its own* prompt. The completion's first word (streamed or not) is the transfer report as compact JSON, and
  non-streamed answers also carry it as ``kv_transfer``: ``{"bytes", "ms", "pull_ms", "verified", ...}``. A failed
  pull or a mismatch answers 500 naming it; malformed params 400.
- ``GET /control/kv``: the engine's state (blocks free and held, pulls, bytes moved, whether it drains).
- SIGTERM or SIGINT: a prefill drains (``SchedulerSide.drain``): ``/health`` and every new prompt are answered 503
  with ``X-PD-Draining: 1`` (our proxy sends the prompt to another prefill), the KV it holds stays readable until
  every lease ended (read, released or expired; at most the lease and a second), then it prints ``kv-standin
  drained {"held_at_start": N, "left": 0, "seconds": S}`` and exits 0. A decode stops at once.

``python -m pd_transfer.sim.kv_standin --role prefill|decode --port N --side-channel-host H
--side-channel-port N`` prints ``kv-standin ROLE URL`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import logging
import signal
import sys
import uuid
from typing import Any

import msgspec
from aiohttp import web

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.drain import Draining
from pd_transfer.connector.params import InvalidTransferParams
from pd_transfer.proxy.routing import DRAINING_HEADER
from pd_transfer.proxy.server import REQUEST_ID
from pd_transfer.settings import Settings, apply_process_defaults, read_settings
from pd_transfer.sim.http_standin import StandIn, error_response, json_response
from pd_transfer.sim.kv_decode import DecodeKV
from pd_transfer.sim.kv_model import KVModel, prompt_tokens
from pd_transfer.sim.kv_prefill import PrefillKV
from pd_transfer.transfer.digests import VERIFY_MODES

logger = logging.getLogger(__name__)

_STEP_S = 0.005  # the prefill engine's step: collects blocks freed by readers and expired leases
_REPORT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("kv_report", default=None)


class KVStandIn(StandIn):
    """A :class:`StandIn` whose prefill holds real KV and whose decode pulls and verifies it."""

    def __init__(self, role: str, engine: PrefillKV | DecodeKV, **kwargs: Any) -> None:
        super().__init__(role, **kwargs)
        self.engine = engine
        self.app.router.add_get("/control/kv", self._control_kv)
        self._stepper: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        url = await super().start(host, port)
        if isinstance(self.engine, PrefillKV):
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever(self.engine))
        return url

    async def stop(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
            self._stepper = None
        await super().stop()

    async def _step_forever(self, engine: PrefillKV) -> None:
        while True:
            try:
                engine.step()
            except Exception:
                logger.exception("kv-standin prefill: step failed")
            await asyncio.sleep(_STEP_S)

    async def _control_kv(self, _request: web.Request) -> web.Response:
        return json_response({"role": self.role, "engine_id": self.engine_id, **self.engine.state()})

    async def _health(self, request: web.Request) -> web.Response:
        if isinstance(self.engine, PrefillKV) and self.engine.scheduler.drain_state.draining:
            return web.Response(text="draining", status=503, headers={DRAINING_HEADER: "1"})
        return await super()._health(request)

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        if not isinstance(self.engine, DecodeKV):
            return await super()._serve(request, endpoint)
        rid = request.headers.get(REQUEST_ID, "")
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
            return await super()._serve(request, endpoint)  # refused there, or computed "locally"
        tokens = prompt_tokens(body)
        engine = self.engine
        try:
            remote = engine.parse(body["kv_transfer_params"], tokens)
        except InvalidTransferParams as error:
            return error_response(400, f"kv-standin decode: {error}", rid)
        engine.release_watched()
        blocks = engine.pool.take(-(-(remote.num_tokens or len(tokens)) // engine.layout.block_size))
        if blocks is None:
            return error_response(503, f"kv-standin decode: out of blocks ({engine.pool.free} free)", rid)
        rid = rid or uuid.uuid4().hex
        failed = False
        try:
            report = await asyncio.to_thread(engine.pull, rid, remote, tokens, blocks)
        except Exception as error:
            failed = True
            engine.failures += 1
            engine.failed(rid, blocks)  # given back, or watched for a late landing
            message = f"kv-standin decode: pulling the KV of {remote.engine_id} failed: {type(error).__name__}: {error}"
            logger.error("%s", message)
            return error_response(500, message, rid)
        finally:
            if not failed:
                engine.pool.give(blocks)
        engine.reports.append(report)
        del engine.reports[:-100]
        if not report["verified"]:
            engine.failures += 1
            return error_response(
                500,
                f"kv-standin decode: the KV pulled from {remote.engine_id} ({report['bytes']} bytes) is not the"
                " prompt's: verification failed",
                rid,
            )
        engine.pulls += 1
        engine.bytes_moved += report["bytes"]
        token = _REPORT.set(report)  # read by _word and _answer; reset: a connection's requests share a task
        try:
            return await super()._serve(request, endpoint)
        finally:
            _REPORT.reset(token)

    def _prefill_params(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(self.engine, PrefillKV)
        tokens = prompt_tokens(body)
        if not tokens:
            raise web.HTTPBadRequest(text="kv-standin prefill: empty prompt")
        try:
            return self.engine.prefill(f"{rid or 'req'}-{uuid.uuid4().hex[:8]}", tokens)
        except Draining as refusal:  # as vLLM with DrainMiddleware answers: the proxy sends it to another prefill
            error = {"error": {"message": str(refusal), "type": "draining", "code": 503}}
            raise web.HTTPServiceUnavailable(
                text=msgspec.json.encode(error).decode(),
                content_type="application/json",
                headers={DRAINING_HEADER: "1"},
            ) from None

    def _word(self, body: dict[str, Any], i: int) -> str:
        report = _REPORT.get()
        if report is None:
            return super()._word(body, i)
        return msgspec.json.encode(report).decode() if i == 0 else super()._word(body, i - 1)

    def _answer(self, chat: bool, body: dict[str, Any], rid: str, words: list[str], finish: str) -> dict[str, Any]:
        answer = super()._answer(chat, body, rid, words, finish)
        answer["kv_transfer"] = _REPORT.get()
        return answer


def make_engine(
    role: str,
    engine_id: str,
    model: KVModel,
    config: ConnectorConfig,
    *,
    hold_window: bool = False,
    watch_failed_s: float = 0.0,
    corrupt_every: int = 0,
    settings: Settings,
) -> PrefillKV | DecodeKV:
    if role == "prefill":
        return PrefillKV(engine_id, model, config, settings, corrupt_every=corrupt_every)
    return DecodeKV(engine_id, model, config, hold_window=hold_window, watch_failed_s=watch_failed_s, settings=settings)


async def _serve_forever(args: argparse.Namespace) -> None:
    model = KVModel(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
    )
    config = ConnectorConfig(
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        lease_seconds=args.lease_seconds,
        secret=args.secret,
        read_timeout_s=args.read_timeout,
        transport=args.transport,
        verify=args.verify,
    )
    engine_id = args.engine_id or f"kv-standin-{args.role}-{uuid.uuid4().hex[:8]}"
    settings = apply_process_defaults(read_settings())  # this process's edge: read once, before any agent
    engine = await asyncio.to_thread(
        make_engine,
        args.role,
        engine_id,
        model,
        config,
        hold_window=args.hold_window,
        watch_failed_s=args.watch_failed_blocks,
        corrupt_every=args.corrupt_every,
        settings=settings,
    )
    server = KVStandIn(args.role, engine, engine_id=engine_id, default_tokens=args.tokens, keep_bodies=False)
    try:
        await server.start(args.host, args.port)
        print(f"kv-standin {args.role} {server.url}", flush=True)
        await _until_signalled(engine)
        if isinstance(engine, PrefillKV):  # the server and its steps go on while the leases end
            outcome = await asyncio.to_thread(engine.scheduler.drain, "a stop signal")
            print(f"kv-standin drained {msgspec.json.encode(outcome).decode()}", flush=True)
    finally:
        await server.stop()
        engine.close()


async def _until_signalled(engine: PrefillKV | DecodeKV) -> None:
    """Returns at the first SIGINT or SIGTERM; a prefill refuses new prompts from that moment on (its drain)."""
    stop = asyncio.Event()

    def on_signal(name: str) -> None:
        if isinstance(engine, PrefillKV):
            engine.scheduler.drain_state.start(f"received {name}")
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd_transfer.sim.kv_standin", description=__doc__.split("\n")[0])
    defaults = KVModel()
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default 0: a free port)")
    parser.add_argument(
        "--side-channel-host", default="127.0.0.1", help="prefill: side channel address, bound and advertised"
    )
    parser.add_argument("--side-channel-port", type=int, default=0, help="prefill: side channel port (0: free)")
    parser.add_argument("--engine-id", default="")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-size", type=int, default=defaults.head_size)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    parser.add_argument("--read-timeout", type=float, default=30.0, help="decode: seconds for one request's reads")
    parser.add_argument("--secret", default=None, help="shared secret of the side channel")
    parser.add_argument(
        "--hold-window",
        action="store_true",
        help="decode: a read that ends inside the prefill's hold window needs no lease confirmation (as in vLLM)",
    )
    parser.add_argument(
        "--transport",
        default="auto",
        help="the connector's transport setting (decode: the transports it opens prefills with, in order; prefill:"
        " those it offers): auto (same-host IPC where offered, else NIXL), nixl (as between hosts), ipc, or names,"
        " one of them module:attribute of a transport of your own",
    )
    parser.add_argument(
        "--watch-failed-blocks",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="decode: keep a failed pull's blocks from reuse this long, a canary in them, and count those written into"
        " meanwhile (late_landings in /control/kv; default 0: given back at once)",
    )
    parser.add_argument(
        "--corrupt-every",
        type=int,
        default=0,
        metavar="N",
        help="prefill: change one byte of every Nth request's KV once it is held (a fault for digests to catch;"
        " counted as corrupted in /control/kv; default 0: none)",
    )
    parser.add_argument(
        "--verify", choices=VERIFY_MODES, default="sample", help="decode: which rows' digests it checks (sample)"
    )
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens when the request sets none")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from pd_transfer.proxy.cli import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
