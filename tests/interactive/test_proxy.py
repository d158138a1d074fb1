"""The proxy (portal.interactive.proxy) in front of a real upstream server (a
small ASGI app under uvicorn standing in for a node's JupyterLab: it echoes
what it was sent), driven as the ASGI app the web process runs, on this run's
PostgreSQL: who gets through, what is forwarded, what is taken out, the cap."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import uvicorn
from django.contrib.auth.models import Permission
from django.test import Client

from portal.idle import activity
from portal.interactive.proxy import InteractiveProxy
from scheduler import services
from scheduler.models import Attempt, Job, JobEvent
from tests.e2e.conftest import free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from django.contrib.auth.models import User

    from scheduler.models import Node

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "the-node-token-" + "x" * 30
HOST = "127.0.0.1:8000"


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echo: an HTTP request's method, path, headers and body as JSON (or an
    HTML page quoting its token for /page); a websocket's frames back."""
    if scope["type"] == "lifespan":
        return
    if scope["type"] == "websocket":
        await receive()
        if scope["path"].endswith("/slow/channels"):
            # A kernel still starting: JupyterLab accepts its socket once the
            # kernel answers.
            await asyncio.sleep(1.0)
        protocols = scope.get("subprotocols") or [None]
        await send({"type": "websocket.accept", "subprotocol": protocols[0]})
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                return
            await send({"type": "websocket.send", "text": "echo:" + msg["text"]})
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    if scope["path"].endswith("/page"):
        out = f'<html><script>{{"token": "{TOKEN}"}}</script></html>'.encode()
        kind = b"text/html"
    else:
        out = json.dumps(
            {"method": scope["method"], "path": scope["path"], "headers": headers,
             "body": body.decode()}
        ).encode()  # fmt: skip
        kind = b"application/json"
    await send(
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", kind), (b"set-cookie", b"_xsrf=abc")]}
    )  # fmt: skip
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(upstream_app, host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


async def _downstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise AssertionError(f"{scope['path']} reached the app behind the proxy")


def running_jupyter(owner: User, node: Node, port: int) -> Job:
    job = services.submit_job(owner, services.interactive_request("jupyter"))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    Attempt.objects.create(
        job=job, number=1, node=node, interactive_host="127.0.0.1",
        interactive_port=port, interactive_command="jupyter lab",
    )  # fmt: skip
    Job.objects.filter(pk=job.pk).update(interactive_token=TOKEN)
    return job


def session_of(user: User) -> str:
    client = Client()
    client.force_login(user)
    return str(client.cookies["sessionid"].value)


def call(
    proxy: InteractiveProxy,
    method: str,
    path: str,
    *,
    session: str | None = None,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> httpx.Response:
    cookies = f"sessionid={session}; csrftoken=csrf1; _xsrf=abc" if session else ""

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(
            transport=transport, base_url=f"http://{HOST}"
        ) as client:
            try:
                return await client.request(
                    method,
                    path,
                    headers={
                        **({"cookie": cookies} if cookies else {}),
                        **(headers or {}),
                    },
                    content=body or None,
                )
            finally:
                await proxy.aclose()  # its client belongs to this loop

    return asyncio.run(run())


def proxy() -> InteractiveProxy:
    return InteractiveProxy(http=_downstream, websocket=_downstream)


def test_the_owner_reaches_the_server_with_the_token_and_without_portal_cookies(
    alice: User, cluster: list[Node], upstream: int
) -> None:
    job = running_jupyter(alice, cluster[0], upstream)
    got = call(
        proxy(), "GET", f"/interactive/{job.pk}/api/status?x=1",
        session=session_of(alice), headers={"accept-encoding": "gzip"},
    )  # fmt: skip
    assert got.status_code == 200
    seen = got.json()
    assert seen["path"] == f"/interactive/{job.pk}/api/status"
    assert seen["headers"]["authorization"] == f"token {TOKEN}"
    assert seen["headers"]["host"] == f"127.0.0.1:{upstream}"
    assert seen["headers"]["cookie"] == "_xsrf=abc"  # the portal's are not sent
    assert seen["headers"]["accept-encoding"] == "identity"  # pages come back plain
    assert got.headers["set-cookie"] == "_xsrf=abc"
    # Reading is not a person's use (JupyterLab polls while a tab is open)...
    assert activity.last_used([job.pk]) == {}
    # ...a save is, which the idle culling counts.
    saved = call(
        proxy(), "PUT", f"/interactive/{job.pk}/api/contents/a.ipynb",
        session=session_of(alice), body=b"{}",
    )  # fmt: skip
    assert saved.status_code == 200
    assert list(activity.last_used([job.pk])) == [job.pk]


def test_the_token_is_taken_out_of_html_pages(
    alice: User, cluster: list[Node], upstream: int
) -> None:
    job = running_jupyter(alice, cluster[0], upstream)
    got = call(proxy(), "GET", f"/interactive/{job.pk}/page", session=session_of(alice))
    assert got.status_code == 200
    assert TOKEN not in got.text
    assert '{"token": ""}' in got.text
    assert got.headers["content-length"] == str(len(got.content))


def test_others_get_404_and_staff_get_through_only_by_permission_audited(
    alice: User, bob: User, admin_user: User, cluster: list[Node], upstream: int
) -> None:
    job = running_jupyter(alice, cluster[0], upstream)
    p = proxy()
    path = f"/interactive/{job.pk}/api/status"
    assert call(p, "GET", path, session=session_of(bob)).status_code == 404
    assert call(p, "GET", f"/interactive/{job.pk + 9}/", session=session_of(alice)).status_code == 404  # fmt: skip
    admin_user.is_superuser = False
    admin_user.save()
    staff = session_of(admin_user)
    assert call(p, "GET", path, session=staff).status_code == 404
    assert not JobEvent.objects.filter(actor=admin_user).exists()

    admin_user.user_permissions.add(
        Permission.objects.get(codename="open_any_interactive")
    )
    fresh = proxy()  # a new lookup (answers are kept per session)
    assert call(fresh, "GET", path, session=staff).status_code == 200
    assert call(fresh, "GET", path + "?again", session=staff).status_code == 200
    events = JobEvent.objects.filter(job=job, actor=admin_user)
    assert [e.message for e in events] == [
        f"interactive job opened by staff member {admin_user.username}"
        " (permission open_any_interactive)"
    ]


def test_a_cross_site_request_is_refused_and_a_same_site_one_forwarded(
    alice: User, cluster: list[Node], upstream: int
) -> None:
    job = running_jupyter(alice, cluster[0], upstream)
    session = session_of(alice)
    path = f"/interactive/{job.pk}/api/contents/x.ipynb"
    evil = call(
        proxy(), "PUT", path, session=session,
        headers={"origin": "https://evil.example"}, body=b"{}",
    )  # fmt: skip
    assert evil.status_code == 403
    ok = call(
        proxy(), "PUT", path, session=session,
        headers={"origin": f"http://{HOST}"}, body=b'{"type": "file"}',
    )  # fmt: skip
    assert ok.status_code == 200
    assert (ok.json()["method"], ok.json()["body"]) == ("PUT", '{"type": "file"}')


def test_waiting_and_ended_jobs_get_a_page_that_says_so(
    alice: User, cluster: list[Node], upstream: int, settings: Any
) -> None:
    settings.GPULAB_INTERACTIVE_MAX_PER_USER = 3
    session = session_of(alice)
    waiting = services.submit_job(alice, services.interactive_request("jupyter"))
    got = call(proxy(), "GET", f"/interactive/{waiting.pk}/lab", session=session)
    assert got.status_code == 503
    assert "not running yet" in got.text and 'http-equiv="refresh"' in got.text
    ended = running_jupyter(alice, cluster[0], upstream)
    Job.objects.filter(pk=ended.pk).update(
        status=Job.Status.TIMEOUT, end_reason="time limit reached"
    )
    got = call(proxy(), "GET", f"/interactive/{ended.pk}/lab", session=session)
    assert got.status_code == 410
    assert "timeout: time limit reached" in got.text
    shell = services.submit_job(alice, services.interactive_request("shell"))
    got = call(proxy(), "GET", f"/interactive/{shell.pk}/lab", session=session)
    assert got.status_code == 404  # a terminal job has no web server


class Outbox:
    """What the proxy sends to the browser, awaited message by message (no
    polling)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()

    async def send(self, message: dict[str, Any]) -> None:
        async with self.changed:
            self.sent.append(message)
            self.changed.notify_all()

    async def until(
        self, wanted: Callable[[dict[str, Any]], bool], timeout: float = 10
    ) -> None:
        """Return once a message sent so far is ``wanted``."""
        async with asyncio.timeout(timeout), self.changed:
            await self.changed.wait_for(lambda: any(map(wanted, self.sent)))


def test_websockets_are_relayed_and_the_cap_answers_503(
    alice: User, cluster: list[Node], upstream: int, settings: Any
) -> None:
    settings.GPULAB_INTERACTIVE_PROXY_MAX = 1
    job = running_jupyter(alice, cluster[0], upstream)
    session = session_of(alice)
    p = proxy()

    async def run() -> tuple[list[dict[str, Any]], int]:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        out = Outbox()
        sent = out.sent
        scope = {
            "type": "websocket",
            "path": f"/interactive/{job.pk}/api/kernels/k1/channels",
            "raw_path": f"/interactive/{job.pk}/api/kernels/k1/channels".encode(),
            "query_string": b"session_id=s1",
            "headers": [
                (b"host", HOST.encode()),
                (b"origin", f"http://{HOST}".encode()),
                (b"cookie", f"sessionid={session}".encode()),
            ],
            "subprotocols": ["v1.kernel.websocket.jupyter.org"],
        }
        await inbox.put({"type": "websocket.connect"})
        task = asyncio.ensure_future(p(scope, inbox.get, out.send))
        await out.until(lambda m: m["type"] == "websocket.accept")
        await inbox.put({"type": "websocket.receive", "text": "hello"})
        await out.until(lambda m: m.get("text") == "echo:hello")
        # The socket holds the job's one place: a page request is refused.
        transport = httpx.ASGITransport(app=p)
        async with httpx.AsyncClient(
            transport=transport, base_url=f"http://{HOST}"
        ) as client:
            busy = await client.get(
                f"/interactive/{job.pk}/lab",
                headers={"cookie": f"sessionid={session}"},
            )
        await inbox.put({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(task, 10)
        await p.aclose()
        return sent, busy.status_code

    sent, busy = asyncio.run(run())
    assert sent[0] == {
        "type": "websocket.accept",
        "subprotocol": "v1.kernel.websocket.jupyter.org",
    }
    assert {"type": "websocket.send", "text": "echo:hello"} in sent
    assert busy == 503
    assert p.active == {}  # the place is given back
    # The browser's frame (a cell to run) is the job's use.
    assert list(activity.last_used([job.pk])) == [job.pk]


def test_a_notebook_socket_closes_when_its_user_is_deactivated(
    alice: User, cluster: list[Node], upstream: int
) -> None:
    """A removal at the directory or identity provider closes the open kernel
    socket (4401, as the live pages'), not only the next request."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    from portal.directory.identity import deactivate_user

    job = running_jupyter(alice, cluster[0], upstream)
    session = session_of(alice)
    p = proxy()

    async def run() -> list[dict[str, Any]]:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        out = Outbox()
        sent = out.sent

        path = f"/interactive/{job.pk}/api/kernels/k1/channels"
        scope = {
            "type": "websocket", "path": path, "raw_path": path.encode(),
            "query_string": b"", "subprotocols": [],
            "headers": [
                (b"host", HOST.encode()), (b"origin", f"http://{HOST}".encode()),
                (b"cookie", f"sessionid={session}".encode()),
            ],
        }  # fmt: skip
        await inbox.put({"type": "websocket.connect"})
        task = asyncio.ensure_future(p(scope, inbox.get, out.send))
        await out.until(lambda m: m["type"] == "websocket.accept")
        await inbox.put({"type": "websocket.receive", "text": "hello"})
        await out.until(lambda m: m.get("text") == "echo:hello")
        await sync_to_async(deactivate_user)(alice, "removed from the directory")
        await out.until(lambda m: m["type"] == "websocket.close")
        await inbox.put({"type": "websocket.disconnect", "code": 4401})
        await asyncio.wait_for(task, 10)
        await p.aclose()
        await sync_to_async(connections.close_all)()  # deactivate_user's thread
        return sent

    sent = asyncio.run(run())
    assert sent[-1] == {"type": "websocket.close", "code": 4401}
    assert p.active == {}


def test_a_kernel_socket_that_jupyterlab_accepts_late_is_still_relayed(
    alice: User, cluster: list[Node], upstream: int, settings: Any
) -> None:
    """The connect timeout bounds reaching the node, not JupyterLab's answer:
    a kernel that starts slowly on a busy node still gets its socket."""
    settings.GPULAB_INTERACTIVE_CONNECT_TIMEOUT = 0.3
    job = running_jupyter(alice, cluster[0], upstream)
    session = session_of(alice)
    p = proxy()

    async def run() -> list[dict[str, Any]]:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        out = Outbox()
        sent = out.sent

        path = f"/interactive/{job.pk}/api/kernels/slow/channels"
        scope = {
            "type": "websocket", "path": path, "raw_path": path.encode(),
            "query_string": b"", "subprotocols": [],
            "headers": [
                (b"host", HOST.encode()), (b"cookie", f"sessionid={session}".encode()),
            ],
        }  # fmt: skip
        await inbox.put({"type": "websocket.connect"})
        task = asyncio.ensure_future(p(scope, inbox.get, out.send))
        await out.until(lambda m: True)
        if sent[0]["type"] == "websocket.accept":
            await inbox.put({"type": "websocket.receive", "text": "hello"})
            await out.until(lambda m: m.get("text") == "echo:hello")
            await inbox.put({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(task, 10)
        await p.aclose()
        return sent

    sent = asyncio.run(run())
    assert sent[0]["type"] == "websocket.accept", sent
    assert {"type": "websocket.send", "text": "echo:hello"} in sent
