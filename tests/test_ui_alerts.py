"""ui/alerts.py when Alertmanager is not there or is something else: one clear line, never a crash.
(The live path, the real Alertmanager's alerts on an incident's page, is in tests/test_metrics_prometheus.py.)"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ui.alerts import AlertmanagerUnreachable, firing_alerts


def test_no_alertmanager_at_the_url_is_one_line_naming_it_and_the_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(AlertmanagerUnreachable) as err:
        firing_alerts(f"http://127.0.0.1:{port}")
    text = str(err.value)
    assert "\n" not in text and f"127.0.0.1:{port}" in text and "resihp ops up" in text


def test_a_server_that_is_not_alertmanager_is_refused_with_a_reason() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "success"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(AlertmanagerUnreachable, match="did not answer a list of alerts"):
            firing_alerts(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()
