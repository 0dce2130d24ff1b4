"""DuckDB projections, the cost and schedule models, the detectors and localisation."""
