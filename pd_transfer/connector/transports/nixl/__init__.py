"""The NIXL transport (:mod:`.transport`): one-sided reads in place, staged or packed (:mod:`.reads`), and pushes over
TCP (the decode's target :mod:`.push_orders`, the prefill's writer :mod:`.push_writer`, plans on the wire
:mod:`.push_plans`, GPU caches through host memory :mod:`.push_staging`)."""
