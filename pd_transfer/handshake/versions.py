"""Side-channel protocol versions.

Bump ``PROTOCOL_VERSION`` on any change to the messages; list in ``SUPPORTED_VERSIONS`` the versions a
server still answers and a client still accepts.

* 1: ``Hello`` / ``Challenge`` / ``GetMetadata`` / ``Metadata`` / ``ErrorReply``.
* 2: adds ``Release`` / ``ReleaseReply`` (the proxy ends a lease nobody will read); version 1 messages unchanged,
  so a version 2 server answered version 1 clients as before.
* 3: a cache region says where its memory is (``KVRegion.memory``, ``device_index``: host, or a GPU); a rank may
  offer its memory for same-host IPC (``RankMetadata.ipc``), sent only to a client that proved it runs on the
  prefill's host (``Challenge.host``, ``GetMetadata.host_proof``). A version 2 peer cannot decode version 3
  metadata (and would read GPU addresses as host ones), so versions 1 and 2 are refused, naming both versions.
* 4: a rank's host cache may be offered to be read in place with ``process_vm_readv`` (a ``CmaSegment`` in
  ``RankMetadata.ipc``); a version 4 server answers version 3 clients without that offer.
* 5: a rank publishes each transport's offer under the transport's name (``RankMetadata.offers``); a version 5 server
  answers version 3 and 4 clients with the same-host offer as ``ipc``, and a version 5 client reads a version 4
  server's ``ipc`` as that offer.
"""

PROTOCOL_VERSION = 5
SUPPORTED_VERSIONS: frozenset[int] = frozenset({3, 4, 5})
#: The first version that has ``Release``.
RELEASE_VERSION = 2
#: The first version whose ranks may offer their host cache to ``process_vm_readv`` (``CmaSegment``).
CMA_VERSION = 4
#: The first version whose ranks publish their transports' offers by name (``RankMetadata.offers``).
OFFERS_VERSION = 5
