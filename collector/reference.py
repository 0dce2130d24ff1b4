"""Renders docs/events.md from the models themselves, so the reference cannot drift.

``python -m collector.reference > docs/events.md`` regenerates it; a test fails when the
committed file differs from what the models say.
"""

from __future__ import annotations

import enum
import inspect
import re
import typing

from pydantic import BaseModel

from collector import events, plan, topics
from collector.events import PAYLOAD_TYPES, Envelope, Payload
from collector.topics import topic_for

INTRO = """# Event reference

Everything that happens in the platform is an event on the bus. This page is generated from the
models in `collector/events.py` and `collector/plan.py` (`python -m collector.reference >
docs/events.md`); a test keeps it identical to them.

Every event is an **envelope** around a **payload**. The wire format is one JSON object (UTF-8)
per record; records over {max_bytes:,} bytes are refused. Consumers are idempotent on `id`.
A record that does not decode (bad bytes, missing or wrongly typed fields, unknown kind, unknown
schema version, too large) goes to `{deadletter}` with the reason and the raw bytes.

Times: `time_s` is Unix time at the source. Durations (`*_s`) are measured on the host that
reports them; `start_s` offsets are relative to the reporting rank's own iteration start. Never
subtract the clocks of two hosts.
"""


def _type_name(annotation: object) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"\b(?:[a-z_]+\.)+", "", text)  # drop module paths
    text = text.replace("typing.", "").replace("NoneType", "None")
    return text


def _fields_table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        default = "required" if info.is_required() else (
            "[]" if info.default_factory is list else "{}" if info.default_factory is dict else repr(info.default)
        )
        if isinstance(info.default, enum.Enum):
            default = repr(info.default.value)
        meaning = info.description or ""
        constraints = [f"{type(m).__name__.lower()} {getattr(m, type(m).__name__.lower(), '')}".strip()
                       for m in info.metadata if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")]
        if constraints:
            meaning = (meaning + " " if meaning else "") + "(" + ", ".join(constraints).replace("ge ", "≥ ").replace(
                "gt ", "> ").replace("le ", "≤ ").replace("lt ", "< ") + ")"
        type_name = _type_name(info.annotation).replace("|", "\\|")
        rows.append(f"| `{name}` | `{type_name}` | {default} | {meaning} |")
    return rows


def _doc(obj: type) -> str:
    return inspect.cleandoc(obj.__doc__ or "").replace("\n", " ")


def _nested_models() -> list[type[BaseModel]]:
    out = []
    for module in (events, plan):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (issubclass(obj, BaseModel) and obj.__module__ == module.__name__
                    and not issubclass(obj, (Payload, Envelope)) and obj is not Payload):
                out.append(obj)
    return sorted(out, key=lambda m: m.__name__)


def _enums() -> list[type[enum.Enum]]:
    return sorted(
        (obj for _, obj in inspect.getmembers(events, inspect.isclass)
         if issubclass(obj, enum.Enum) and obj.__module__ == events.__name__),
        key=lambda e: e.__name__,
    )


def render() -> str:
    from collector.codec import MAX_EVENT_BYTES

    lines = [INTRO.format(max_bytes=MAX_EVENT_BYTES, deadletter=topics.DEADLETTER), "## The envelope", ""]
    lines += [_doc(Envelope), ""]
    lines += _fields_table(Envelope)
    lines += ["", "## Topics", "", "| topic | Kafka partitions | kinds |", "|---|---|---|"]
    for t in topics.ALL_TOPICS:
        kinds = ", ".join(f"`{p.KIND}`" for p in PAYLOAD_TYPES if topic_for(p.KIND) == t)
        lines.append(f"| `{t}` | {topics.PARTITIONS[t]} | {kinds} |")
    lines += ["", "Records are keyed `job/source`, so one source's events stay in order within a partition.", ""]
    lines += ["## Kinds", ""]
    for p in PAYLOAD_TYPES:
        versions = ", ".join(str(v) for v in p.VERSIONS)
        lines += [f"### `{p.KIND}` — {p.__name__}", "", _doc(p), "",
                  f"Topic `{topic_for(p.KIND)}`; schema versions read: {versions}.", ""]
        lines += _fields_table(p)
        lines.append("")
    lines += ["## Nested types", ""]
    for m in _nested_models():
        lines += [f"### {m.__name__}", "", _doc(m), ""]
        lines += _fields_table(m)
        lines.append("")
    lines += ["## Enumerations", "", "| name | values |", "|---|---|"]
    for e in _enums():
        lines.append(f"| {e.__name__} | " + ", ".join(f"`{v.value}`" for v in e) + " |")
    schedules = typing.get_args(plan.Schedule)
    lines += ["| Schedule | " + ", ".join(f"`{s}`" for s in schedules) + " |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
