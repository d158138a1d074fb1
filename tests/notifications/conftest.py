"""A real HTTP server on loopback that records webhook requests."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_network
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers each POST with the next status of ``statuses`` (the last one
    repeats); while ``hang`` is set, holds each request until ``release`` is set."""

    url: str
    statuses: list[int] = field(default_factory=lambda: [200])
    requests: list[Received] = field(default_factory=list)
    hang: bool = False
    release: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)

    def status(self) -> int:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


LOOPBACK = (ip_network("127.0.0.0/8"), ip_network("::1/128"))


@pytest.fixture(autouse=True)
def _loopback_webhooks_allowed(settings: Any) -> None:
    """The test receiver listens on loopback, part of the portal's own network,
    where webhooks go only when configured: these tests configure it, as a lab
    with an internal receiver would (GPULAB_WEBHOOK_ALLOWED_NETWORKS)."""
    settings.GPULAB_WEBHOOK_ALLOWED_NETWORKS = LOOPBACK


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            state.requests.append(Received(self.path, dict(self.headers), body))
            state.arrived.set()
            if state.hang:
                state.release.wait(30)
            code = state.status()
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
