"""The built-in ``tcp`` transport: a request's rows sent by the prefill rank over a TCP connection of its own, straight
out of its cache into the decode's (:mod:`.transport`)."""
