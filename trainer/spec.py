"""Which bus an executor's processes publish to: one spec every executor hands its ranks and agents."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class BusSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = None
    path: str | None = None
    bootstrap: str | None = None
    namespace: str = ""

    def environment(self) -> dict[str, str]:
        """The RESIHP_* variables that make a child process's ``open_bus()`` open this bus."""
        env = {"RESIHP_BUS": self.backend} if self.backend else {}
        if self.path:
            env["RESIHP_EMBEDDED_PATH"] = self.path
        if self.bootstrap:
            env["RESIHP_KAFKA_BOOTSTRAP"] = self.bootstrap
        if self.namespace:
            env["RESIHP_KAFKA_NAMESPACE"] = self.namespace
        return env

    def open(self):
        """Open the bus this spec names (Kafka with a topic namespace when one is given)."""
        if self.backend == "kafka" and self.namespace:
            from collector.bus import DEFAULT_KAFKA_BOOTSTRAP
            from collector.kafka_bus import KafkaBus

            return KafkaBus(self.bootstrap or DEFAULT_KAFKA_BOOTSTRAP, namespace=self.namespace)
        from collector.bus import open_bus

        return open_bus(self.backend, path=self.path, bootstrap=self.bootstrap)
