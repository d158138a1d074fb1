"""The API's request size limit on the real ASGI server (uvicorn): a body over
``GPULAB_API_MAX_BODY_BYTES`` is refused with 413 before it is read, whether
its Content-Length announces it or it comes chunked without one. (Django's
ASGI handler reads, and spools to disk, the whole body before any Django
middleware runs, so the limit is enforced in front of it.)"""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.e2e.conftest import Stack

LIMIT = 4096

# The stack's web process has a small body limit.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.web_env(GPULAB_API_MAX_BODY_BYTES=LIMIT),
    pytest.mark.web_only,
]


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(status_line.split()[1]), headers, rest[:length]


def test_an_announced_large_body_is_refused_before_it_is_sent(
    stack: Stack, alice: User
) -> None:
    from portal.api import tokens

    secret = tokens.create_token(alice, "t", None)[1]
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.settimeout(30)  # the failure this test looks for is a server waiting
        # 1 GB announced, one byte sent: the answer must not wait for the rest
        sock.sendall(
            b"POST /api/v1/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {secret}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n"
            b"\r\n{"
        )
        status, headers, body = read_response(sock)
    assert status == 413
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {
        "error": "too_large",
        "detail": f"The request body is 1000000000 bytes; the limit is {LIMIT} bytes.",
        "fields": {},
    }


def test_a_chunked_body_over_the_limit_is_refused(
    stack: Stack, alice: User, cluster: list[Node]
) -> None:
    from portal.api import tokens
    from scheduler.models import Job

    secret = tokens.create_token(alice, "t", None)[1]
    job = {"name": "x", "command": "y" * (2 * LIMIT), "workdir": "/tmp"}
    payload = json.dumps(job).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for i in range(0, len(payload), 1000):
            yield payload[i : i + 1000]

    got = httpx.post(
        f"{stack.base_url}/api/v1/jobs/",
        content=chunks(),
        headers={
            "Authorization": f"Bearer {secret}",
            "Content-Type": "application/json",
        },
        timeout=30,
    )
    assert got.status_code == 413, got.text
    assert got.json()["error"] == "too_large"
    assert not Job.objects.exists()
    # and a chunked body under the limit is read whole (not taken as empty)
    small = json.dumps({**job, "command": "echo hi"}).encode()
    ok = httpx.post(
        f"{stack.base_url}/api/v1/jobs/",
        content=iter([small[:10], small[10:]]),
        headers={
            "Authorization": f"Bearer {secret}",
            "Content-Type": "application/json",
        },
        timeout=30,
    )
    assert ok.status_code == 201, ok.text
    assert Job.objects.get().command == "echo hi"
