"""``resihp import TRACES... --layout LAYOUT --out TRACE.parquet``: turn per-rank torch.profiler traces
(Chrome/Kineto JSON, one per rank; folders are read for their *.json files) and a layout (YAML or JSON:
per rank its tp / pp / dp, optionally cp and node; schedule, microbatches, num_layers) into a ResiHP
trace that `resihp detect` and `resihp replay` read. See docs/real-cluster.md, "Importing
torch.profiler traces".

The output is written to a temporary file beside it and renamed into place only when complete, so a
failed import leaves an existing file as it was. Bad input ends with one line naming the file and
the problem, exit code 2."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="convert torch.profiler traces (one JSON per rank) into a ResiHP trace",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="trace files or folders of them (prof.export_chrome_trace output)")
    p.add_argument("--layout", required=True, metavar="FILE",
                   help="YAML or JSON: ranks (rank, tp, pp, dp, optional cp, node), schedule, microbatches, "
                        "num_layers, optional job, tokens_per_microbatch, virtual_stages, gpus_per_node")
    p.add_argument("--out", required=True, metavar="TRACE.parquet", help="the ResiHP trace to write")
    p.add_argument("--job", default=None, help="job name (default: the layout's job, else the output's stem)")
    p.add_argument("--max-trace-mib", type=int, default=2048, metavar="MIB",
                   help="refuse a gzip trace that decompresses to more than this many MiB (default 2048): a small "
                        "file can inflate without bound")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys
    import tempfile
    from pathlib import Path

    from collector.codec import InvalidEvent
    from collector.profiler_import import MIB, ImportProblem, import_traces, load_layout, trace_files
    from collector.trace import TraceWriter

    out = Path(args.out)
    try:
        if out.suffix != ".parquet" or out.is_dir():
            raise ImportProblem(f"{out}: the output must be a .parquet file path")
        layout = load_layout(args.layout)
        job = args.job or layout.job or out.stem
        if args.max_trace_mib < 1:
            raise ImportProblem(f"--max-trace-mib {args.max_trace_mib}: give a positive number of MiB")
        result = import_traces(trace_files(args.traces), layout, job=job, max_bytes=args.max_trace_mib * MIB)
    except ImportProblem as exc:
        print(f"resihp import: error: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".parquet", dir=out.parent)
    os.close(fd)
    try:
        with TraceWriter(tmp) as writer:
            writer.write(result.events)
        os.replace(tmp, out)
    except InvalidEvent as exc:  # an event over the bus's size limit: nothing is written
        Path(tmp).unlink(missing_ok=True)
        print(f"resihp import: error: {out}: {exc.reason}", file=sys.stderr)
        return 2
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{len(result.events):,} events ({len(result.ranks)} ranks x {len(result.steps)} steps, "
          f"steps {result.steps[0]}..{result.steps[-1]}) for job {job!r} -> {out}", file=sys.stderr)
    return 0
