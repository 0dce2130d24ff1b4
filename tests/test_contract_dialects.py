"""The telemetry contract as real trainers speak it (issue 33, items 6 and 7), built here, not recorded:
schema-2 records still decode, unknown token counts flow through the frame and the detector, and a
producer that declares sampled tracing (some ranks, some steps) raises no false fail-stop while a
declared-traced rank that stops is still found dead."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from analytics.detection.cost_model import fit_class
from analytics.detection.detector import Detector
from analytics.detection.frame import GROUP_CODE, OP_CODE, build_frame
from collector.codec import BINARY_MAGIC, InvalidEvent, decode, encode, encode_json
from collector.events import (
    Chunk, CommOp, CommWait, Coords, EventFactory, Heartbeat, IncidentOpened, IterationPrediction, PlanCurrent,
    RankHealth, RankIteration, RankState, TracingDeclared,
)
from collector.plan import Plan
from tests.fixtures.payloads import payload_as

TP, PP, DP, M = 2, 2, 2, 4


def _device(d: int, s: int, t: int) -> int:
    return (d * PP + s) * TP + t  # Plan.uniform's layout


def job(iterations: int = 40, *, traced=lambda rank: True, step_every: int = 1, tokens: bool = True,
        seq_lens: bool = True, declare: TracingDeclared | None = None, stops: tuple[int, int] | None = None,
        heartbeats: bool = True, seed: int = 0) -> list:
    """Events of a healthy TP2 x PP2 x DP2 job: the plan, an optional tracing declaration, then per
    iteration a report from every traced rank on every traced step, and heartbeats from the traced
    ranks. ``stops=(rank, iteration)``: that rank sends nothing from then on, the others go on."""
    rng = np.random.default_rng(seed)
    facs = {r: EventFactory("j", f"rank-{r}") for r in range(TP * PP * DP)}
    head = [EventFactory("j", "trainer").make(PlanCurrent(plan=Plan.uniform(
        tp=TP, pp=PP, dp=DP, num_layers=2 * PP, microbatches_per_replica=M)), time_s=99.0)]
    if declare is not None:
        head.append(EventFactory("j", "trainer").make(declare, time_s=99.5))
    events = []
    for it in range(iterations):
        for d in range(DP):
            lens = [[int(x) for x in rng.integers(64, 2048, size=rng.integers(2, 8))] for _ in range(M)]
            for s in range(PP):
                for t in range(TP):
                    r = _device(d, s, t)
                    if not traced(r) or (stops is not None and r == stops[0] and it >= stops[1]):
                        continue
                    if it % step_every == 0:
                        chunks, t0 = [], 0.0
                        for m, ls in enumerate(lens):
                            n, s2 = sum(ls), float(sum(x * x for x in ls))
                            for kind, mult in (("F", 1.0), ("B", 2.0)):
                                dur = mult * (2e-6 * n + 4e-11 * s2 + 1e-3) * float(np.exp(rng.normal(0, 0.02)))
                                chunks.append(Chunk(kind=kind, microbatch=m, tokens=n if tokens else None,
                                                    seq_lens=ls if seq_lens else None, start_s=t0,
                                                    duration_s=dur))
                                t0 += dur
                        peer = _device(d, 1 - s, t)
                        comm = [CommWait(op=CommOp.PP_SENDRECV, peer=peer, microbatch=0, bytes=1 << 20, start_s=t0,
                                         duration_s=0.002, includes_wait=True, group="pp"),
                                CommWait(op=CommOp.ALL_GATHER, start_s=0.0, duration_s=1e-4, group="fsdp")]
                        report = RankIteration(epoch=0, iteration=it, rank=r, node=r // 8,
                                               coords=Coords(tp=t, pp=s, dp=d), wall_s=t0 * 1.2, chunks=chunks,
                                               comm=comm)
                        events.append(facs[r].make(report, time_s=100.0 + it))
                    if heartbeats:
                        events.append(facs[r].make(Heartbeat(rank=r, epoch=0, iteration=it, interval_s=1.0),
                                                   time_s=100.0 + it))
    return head + events


def run(events) -> tuple[Detector, list]:
    det = Detector("j")
    out = [p for e in events for p in det.on_event(e)]
    return det, out + det.flush()


def fail_stops(out) -> list[IncidentOpened]:
    return [p for p in out if isinstance(p, IncidentOpened) and p.category.value == "fail_stop"]


TP0_ONLY = [r for r in range(TP * PP * DP) if r % TP == 0]


# ---- the contract -------------------------------------------------------------------------------


def test_a_schema_2_record_decodes_unchanged_with_the_schema_3_defaults() -> None:
    raw = json.dumps({
        "id": "old-1", "kind": "telemetry.iteration", "schema_version": 2, "job": "j", "source": "rank-3", "seq": 7,
        "time_s": 12.5, "payload": {
            "epoch": 1, "iteration": 9, "rank": 3, "node": None, "coords": {"tp": 1, "pp": 1, "dp": 0}, "wall_s": 0.5,
            "chunk_table": {"kind": "FB", "microbatch": [0, 0], "virtual_stage": [0, 0], "tokens": [512, 512],
                            "seq_lens": [[256, 256], None], "start_s": [0.0, 0.1], "duration_s": [0.1, 0.2]},
            "comm": [{"op": "pp_send", "peer": 1, "microbatch": 0, "bytes": 4096, "start_s": 0.3, "duration_s": 0.01}]},
    }).encode()
    event = decode(raw)
    p = event.payload
    assert event.schema_version == 2 and isinstance(p, RankIteration)
    assert (p.coords.tp, p.coords.pp, p.coords.dp, p.coords.cp) == (1, 1, 0, 0)
    assert p.chunk_table.tokens == [512, 512] and p.chunks[0].seq_lens == [256, 256]
    assert p.comm[0].op is CommOp.PP_SEND and p.comm[0].includes_wait is False and p.comm[0].group is None
    again = decode(encode(event))  # re-encoded it is the same record
    assert again == event


def test_schema_5_is_written_with_comm_as_columns_and_an_unknown_version_names_what_this_build_reads() -> None:
    ev = job(1)[1]
    assert ev.kind == "telemetry.iteration" and ev.schema_version == 5
    assert encode(ev).startswith(BINARY_MAGIC) and decode(encode(ev)) == ev  # on the bus: binary columns
    body = json.loads(encode_json(ev))  # its JSON form (traces) holds the same columns
    assert "comm" not in body["payload"]  # the schema-3 form is read, never written
    table = body["payload"]["comm_table"]
    fused = table["op"].index("pp_sendrecv")
    assert table["includes_wait"][fused] is True and table["group"][fused] == "pp"
    assert len({len(v) for v in table.values()}) == 1
    body["schema_version"] = 6
    with pytest.raises(Exception, match="reads 2–5"):
        decode(json.dumps(body).encode())


def test_a_probe_measured_location_says_so_and_a_chunk_measured_one_is_written_as_before() -> None:
    """``Location.measure`` (incident schema 2): only a compute-alone size carries it, so a
    schema-1 incident reads as measured on chunks, and a chunk-measured one is written unchanged."""
    from collector.events import Evidence, Location, Severity

    def incident(loc: Location):
        return EventFactory("j", "analytics").make(IncidentOpened(
            incident_id="i", category="fail_slow", severity=Severity.HIGH, iteration=3, locations=[loc],
            evidence=Evidence(), summary="s"))

    probed = incident(Location(target="compute", rank=9, factor=2.0, measure="compute"))
    body = json.loads(encode(probed))
    assert body["schema_version"] == IncidentOpened.VERSIONS[-1] >= 2
    assert body["payload"]["locations"][0]["measure"] == "compute"
    assert payload_as(decode(encode(probed)), IncidentOpened).locations[0].measure == "compute"
    chunks = json.loads(encode(incident(Location(target="compute", rank=9, factor=2.0))))
    assert "measure" not in chunks["payload"]["locations"][0]
    chunks["schema_version"] = 1
    assert payload_as(decode(json.dumps(chunks).encode()), IncidentOpened).locations[0].measure == "chunks"
    body["payload"]["locations"][0]["measure"] = "flops"
    with pytest.raises(InvalidEvent, match="measure"):
        decode(json.dumps(body).encode())


def test_the_schema_3_and_schema_4_forms_of_a_record_read_and_frame_the_same() -> None:
    ev = job(1)[1]
    p = payload_as(ev, RankIteration)
    body = json.loads(encode_json(ev))
    old = dict(body, schema_version=3)
    old["payload"] = {k: v for k, v in body["payload"].items() if k != "comm_table"}
    old["payload"]["comm"] = [w.model_dump(mode="json") for w in p.waits().rows()]
    legacy = payload_as(decode(json.dumps(old).encode()), RankIteration)
    assert legacy.comm and not len(legacy.comm_table)
    assert legacy.waits().rows() == p.waits().rows() and len(p.waits()) >= 2
    a, b = build_frame([p]), build_frame([legacy])
    for name in ("k_rank", "k_op", "k_peer", "k_mb", "k_dur", "k_wait", "k_group"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.k_bytes, b.k_bytes, equal_nan=True)


def test_a_record_with_both_comm_forms_or_ragged_comm_columns_is_refused_in_one_line() -> None:
    body = json.loads(encode_json(job(1)[1]))
    both = json.loads(json.dumps(body))
    both["payload"]["comm"] = [{"op": "dp_allreduce", "start_s": 0.0, "duration_s": 0.1}]
    with pytest.raises(InvalidEvent, match="comm .schema 2–3. or comm_table .schema 4., not both"):
        decode(json.dumps(both).encode())
    ragged = json.loads(json.dumps(body))
    ragged["payload"]["comm_table"]["peer"].pop()
    with pytest.raises(InvalidEvent, match="comm columns must all hold") as err:
        decode(json.dumps(ragged).encode())
    assert "\n" not in str(err.value) and "'peer'" in str(err.value)


def test_unknown_token_counts_are_null_on_the_wire_and_never_zero() -> None:
    ev = job(1, tokens=False)[1]
    body = json.loads(encode_json(ev))
    assert set(body["payload"]["chunk_table"]["tokens"]) == {None}
    assert payload_as(decode(encode(ev)), RankIteration).chunks[0].tokens is None
    with pytest.raises(ValidationError):
        Chunk(kind="F", microbatch=0, tokens=-1, start_s=0.0, duration_s=1.0)


def test_a_tracing_declaration_travels_on_the_telemetry_topic_and_says_what_is_traced() -> None:
    d = TracingDeclared(epoch=0, dialect="sampled", traced_ranks=[0, 2], step_every=3, step_offset=4)
    ev = EventFactory("j", "trainer").make(d)
    assert ev.kind.startswith("telemetry.") and decode(encode(ev)).payload == d
    assert [i for i in range(10) if d.step_traced(i)] == [1, 4, 7]
    assert d.rank_traced(2) and not d.rank_traced(1)
    assert TracingDeclared(epoch=0, dialect="ours").rank_traced(99)
    with pytest.raises(ValidationError):
        TracingDeclared(epoch=0, dialect="ours", step_every=0)


# ---- the frame and the cost model ----------------------------------------------------------------


def test_the_frame_carries_unknown_tokens_as_nan_and_the_new_comm_fields_per_wait() -> None:
    reports = [e.payload for e in job(1, tokens=False) if isinstance(e.payload, RankIteration)]
    reports[0] = reports[0].model_copy(update={"coords": reports[0].coords.model_copy(update={"cp": 1})})
    frame = build_frame(reports)
    assert np.isnan(frame.c_tokens).all() and not frame.has_tokens
    assert frame.cp.tolist() == [1] + [0] * (len(reports) - 1)
    fused = frame.k_op == OP_CODE["pp_sendrecv"]
    assert fused.sum() == len(reports) and frame.k_wait[fused].all() and not frame.k_wait[~fused].any()
    assert (frame.k_group[fused] == GROUP_CODE["pp"]).all()
    assert (frame.k_group[frame.k_op == OP_CODE["all_gather"]] == GROUP_CODE["fsdp"]).all()
    known = build_frame([e.payload for e in job(1) if isinstance(e.payload, RankIteration)])
    assert np.isfinite(known.c_tokens).all() and known.c_tokens.min() > 0


def test_existing_op_codes_keep_their_numbers() -> None:
    assert {k: OP_CODE[k] for k in ("tp_allreduce", "pp_send", "pp_recv", "dp_allreduce")} == {
        "tp_allreduce": 0, "pp_send": 1, "pp_recv": 2, "dp_allreduce": 3}
    assert set(OP_CODE) == {op.value for op in CommOp} and len(set(OP_CODE.values())) == len(OP_CODE)


def test_a_class_without_token_counts_is_fitted_on_its_centre() -> None:
    rng = np.random.default_rng(1)
    d = 0.05 * np.exp(rng.normal(0, 0.02, 64))
    d[:3] *= 3.0  # a slow replica's rows must not pull the fit
    fit = fit_class(np.full(64, np.nan), np.full(64, np.nan), d)
    assert not fit.has_tokens and fit.alpha == 0.0 and fit.rows == 64
    assert fit.gamma == pytest.approx(0.05, rel=0.03)


@pytest.mark.parametrize("seq_lens", [True, False])
def test_unknown_tokens_flow_through_the_detector_without_error_or_false_incident(seq_lens: bool) -> None:
    det, out = run(job(30, tokens=False, seq_lens=seq_lens))
    assert det.stats.frames == 30
    assert [p for p in out if isinstance(p, IncidentOpened)] == []
    preds = [p for p in out if isinstance(p, IterationPrediction)]
    assert len(preds) == 30 and all(p.tokens == 0 for p in preds)  # unknown: nothing counted, no crash
    assert all(p.predicted_s > 0 for p in preds[5:])
    assert np.isfinite(det.model.error())


# ---- sampled tracing -----------------------------------------------------------------------------


def test_one_traced_rank_per_tp_group_raises_no_fail_stop_and_the_others_read_not_traced() -> None:
    declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=TP0_ONLY, seq_lens=False, tokens=False,
                               fused_p2p=True)
    det, out = run(job(40, traced=lambda r: r in TP0_ONLY, declare=declared, seq_lens=False, tokens=False))
    assert fail_stops(out) == [] and det.fail_stop.dead == set()
    assert det.stats.frames == 40
    health = [p for p in out if isinstance(p, RankHealth)][-1]
    states = {e.rank: e.state for e in health.entries()}
    assert {r for r, s in states.items() if s is RankState.NOT_TRACED} == set(range(TP * PP * DP)) - set(TP0_ONLY)
    assert all(states[r] is RankState.HEALTHY for r in TP0_ONLY)


def test_without_the_declaration_the_same_trace_calls_the_untraced_ranks_dead() -> None:
    """The control for the test above: it is the declaration that makes the silence expected."""
    _, out = run(job(40, traced=lambda r: r in TP0_ONLY))
    assert {p.locations[0].rank for p in fail_stops(out)} == set(range(TP * PP * DP)) - set(TP0_ONLY)


def test_a_declaration_after_the_plan_and_heartbeats_from_untraced_ranks_still_hold() -> None:
    """Declared late (after the first reports) and with the untraced ranks heartbeating: no false
    fail-stop. Then untraced rank 3 dies: the job hangs (no more reports, the others heartbeat on)
    and rank 3 is found dead by its heartbeats, the only evidence an untraced rank gives."""
    declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=TP0_ONLY)
    events = job(20, traced=lambda r: r in TP0_ONLY)
    untraced_hb = [EventFactory("j", f"rank-{r}").make(Heartbeat(rank=r, epoch=0, iteration=it, interval_s=1.0),
                                                       time_s=100.0 + it)
                   for it in range(20) for r in range(TP * PP * DP) if r not in TP0_ONLY]
    hang = [EventFactory("j", f"rank-{r}").make(Heartbeat(rank=r, epoch=0, iteration=20, interval_s=1.0),
                                                time_s=100.0 + it)
            for it in range(20, 40) for r in range(TP * PP * DP) if r != 3]
    late = EventFactory("j", "trainer").make(declared, time_s=102.0)
    healthy = sorted(events + [late] + untraced_hb, key=lambda e: e.time_s)
    det, out = run(healthy)
    assert fail_stops(out) == [] and det.stats.frames == 20
    det, out = run(healthy + hang)
    assert {p.locations[0].rank for p in fail_stops(out)} == {3}


def test_tracing_every_second_step_raises_no_fail_stop() -> None:
    declared = TracingDeclared(epoch=0, dialect="sampled", step_every=2)
    det, out = run(job(40, step_every=2, declare=declared))
    assert fail_stops(out) == [] and det.fail_stop.dead == set()
    assert det.stats.frames == 20


def test_every_second_step_and_one_rank_per_tp_group_without_heartbeats() -> None:
    declared = TracingDeclared(epoch=0, dialect="sampled", traced_ranks=TP0_ONLY, step_every=2, step_offset=1)
    events = [e for e in job(41, traced=lambda r: r in TP0_ONLY, heartbeats=False)
              if not isinstance(e.payload, RankIteration) or e.payload.iteration % 2 == 1]
    det, out = run(events[:1] + [EventFactory("j", "trainer").make(declared, time_s=99.5)] + events[1:])
    assert fail_stops(out) == [] and det.stats.frames == 20


def test_a_declared_traced_rank_that_stops_reporting_is_still_found_dead() -> None:
    declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=TP0_ONLY)
    for heartbeats in (True, False):  # its heartbeats stop too / a source without heartbeats
        det, out = run(job(40, traced=lambda r: r in TP0_ONLY, declare=declared, stops=(2, 20),
                           heartbeats=heartbeats))
        assert [p.locations[0].rank for p in fail_stops(out)] == [2], heartbeats
        assert det.fail_stop.dead == {2}


def test_a_sampled_job_whose_traced_rank_stops_on_a_sampled_step_is_found_dead() -> None:
    declared = TracingDeclared(epoch=0, dialect="sampled", traced_ranks=TP0_ONLY, step_every=2)
    det, out = run(job(40, traced=lambda r: r in TP0_ONLY, step_every=2, declare=declared, stops=(4, 20)))
    assert [p.locations[0].rank for p in fail_stops(out)] == [4]


# ---- the projections and the console ------------------------------------------------------------


def test_projections_and_the_rank_store_take_the_new_fields() -> None:
    import duckdb

    from analytics.projections.control_tables import ControlProjection
    from analytics.projections.event_log import EventLogProjection
    from analytics.projections.tables import TelemetryProjection
    from collector.stream import Delivery
    from ui.rank_factors import RankFactors

    declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=TP0_ONLY, tokens=False)
    events = job(3, traced=lambda r: r in TP0_ONLY, declare=declared, tokens=False)
    _, out = run(events)
    f = EventFactory("j", "analytics")
    events += [f.make(p) for p in out if isinstance(p, RankHealth)]
    conn = duckdb.connect()
    deliveries = [Delivery("t", 0, i, e) for i, e in enumerate(events)]
    for projection in (EventLogProjection(), TelemetryProjection(), ControlProjection()):
        projection.create(conn)
        projection.apply(conn, deliveries)
    assert conn.execute("SELECT count(*) FROM events WHERE kind = 'telemetry.tracing'").fetchone() == (1,)
    assert conn.execute("SELECT count(*), count(tokens) FROM chunks").fetchone() == (3 * len(TP0_ONLY) * 2 * M, 0)
    row = conn.execute("SELECT min(pp_wait_s) FROM rank_iterations").fetchone()
    assert row is not None and row[0] == pytest.approx(0.002)
    assert conn.execute("SELECT count(DISTINCT rank) FROM rank_health WHERE state = 'not_traced'").fetchone() == (4,)
    factors = RankFactors()
    for e in events:
        if isinstance(e.payload, RankHealth):
            factors.add(e.payload)
    _, _, matrix = factors.matrix(2, 2)  # the console's heatmap: the detector's factors
    assert np.isfinite(matrix[TP0_ONLY]).all() and np.isnan(matrix[[1, 3, 5]]).all()  # untraced: no factor


def test_a_declaration_later_than_the_wait_resolves_the_fail_stops_it_explains() -> None:
    """The declaration travels on another partition than the reports: past ``max_wait_iterations``
    the untraced ranks are called dead; the declaration, when it comes, revives them (they never
    heartbeated) and resolves those incidents."""
    from collector.events import IncidentResolved

    declared = TracingDeclared(epoch=0, dialect="megatron", traced_ranks=TP0_ONLY)
    late = EventFactory("j", "trainer").make(declared, time_s=180.0)
    det, out = run(sorted(job(100, traced=lambda r: r in TP0_ONLY) + [late], key=lambda e: e.time_s))
    opened = fail_stops(out)
    assert {p.locations[0].rank for p in opened} == {1, 3, 5, 7}
    resolved = {p.incident_id for p in out if isinstance(p, IncidentResolved)}
    assert {p.incident_id for p in opened} <= resolved
    assert det.fail_stop.dead == set() and det.stats.frames == 100
