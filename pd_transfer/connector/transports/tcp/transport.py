"""The built-in ``tcp`` transport (a :class:`~..seam.Transport`): for host caches on hosts without RDMA, where UCX's
TCP path moves scattered rows at a fraction of the wire (docs/benchmarks.md). Its ends: :mod:`.prefill_end` and
:mod:`.decode_end`; its connection: :mod:`.frames`. No NIXL peer and no NIXL read: the lease protocol's messages go
over its connections too."""

from __future__ import annotations

from dataclasses import dataclass

from ..seam import DecodeSite, PrefillSite
from .decode_end import NAME, TcpDecodeEnd
from .prefill_end import TcpPrefillEnd


@dataclass(frozen=True)
class TcpTransport:
    name: str = NAME
    same_host: bool = False

    def prefill_end(self, site: PrefillSite) -> TcpPrefillEnd:
        return TcpPrefillEnd(site)

    def decode_end(self, site: DecodeSite) -> TcpDecodeEnd:
        return TcpDecodeEnd(site)


TCP = TcpTransport()
