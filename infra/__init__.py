"""Local Apache Kafka for ResiHP: fetch the broker from Maven Central, run it (see broker.py)."""
