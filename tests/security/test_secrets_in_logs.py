"""Secrets never reach a log: every line the real processes print through the main
flows (a node's agent connecting and running a job, its token rotated, a user
logging in, saving a webhook and sending a signed notification, making and using
an API token), with the web
server at debug level, is searched for each secret. Node tokens are stored
hashed only."""

from __future__ import annotations

import http.server
import json
import re
import secrets
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
import pytest

from tests.e2e.conftest import csrf_post, login, submit, wait_for_job, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


class Receiver(http.server.BaseHTTPRequestHandler):
    """A webhook receiver that keeps what it got."""

    got: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.got.append({"headers": dict(self.headers), "body": body})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.got = []
    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


# The web server logs at debug level: websockets then logs every header. Webhooks
# to loopback are refused unless allowed (the receiver is local).
@pytest.mark.web_env(
    UVICORN_LOG_LEVEL="debug", GPULAB_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8"
)
def test_no_secret_is_logged_through_the_main_flows(
    stack: Stack, receiver: str, django_user_model: Any
) -> None:
    from scheduler import services
    from scheduler.models import Job, Node

    password = "pw-" + secrets.token_urlsafe(16)
    webhook_secret = "hook-" + secrets.token_urlsafe(24)
    django_user_model.objects.create_user("sam", "s@lab.example", password)
    web = stack.procs["web"]
    stack.env["GPULAB_WEBHOOK_ALLOWED_NETWORKS"] = "127.0.0.0/8"  # the notifier's
    stack.start_notifier()
    node, old_token = services.create_node("quiet-node")
    agent = stack.start_agent("quiet-node", old_token, "1xA100-80GB", "--verbose")
    agent.wait_for(r"connected to ws://")
    web.wait_for(r"authorization: \[redacted\]")  # the header was logged, blanked

    client = login(stack.base_url, "sam", password)
    job_id = submit(client, "hello", "echo hello")
    assert wait_for_job(job_id, set(Job.TERMINAL)) == "completed"
    saved = csrf_post(
        client,
        "/notifications/",
        {"kinds": ["job_failed"], "email_enabled": "", "webhook_url": receiver,
         "webhook_secret": webhook_secret},
    )  # fmt: skip
    assert saved.status_code == 302, saved.text
    assert csrf_post(client, "/notifications/test/", {}).status_code == 302
    wait_until(lambda: Receiver.got, what="the signed test notification")
    assert Receiver.got[0]["headers"]["X-Gpulab-Signature"].startswith("sha256=")
    made = csrf_post(client, "/tokens/", {"name": "laptop", "days": "1"})
    shown = re.search(r'data-testid="secret">([^<]+)<', made.text)
    assert shown, made.text
    api_secret = shown.group(1)
    listed = httpx.get(
        f"{stack.base_url}/api/v1/jobs/",
        headers={"Authorization": f"Bearer {api_secret}"},
    )
    assert listed.status_code == 200, listed.text  # the token really works
    new_token = services.rotate_node_token(node.pk)
    agent.wait_for(r"rejected the token")  # the live connection was cut
    node.refresh_from_db()
    assert old_token not in json.dumps(
        Node.objects.filter(pk=node.pk).values()[0], default=str
    )

    printed = "\n".join(line for proc in stack.procs.values() for line in proc.lines)
    assert "GET /ws/agent/" in printed or "/ws/agent/" in printed
    for name, secret in {
        "the node token": old_token,
        "the rotated node token": new_token,
        "the user's password": password,
        "the webhook secret": webhook_secret,
        "the API token": api_secret,
    }.items():
        assert secret not in printed, f"{name} was logged"
    session = client.cookies.get("sessionid")
    assert session and session not in printed, "a session cookie was logged"
