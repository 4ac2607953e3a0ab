"""The built-in same-host transports (:mod:`.transport`): ``cuda_ipc``, ``host_ipc`` (copies, :mod:`.ipc_reads`) and
``host_cma`` (reads in place, :mod:`.cma_reads`), and when each reads an engine (:mod:`.choice`)."""
