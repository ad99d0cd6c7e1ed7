"""Whether the hub can be reached: offline mode, or one quick probe that any HTTP answer satisfies."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from homerlhf import hub


class _NotFound(BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's naming
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_probe_says_why_the_hub_cannot_be_reached_and_is_kept_a_minute(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert hub.hub_unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_HUB_PROBES", {})
    with socket.socket() as sock:  # a port nothing listens on: refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    assert hub.hub_unreachable() == f"no answer from http://127.0.0.1:{port}: ConnectError"
    assert time.monotonic() - start < hub.HUB_PROBE_TIMEOUT_S
    server = HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub.hub_unreachable() == ""  # a 404 is an answer: the hub is there
        server.shutdown()
        assert hub.hub_unreachable() == ""  # the answer is kept a minute: no second probe
    finally:
        server.server_close()
