"""How KV moves between a prefill rank and a decode rank: the seam every transport plugs into (:mod:`.seam`: both
ends, the link to a connected engine, what each end is handed), the registry that picks them by name
(:mod:`.registry`), NIXL as the courier of the lease protocol (:mod:`.courier`), what a pull is asked and moved
(:mod:`.requests`), and the built-in transports: :mod:`.nixl` (reads and pushes) and :mod:`.ipc` (same-host: CUDA IPC,
shared host memory, reads in place). The connector's roles reach a transport only through the seam and the registry.
"""
