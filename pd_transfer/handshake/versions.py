"""Side-channel protocol versions.

Bump ``PROTOCOL_VERSION`` on any change to the messages; list in ``SUPPORTED_VERSIONS`` the versions a
server still answers.
"""

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS: frozenset[int] = frozenset({1})
