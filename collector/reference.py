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
from collector.auth import WRITERS
from collector.topics import topics_for

INTRO = """# Event reference

Everything that happens in the platform is an event on the bus. This page is generated from the
models in `collector/events.py` and `collector/plan.py` (`python -m collector.reference >
docs/events.md`); a test keeps it identical to them.

Every event is an **envelope** around a **payload**. The wire format is one JSON object (UTF-8)
per record, but for the bulk records: rank reports (`telemetry.iteration` from schema 5) and the
payloads of packed arrays (`analytics.replica_summary`, `analytics.liveness`) travel as a binary
record, an 8-byte prefix (`0xFF 'R' 'B'`, the wire format, the header's length as u32 LE), a
header and then the arrays' bytes raw. The header of wire format 1 is the envelope's JSON (a
packed payload's `blob` empty; a rank report's tables empty and `columns` saying what follows); a
rank report travels in wire format 2, whose header is the same fields as fixed binary numbers and
strings (`collector/rank_header.py`), unless it is signed. In JSON a `blob` is standard base64 and a
rank report carries its columns inline; every form decodes (`collector/codec.py`), and traces keep
the JSON form. Records over {max_bytes:,} bytes are refused. Consumers are idempotent on `id`.
A record that does not decode (bad bytes, missing or wrongly typed fields, unknown kind, unknown
schema version, too large) goes to `{deadletter}` with the reason and the raw bytes.

Times: `time_s` is Unix time at the source. Durations (`*_s`) are measured on the host that
reports them; `start_s` offsets are relative to the reporting rank's own iteration start. Never
subtract the clocks of two hosts.
"""

RANGES = """## Contract ranges

Every number is checked at decode, before any table, detector or screen sees it; a record outside a
range goes to `{deadletter}` with a reason naming the field (`invalid event:
payload.rank: Input should be less than or equal to {int32:,}`), and the consumer carries on.

| what | range |
|---|---|
| ranks, device ids (plans' too), nodes, peers, epochs, TP/PP/DP/CP coordinates, micro-batch and virtual-stage numbers, stages, replicas, schema versions, partitions | integers 0 … {int32:,} (int32) |
| iterations, sequence numbers (`seq`), offsets, byte counts, token totals of an iteration, sample counts | integers 0 … {count:,} (2^53: exact as a double, far from int64's end) |
| tokens of one chunk, `tokens_per_microbatch` | integers 0 … {tokens:,} (2^40) |
| packed sequence lengths | integers 0 … {int32:,} |
| durations and offsets (`*_s` measured by a host: chunk, comm, wall, pause, probe, heartbeat interval, reshape cost) | finite, 0 … {duration:,.0f} s |
| `time_s` (the envelope's Unix time) | finite, 0 … {time:,.0f} |
| tokens per second | finite, 0 … {rate:.0e} |
| everything else that is a float (loss, fitted coefficients, factors, evidence) | finite |
| lists (chunks of a rank-iteration, sequences of a chunk) | at most {chunks:,} items |
| other lists (comm waits, traced ranks, locations, evidence, plan ids) | at most {lists:,} items |

Non-finite floats (`NaN`, `Infinity`, `-Infinity`, or a literal too large for a double such as
`1e400`) are refused in every field. Text is any UTF-8 without lone surrogates; `id` is 1–64
characters, `job` and `source` 1–200. A whole record is at most {max_bytes:,} bytes.

**Dead letters are bounded.** A `deadletter` carries the bad record whole when it is at most 64 KiB;
a longer one keeps its first 64 KiB, `raw_length` and `raw_sha256`, so a dead letter always fits
the bus, however large the record was. Its reason is clipped to 2,000 characters.
"""

TRACING = """## Dialects and sampled tracing

Real trainers record less than this contract can carry, and differently. A producer says what it
records with a `telemetry.tracing` event (TracingDeclared), published at start and again when it
changes; the newest declared at or before an epoch is in force for it (a reshape alone does not
re-declare).

- `dialect` is a free label (`ours`, `megatron`, `profiler`, `sampled`, ...) for people and tools;
  the detector reads the flags, not the label.
- `traced_ranks`: only these devices report telemetry (None: every rank of the plan does).
  `step_every` / `step_offset`: iteration `i` is traced iff `i % step_every == step_offset % step_every`.
- `seq_lens`, `tokens`: whether chunks carry them. An unknown token count is `null`, never 0
  (`RankIteration` schema 3; the analytics frame holds it as NaN and fits such a class on its centre).
- `fused_p2p`: p2p timers hold the wait for the peer; per op, `CommWait.includes_wait` says the same.

**Not traced.** A rank of the plan that the declaration leaves out is *not traced*: no telemetry
is expected from it, so its silence is neither a death nor a sign of health. The detector waits
only for traced ranks and traced steps, never declares an untraced rank dead from missing
telemetry, and reports it in `analytics.rank_health` as `not_traced` (the console shows "not
traced"). Heartbeats from an untraced rank, if it sends any, still count: a rank whose heartbeats
stop while the job hangs is dead, traced or not. A declared-traced rank that stops reporting is
found dead as before. A report of a step the declaration leaves out is dropped (its peers do not
report that step, and a partial iteration would read as missing ranks).

**Migration.** `telemetry.iteration` schema 3 adds `Coords.cp`, null token counts, the collectives
`pp_sendrecv`, `all_gather`, `reduce_scatter`, `embedding_allreduce`, `loss_allreduce`, and the
comm fields `includes_wait` and `group`. Schema 4 carries a rank's communications as columns
(`comm_table`, as `chunk_table` carries its chunks): a report of 32 chunks and 25 waits is ×1.59
smaller and decodes ×1.58 faster than with its waits as objects (`resihp bench analytics`,
[benchmarks](benchmarks.md)). Every addition has a default and the
schema-3 `comm` list is still read, so a schema-2 or -3 record (an old log) decodes unchanged;
a record carrying both forms is refused. Schema 5 is written: on the bus a binary record whose
columns are little-endian arrays grouped by dtype (`collector/rank_columns.py` gives the layout),
checked at decode in one pass per dtype group (ranges, finiteness, sequence counts against the
header) and kept as arrays until a reader asks for values; a report of 32 chunks decodes ×2–3
faster than its JSON columns. Its JSON form (a trace, `encode_json`) is schema 4's, and a JSON
record that names `columns` is refused. Why not Arrow IPC: one report is a one-row batch of list
columns whose schema flatbuffer alone outweighs its arrays, and reading it back costs more than
`np.frombuffer` over the body (as for the replica summaries, `collector/codec.py`).
"""


def _type_name(annotation: object) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"\b(?:[a-z_]+\.)+", "", text)  # drop module paths
    text = text.replace("typing.", "").replace("NoneType", "None")
    # constrained item types read as what they allow: list[int 0..2147483647], dict[…, finite float]
    text = re.sub(r"Annotated\[(\w+), FieldInfo\(annotation=None, required=True, metadata=\[Ge\(ge=([\d.e+-]+)\), "
                  r"Le\(le=([\d.e+-]+)\)\]\)\]", r"\1 \2..\3", text)
    text = re.sub(r"Annotated\[float, FieldInfo\(annotation=None, required=True, "
                  r"metadata=\[AllowInfNan\(allow_inf_nan=False\)\]\)\]", "finite float", text)
    return text


def _fields_table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        default = "required" if info.is_required() else (
            "[]" if info.default_factory is list else "{}" if info.default_factory is dict
            else "empty" if info.default_factory is not None else repr(info.default)
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


def _signers(kind: str) -> str:
    """Who may write ``kind`` (collector/auth.py): what every reader that acts on it checks."""
    roles = WRITERS.get(kind)
    if roles is None:
        return "Unsigned: never trusted for control."
    return f"Signed by: {' or '.join(f'`{r}`' for r in roles)} ([threat model](security.md#threat-model))."


def render() -> str:
    from collector.codec import MAX_EVENT_BYTES

    lines = [INTRO.format(max_bytes=MAX_EVENT_BYTES, deadletter=topics.DEADLETTER), "## The envelope", ""]
    lines += [_doc(Envelope), ""]
    lines += _fields_table(Envelope)
    lines += ["", "## Topics", "", "| topic | Kafka partitions | kinds |", "|---|---|---|"]
    for t in topics.ALL_TOPICS:
        kinds = ", ".join(f"`{p.KIND}`" for p in PAYLOAD_TYPES if t in topics_for(p.KIND))
        lines.append(f"| `{t}` | {topics.PARTITIONS[t]} | {kinds} |")
    lines += ["", "Records are keyed `job/source`, so one source's events stay in order within a partition.", ""]
    lines += [RANGES.format(deadletter=topics.DEADLETTER, int32=events.INT32_MAX, count=events.COUNT_MAX,
                            tokens=events.TOKENS_MAX, duration=events.DURATION_MAX_S, time=events.TIME_MAX_S,
                            rate=events.RATE_MAX, chunks=events.CHUNKS_MAX, lists=events.LIST_MAX,
                            max_bytes=MAX_EVENT_BYTES)]
    lines += [TRACING, "## Kinds", ""]
    for p in PAYLOAD_TYPES:
        versions = ", ".join(str(v) for v in p.VERSIONS)
        lines += [f"### `{p.KIND}` — {p.__name__}", "", _doc(p), "",
                  f"Topic {' and '.join(f'`{t}`' for t in topics_for(p.KIND))}; schema versions read: {versions}. "
                  + _signers(p.KIND), ""]
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
