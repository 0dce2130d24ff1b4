"""Bytes on the bus <-> events, and the one error every bad record becomes.

JSON (UTF-8) is the wire format: any tool can read a topic, and pydantic-core parses and validates
it in one pass. ``decode`` never raises anything but ``InvalidEvent``, whose message names the
problem; consumers send such records to the dead-letter topic instead of crashing.
"""

from __future__ import annotations

import base64
import hashlib
import re

from pydantic import ValidationError

from collector.events import DEADLETTER_REASON_MAX, EVENT_ADAPTER, DeadLetter, Envelope

MAX_EVENT_BYTES = 1_000_000  # Kafka's default message.max.bytes is ~1 MB; stay under it.
DEADLETTER_RAW_PREFIX = 64 * 1024  # bytes of a bad record a dead letter carries whole (base64: ~87 KB)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InvalidEvent(ValueError):
    """A record that is not a valid event. ``reason`` is one line an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(event: Envelope) -> bytes:
    raw = event.__pydantic_serializer__.to_json(event)
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidEvent(
            f"{event.kind} event of {len(raw):,} bytes exceeds the {MAX_EVENT_BYTES:,}-byte limit; "
            "split it (telemetry: one message per rank per iteration)"
        )
    return raw


def decode(raw: bytes) -> Envelope:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidEvent(f"record value is {type(raw).__name__}, not bytes")
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidEvent(f"record of {len(raw):,} bytes exceeds the {MAX_EVENT_BYTES:,}-byte limit")
    if not raw:
        raise InvalidEvent("empty record")
    try:
        return EVENT_ADAPTER.validate_json(raw)
    except ValidationError as exc:
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError as bad:
            raise InvalidEvent(f"record is not UTF-8: {bad.reason} at byte {bad.start}") from None
        raise InvalidEvent("invalid event: " + one_line(exc)) from None
    except (ValueError, TypeError, RecursionError) as exc:  # defensive: parser errors outside pydantic
        raise InvalidEvent(f"undecodable record: {exc}") from None


def dead_letter(topic: str, partition: int, offset: int, group: str, reason: str, raw: object) -> DeadLetter:
    """The dead letter of one bad record, bounded so that it always fits on the bus.

    Why bounded: a record just under the bus's limit, base64-encoded inside an envelope, would not
    fit, and a consumer that cannot publish a record's dead letter cannot move past it (it would
    crash-loop on every restart). A record longer than ``DEADLETTER_RAW_PREFIX`` keeps that prefix,
    its length and its SHA-256 (enough to find it in the log and tell two apart); the reason and the
    names keep their first characters. Never raises, whatever ``raw`` is (a Kafka tombstone is None).
    """
    data = bytes(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else b""
    whole = len(data) <= DEADLETTER_RAW_PREFIX
    return DeadLetter(
        topic=_clip(topic, 1000), partition=min(max(partition, 0), 2**31 - 1), offset=min(max(offset, 0), 2**53),
        group=_clip(group, 1000), reason=_clip(reason, DEADLETTER_REASON_MAX) or "invalid record",
        raw_b64=base64.b64encode(data[:DEADLETTER_RAW_PREFIX]).decode("ascii"),
        raw_length=None if whole else len(data),
        raw_sha256=None if whole else hashlib.sha256(data).hexdigest(),
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(exc: ValidationError, root: str = "<record>") -> str:
    """A validation error as one line (a dead letter's reason, a command's error): the first three
    problems, each with its field path (``root`` when the whole input is wrong)."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or root
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    # Field names come from the input: escape control characters so the reason stays one line.
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], "; ".join(parts) + more)
