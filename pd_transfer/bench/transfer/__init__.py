"""``bench transfer`` and ``bench pd-tcp``: our read path against raw NIXL, in-process copies and a plain TCP stream."""
