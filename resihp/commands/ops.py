"""``resihp ops up|down``: a real Prometheus and Alertmanager (Debian's binaries) on loopback,
pointed at the platform's /metrics, for operators who want their usual tools on the demo.

``up`` writes the configs from infra/prometheus/ and infra/alertmanager/ into --workdir (data
directories there too), starts ``prometheus`` with the alert rules (infra/prometheus/rules.yml) and
``prometheus-alertmanager`` routing every alert to a webhook, and stays in the foreground: Ctrl-C
(or ``resihp ops down`` from another shell) stops both, and they die with it whatever kills it.
By default the webhook is a receiver inside this command that prints each notification as one JSON
line; --webhook-url sends them elsewhere (a chat bridge, a pager).

The default targets are the demo's: the analytics consumer on 127.0.0.1:9464 and the remediation
engine on 127.0.0.1:9465 (``make demo`` prints them). Missing binaries: install Debian's
``prometheus`` and ``prometheus-alertmanager`` (``make test`` does).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_WORKDIR = ".resihp/ops"
DEMO_TARGETS = "127.0.0.1:9464,127.0.0.1:9465"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ops", help="start / stop a real Prometheus and Alertmanager pointed at the platform",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = ops.add_parser("up", help="start Prometheus and Alertmanager; Ctrl-C stops them")
    up.add_argument("--workdir", default=DEFAULT_WORKDIR, help=f"configs, data and logs (default {DEFAULT_WORKDIR})")
    up.add_argument("--targets", default=DEMO_TARGETS,
                    help=f"comma-separated host:port of /metrics endpoints to scrape (default: the demo's, {DEMO_TARGETS})")
    up.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus' port on 127.0.0.1 (default 9090)")
    up.add_argument("--alertmanager-port", type=int, default=9093, help="Alertmanager's port (default 9093)")
    up.add_argument("--webhook-url", default=None,
                    help="where Alertmanager posts alerts (default: a receiver in this command printing them)")
    up.add_argument("--webhook-port", type=int, default=9095, help="port of the built-in receiver (default 9095)")
    up.add_argument("--console-url", default="http://127.0.0.1:8501",
                    help="the console's URL, which each incident alert links to (default: `resihp ui`'s, http://127.0.0.1:8501)")
    up.add_argument("--scrape-interval", default="5s", help="Prometheus scrape and rule evaluation interval (default 5s)")
    up.set_defaults(func=run_up)
    down = ops.add_parser("down", help="stop what `ops up` started in --workdir")
    down.add_argument("--workdir", default=DEFAULT_WORKDIR, help=f"the workdir `ops up` used (default {DEFAULT_WORKDIR})")
    down.set_defaults(func=run_down)


def _printing_receiver(port: int):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            for alert in body.get("alerts", []):
                print(json.dumps({"event": "alert", "status": alert.get("status"), **alert.get("labels", {}),
                                  "summary": alert.get("annotations", {}).get("summary"),
                                  "runbook_url": alert.get("annotations", {}).get("runbook_url"),
                                  "incident_url": alert.get("annotations", {}).get("incident_url")}), flush=True)
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def run_up(args: argparse.Namespace) -> int:
    import signal
    import time
    from pathlib import Path

    from infra import monitoring

    missing = monitoring.missing_binaries()
    if missing:
        print(f"{', '.join(missing)} not found: install Debian's prometheus and prometheus-alertmanager "
              "(apt-get install prometheus prometheus-alertmanager; `make test` does)", file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    receiver = None
    webhook = args.webhook_url
    if webhook is None:
        receiver = _printing_receiver(args.webhook_port)
        webhook = f"http://127.0.0.1:{args.webhook_port}/alerts"
    servers = []
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        servers.append(monitoring.start_alertmanager(workdir, webhook, port=args.alertmanager_port))
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        servers.append(monitoring.start_prometheus(
            workdir, targets, f"127.0.0.1:{args.alertmanager_port}", port=args.prometheus_port,
            scrape_interval=args.scrape_interval, evaluation_interval=args.scrape_interval, console_url=args.console_url))
        print(f"prometheus: {servers[1].url}  (scraping {', '.join(targets)}; rules {monitoring.RULES})", file=sys.stderr)
        print(f"alertmanager: {servers[0].url}  (alerts to {webhook}); Ctrl-C or `resihp ops down` stops both",
              file=sys.stderr, flush=True)
        while not stop and all(s.process.poll() is None for s in servers):
            time.sleep(0.5)
        for s in servers:
            if s.process.poll() is not None and not stop:
                print(f"{s.name} exited with {s.process.returncode}; see {s.log_path}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        for s in reversed(servers):
            s.stop()
            (workdir / f"{s.name}.pid").unlink(missing_ok=True)
        if receiver is not None:
            receiver.shutdown()
    return 0


def run_down(args: argparse.Namespace) -> int:
    from pathlib import Path

    from infra import monitoring

    stopped = monitoring.stop_recorded(Path(args.workdir))
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing of `ops up` runs from {args.workdir}",
          file=sys.stderr)
    return 0
