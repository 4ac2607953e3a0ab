"""The ``tcp`` transport's decode side of a streamed request (issue 41; the prefill's side: :mod:`.stream_sender`):
learn the request's blocks from each source rank (``watch``), cut the plan's rows into a group per layer, and have
each group sent as soon as the prefill wrote that layer (``stream``); the request is in the cache once every source
said ``end``.

The plan's rows are ordered by plane, then token, then head, and planes by (layer, kind) on both sides
(:func:`pd_transfer.spec.planes_of`): a layer's rows are the planes of that layer, one run of rows; merged into
entries within it (rows adjacent on a side), never across two layers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pd_transfer.spec import planes_of
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer.cma import merged_rows
from pd_transfer.transfer.digests import groups_to_verify, next_turn
from pd_transfer.transfer.errors import TransferError

from ..requests import ReadTotals, StreamRequest
from ..seam import DecodeSite, Source
from .connection import Pending, TcpConnection, digest_checks_counted


def stream_request(
    site: DecodeSite,
    plans: Sequence[SourcePlan],
    connections: Sequence[TcpConnection],
    sources: Sequence[Source],
    request: StreamRequest,
    deadline: float,
) -> tuple[ReadTotals, list[list[float]]]:
    """Stream ``request`` from the source ranks of ``plans`` (their ``connections``; rows straight into place, no
    fix-up after), tell ``sources`` it was read; returns its totals and when each source's layers arrived
    (``perf_counter`` times). The request must be computing or held by ``deadline``; from then on the stream lasts
    as long as it moves: each layer, and the end after the last, within the same span (``deadline`` less the start)
    of the one before (a prompt that takes the prefill longer than the span to compute still streams). Raises as
    :meth:`~..seam.StreamingLink.stream` says."""
    started = time.perf_counter()
    span_s = max(0.0, deadline - started)
    watches = [connection.watch(request.request_id, _left(deadline)) for connection in connections]
    blocks: list[tuple[list[int], int, str]] = []
    for connection, watch in zip(connections, watches, strict=True):
        connection.wait(watch, deadline)
        assert watch.blocks is not None
        blocks.append(watch.blocks)
    request_id = blocks[0][2]  # the prefill's id of it (the request was asked for by its stream id, maybe)
    if any(named != request_id for _, _, named in blocks):
        raise TransferError(f"the source ranks name request {request.request_id} differently")
    layer_of_plane = _layer_ordinals(site)
    cut = [
        _layer_groups(plan, remote_ids[request.skip_blocks :], request, layer_of_plane)
        for plan, (remote_ids, _, _) in zip(plans, blocks, strict=True)
    ]  # every source's first: block ids that do not fit the plan raise before anything moves
    posted = time.perf_counter()
    verify = site.options.verify
    streams = [
        connection.stream(
            request_id, generation, local, remote, layers, span_s, groups_to_verify(verify, len(layers), next_turn())
        )
        for connection, (_, generation, _), (local, remote, layers) in zip(connections, blocks, cut, strict=True)
    ]
    with digest_checks_counted(site.metrics, streams):
        for connection, stream in zip(connections, streams, strict=True):
            _wait_moving(connection, stream, posted, span_s)
    read = time.perf_counter()
    site.tell_read(sources, request_id)
    done = time.perf_counter()
    totals = ReadTotals(
        bytes=sum(stream.nbytes for stream in streams),
        descriptors=sum(sum(len(group) for group in local) for local, _, _ in cut),
        read_seconds=read - started,
        postprocess_seconds=0.0,
        postprocess_exposed_seconds=0.0,
        layers_streamed=sum(len(stream.arrived) for stream in streams),
        last_layer_seconds=done - max((stream.arrived[-1] for stream in streams if stream.arrived), default=read),
        streamed_as=request_id,
    )
    return totals, [stream.arrived for stream in streams]


def _wait_moving(connection: TcpConnection, stream: Pending, posted: float, span_s: float) -> None:
    """Until ``stream`` ended, as :meth:`TcpConnection.wait`, its deadline ``span_s`` after its last layer arrived
    (after ``posted`` before the first): past it with nothing arrived, the connection is dropped and the wait
    raises."""
    while True:
        last = stream.arrived[-1] if stream.arrived else posted
        if stream.done.wait(max(0.0, last + span_s - time.perf_counter())):
            break
        if (stream.arrived[-1] if stream.arrived else posted) == last:  # nothing came within the span
            break
    connection.wait(stream, last + span_s)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.perf_counter())


def _layer_ordinals(site: DecodeSite) -> list[int]:
    """For each plane of the cache (in plan order), the index of its layer among the cache's layers."""
    planes = planes_of(list(site.cache.regions))
    layers = sorted({plane.layer for plane in planes})
    return [layers.index(plane.layer) for plane in planes]


def _layer_groups(
    plan: SourcePlan, remote_ids: list[int], request: StreamRequest, layer_of_plane: list[int]
) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """(local entries, remote entries, layer) of each layer's rows of ``request`` from ``plan``'s source."""
    local, remote = plan.addresses(remote_ids, request.local_block_ids, request.num_tokens)
    if plan.num_planes != len(layer_of_plane):
        raise TransferError(f"a plan of {plan.num_planes} planes for a cache of {len(layer_of_plane)}")
    per_plane = len(local) // plan.num_planes
    groups: tuple[list[np.ndarray], list[np.ndarray], list[int]] = ([], [], [])
    first = 0
    for plane in range(1, plan.num_planes + 1):
        if plane < plan.num_planes and layer_of_plane[plane] == layer_of_plane[first]:
            continue
        rows = slice(first * per_plane, plane * per_plane)
        groups[0].append(merged_rows(local[rows], plan.unit_bytes))
        groups[1].append(merged_rows(remote[rows], plan.unit_bytes))
        groups[2].append(layer_of_plane[first])
        first = plane
    return groups
