"""The analytics service: the loops that run the projections, the detector and the sharded roles
on a bus (``resihp analytics`` parses its flags and calls them), with what a running consumer
needs around them: the lease that lets one consumer publish per bus, the outage guard, the
Prometheus exporter, and the offline run over a recorded trace."""
