"""Projections: the DuckDB tables of the log, kept exactly once (the projector stores its offsets in
the same transaction as the rows), the detector's state and outbox among them, and the goodput fold."""
