"""Side-channel protocol versions.

Bump ``PROTOCOL_VERSION`` on any change to the messages; list in ``SUPPORTED_VERSIONS`` the versions a
server still answers and a client still accepts.

* 1: ``Hello`` / ``Challenge`` / ``GetMetadata`` / ``Metadata`` / ``ErrorReply``.
* 2: adds ``Release`` / ``ReleaseReply`` (the proxy ends a lease nobody will read); version 1 messages unchanged,
  so a version 2 server answers version 1 clients as before.
"""

PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS: frozenset[int] = frozenset({1, 2})
#: The first version that has ``Release``.
RELEASE_VERSION = 2
