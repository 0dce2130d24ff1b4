"""The Kafka broker a benchmark runs against: the one it was given, or one borrowed for its run."""

from __future__ import annotations

import contextlib
import sys


def kafka_bootstrap(stack: contextlib.ExitStack, given: str | None) -> str:
    """``given``, or the broker ``infra.broker.borrowed`` lends until ``stack`` closes (the one up on
    the default data dir, left running; else one started for the bench and stopped after). Which
    one is said on stderr."""
    if given:
        return given
    from infra import broker

    lent = stack.enter_context(broker.borrowed())
    print(f"Kafka: {lent.describe()}", file=sys.stderr)
    return lent.bootstrap
