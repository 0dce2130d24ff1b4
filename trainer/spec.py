"""Which bus an executor's processes publish to: one spec every executor hands its ranks and agents."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class BusSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = None
    path: str | None = None
    bootstrap: str | None = None
    namespace: str = ""

    def open(self):
        """Open the bus this spec names (Kafka with a topic namespace when one is given)."""
        if self.backend == "kafka" and self.namespace:
            from collector.bus import DEFAULT_KAFKA_BOOTSTRAP
            from collector.kafka_bus import KafkaBus

            return KafkaBus(self.bootstrap or DEFAULT_KAFKA_BOOTSTRAP, namespace=self.namespace)
        from collector.bus import open_bus

        return open_bus(self.backend, path=self.path, bootstrap=self.bootstrap)
