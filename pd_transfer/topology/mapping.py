"""Which prefill (remote) ranks a decode (local) rank reads which KV heads from.

Head assignment (see :class:`~pd_transfer.spec.KVCacheLayout`): with ``H`` KV heads and TP size
``tp``, rank ``r`` holds heads ``[r * H/tp, (r + 1) * H/tp)`` when ``tp <= H`` (``H % tp == 0``), and the single
head ``r // (tp/H)`` when ``tp > H`` (``tp % H == 0``, heads replicated ``tp/H`` times). With MLA every rank
holds the same single latent "head".

Read rule: a decode rank reads every distinct head it holds exactly once. When several prefill ranks hold
that head (replicated, ``Tp > H``), decode rank ``d`` reads it from ``candidates[d % len(candidates)]``
(candidates ascending), which spreads decode ranks that share a head over its replicas. Consecutive heads
read from the same prefill rank form one :class:`HeadSource`. MLA: decode rank ``d`` reads prefill rank
``d % Tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.spec import KVCacheLayout, ModelFingerprint


class TopologyError(ValueError):
    """A decode rank cannot read from a prefill engine: incompatible model facts or parallelism."""


@dataclass(frozen=True, slots=True)
class HeadSource:
    """Global KV heads ``[first_global_head, first_global_head + num_heads)`` read from ``remote_rank``."""

    remote_rank: int
    first_global_head: int
    num_heads: int


# Fingerprint fields that decide the bytes of a KV cache; the model name is the handshake's concern.
_GEOMETRY_FIELDS = ("dtype", "num_layers", "total_num_kv_heads", "head_size", "use_mla")


def tp_problem(fingerprint: ModelFingerprint, tp_size: int, side: str) -> str | None:
    """Why ``tp_size`` cannot split ``fingerprint``'s KV heads (``None`` if it can); ``side`` names the engine."""
    if tp_size < 1:
        return f"{side} TP size {tp_size} must be at least 1"
    if fingerprint.use_mla:
        return None
    heads = fingerprint.total_num_kv_heads
    if heads < 1:
        return f"{heads} KV heads: a model needs at least 1"
    if heads % tp_size and tp_size % heads:
        return f"{side} TP size {tp_size} does not divide {heads} KV heads and is not a multiple of {heads} either"
    return None


def _layout_problems(layout: KVCacheLayout, side: str) -> list[str]:
    problems = []
    tp = tp_problem(layout.fingerprint, layout.tp_size, side)
    if tp:
        problems.append(tp)
    if not 0 <= layout.tp_rank < max(layout.tp_size, 1):
        problems.append(f"{side} TP rank {layout.tp_rank} is outside TP size {layout.tp_size}")
    if layout.block_size < 1:
        problems.append(f"{side} block size {layout.block_size} must be at least 1 token")
    if layout.fingerprint.head_size < 1:
        problems.append(f"{side} head size {layout.fingerprint.head_size} must be at least 1")
    if layout.layout not in ("HND", "NHD"):
        problems.append(f"{side} KV layout {layout.layout!r} is neither 'HND' nor 'NHD'")
    try:
        layout.element_size  # noqa: B018 - raises on an unknown dtype
    except ValueError as exc:
        problems.append(f"{side}: {exc}")
    return problems


def check_compatible(local: KVCacheLayout, remote: KVCacheLayout) -> None:
    """Raise :class:`TopologyError` naming every reason decode ``local`` cannot read prefill ``remote``."""
    problems = _layout_problems(local, "decode") + _layout_problems(remote, "prefill")
    mine, theirs = local.fingerprint, remote.fingerprint
    for field in _GEOMETRY_FIELDS:
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            problems.append(f"{field} differs: decode {a!r} != prefill {b!r}")
    if local.packing != remote.packing:
        problems.append(f"block packing differs: decode {local.packing!r} != prefill {remote.packing!r}")
    nd, np_ = local.block_size, remote.block_size
    if nd >= 1 and np_ >= 1 and nd % np_ and np_ % nd:
        problems.append(
            f"block sizes do not nest: decode {nd} tokens and prefill {np_} tokens (one must divide the other)"
        )
    if problems:
        raise TopologyError("; ".join(problems))


def holders(fingerprint: ModelFingerprint, tp_size: int, head: int) -> range:
    """The ranks of a ``tp_size`` engine that hold global KV ``head`` (every rank for MLA)."""
    if fingerprint.use_mla:
        return range(tp_size)
    heads = fingerprint.total_num_kv_heads
    if not 0 <= head < heads:
        raise TopologyError(f"KV head {head} is outside the model's {heads} KV heads")
    if tp_size <= heads:
        rank = head // (heads // tp_size)
        return range(rank, rank + 1)
    copies = tp_size // heads
    return range(head * copies, (head + 1) * copies)


def head_sources(local: KVCacheLayout, remote_tp_size: int) -> list[HeadSource]:
    """Where decode rank ``local`` reads its heads from a prefill engine of ``remote_tp_size`` ranks.

    Returned in ascending head order; their heads partition the local rank's heads exactly.
    """
    problems = _layout_problems(local, "decode")
    tp = tp_problem(local.fingerprint, remote_tp_size, "prefill")
    if tp:
        problems.append(tp)
    if problems:
        raise TopologyError("; ".join(problems))
    if local.fingerprint.use_mla:
        return [HeadSource(local.tp_rank % remote_tp_size, 0, 1)]
    sources: list[HeadSource] = []
    first = local.first_global_head
    for head in range(first, first + local.num_local_heads):
        candidates = holders(local.fingerprint, remote_tp_size, head)
        rank = candidates[local.tp_rank % len(candidates)]
        last = sources[-1] if sources else None
        if last is not None and last.remote_rank == rank and last.first_global_head + last.num_heads == head:
            sources[-1] = HeadSource(rank, last.first_global_head, last.num_heads + 1)
        else:
            sources.append(HeadSource(rank, head, 1))
    return sources


def expected_readers(remote_rank: int, remote_layout: KVCacheLayout, local_tp_size: int) -> int:
    """How many decode ranks of a ``local_tp_size`` engine read from prefill rank ``remote_rank``.

    ``remote_layout`` is any rank's layout of the prefill engine (its fingerprint, TP size and block size
    are used; its ``tp_rank`` is not). May be 0 (replicated heads or MLA with more prefill than decode
    ranks): that prefill rank is never read and can free a request's blocks at once.
    """
    tp = remote_layout.tp_size
    if not 0 <= remote_rank < tp:
        raise TopologyError(f"prefill rank {remote_rank} is outside prefill TP size {tp}")
    problem = tp_problem(remote_layout.fingerprint, local_tp_size, "decode")
    if problem:
        raise TopologyError(problem)
    count = 0
    for rank in range(local_tp_size):
        local = KVCacheLayout(
            fingerprint=remote_layout.fingerprint,
            tp_size=local_tp_size,
            tp_rank=rank,
            block_size=remote_layout.block_size,
            layout=remote_layout.layout,
        )
        if any(source.remote_rank == remote_rank for source in head_sources(local, tp)):
            count += 1
    return count
