"""``bench topology``: heterogeneous TP and block sizes against the homogeneous transfer, and the host's CMA ceiling."""
