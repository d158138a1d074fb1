"""The portal's reverse proxy to interactive jobs' JupyterLab: ``/interactive/<id>/``.

A raw ASGI app in front of everything else (``portal.asgi``): HTTP requests are
streamed to the node with one shared ``httpx.AsyncClient`` and websockets
(kernels, terminals) relayed with the ``websockets`` library, all on the event
loop: no thread per request, and outside the web gate's page and API lanes, so
a JupyterLab page load (dozens of requests) never queues other users' pages.

- **Access** (``access.resolve``, in a small thread pool of its own, never the
  one Django's views share): the session cookie's user must own the job (or be
  staff with ``open_any_interactive``, audited); anyone else gets 404. An
  answer is kept ``CACHE_S`` seconds per session and job, so a page load costs
  one lookup, and a job that ends is refused within that time.
- **Secrets**: the portal presents the job's token (``Authorization: token``)
  to JupyterLab; the browser never sees it (JupyterLab writes it into its HTML
  pages' configuration: the proxy takes it out of every HTML response). The portal's own cookies (session,
  CSRF) are not forwarded: a JupyterLab runs the user's code, and must never see
  the session of a staff member who opens it.
- **Cross-site requests**: a request whose ``Origin`` is not this host (a form
  or script of another site riding on the session cookie) is refused with 403,
  for websockets and state-changing methods alike: JupyterLab's own XSRF check
  does not apply to token-authenticated requests.
- **Concurrency**: at most ``GPULAB_INTERACTIVE_PROXY_MAX`` requests and
  websockets at once per job in this process; beyond, 503 with a clear message.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import re
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.cookies import CookieError, SimpleCookie
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx
import websockets
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.shortcuts import resolve_url
from redis.exceptions import RedisError

from portal.directory.identity import user_group
from portal.idle import activity
from portal.interactive.access import Refusal, Target, resolve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping

    Scope = MutableMapping[str, Any]
    Receive = Callable[[], Awaitable[Any]]
    Send = Callable[[Any], Awaitable[None]]
    AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]

PREFIX = "/interactive/"
_PATH = re.compile(r"^/interactive/(\d{1,12})(/.*)?$")
CACHE_S = 5.0
# A request (or a websocket's opening handshake) may wait this long for the
# node's answer once connected: JupyterLab accepts a kernel's socket only once
# the kernel answers (its kernel_info_timeout, 60 s), and a busy node's kernel
# may take longer than the connection's bound (GPULAB_INTERACTIVE_CONNECT_TIMEOUT).
ANSWER_TIMEOUT_S = 300.0
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Not forwarded either way (RFC 9110 7.6.1), or set by the proxy itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "authorization",
        "cookie",
        "origin",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    }
)
# Websocket handshake headers the websockets library writes itself.
WS_OWN = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        "content-length",
    }
)

_lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="interactive")


log = logging.getLogger(__name__)
# A notebook's socket closed because its user was deactivated (as the live pages').
CLOSE_SIGNED_OUT = 4401
# Requests that change nothing: not counted as a person's use.
READS = frozenset({"GET", "HEAD", "OPTIONS"})


class InteractiveProxy:
    """Serves ``/interactive/...`` (HTTP and websockets); passes the rest on to
    ``http`` or ``websocket``."""

    def __init__(self, *, http: AsgiApp, websocket: AsgiApp) -> None:
        self.apps = {"http": http, "websocket": websocket}
        self.active: Counter[int] = Counter()
        self._cache: dict[tuple[str, int], tuple[float, Target]] = {}
        self._client: httpx.AsyncClient | None = None
        self._resolve = sync_to_async(
            resolve, thread_sensitive=False, executor=_lookups
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if not scope["path"].startswith(PREFIX):
            await self.apps[kind](scope, receive, send)
            return
        match = _PATH.match(scope["path"])
        if match is None:
            await self._refuse(scope, receive, send, _not_found())
            return
        job_id = int(match.group(1))
        if match.group(2) is None and kind == "http":
            await _redirect(send, f"{PREFIX}{job_id}/")
            return
        if not _same_origin(scope):
            refusal = Refusal(
                403, "Cross-site request refused", "The request came from another site."
            )
            await self._refuse(scope, receive, send, refusal)
            return
        target = await self._target(scope, job_id)
        if isinstance(target, Refusal):
            await self._refuse(scope, receive, send, target)
            return
        cap = settings.GPULAB_INTERACTIVE_PROXY_MAX
        if self.active[job_id] >= cap:
            busy = Refusal(
                503,
                "Too many requests at once",
                f"Job #{job_id}'s JupyterLab already has {cap} requests and"
                " connections open through the portal (GPULAB_INTERACTIVE_PROXY_MAX);"
                " try again in a moment.",
                retry=True,
            )
            await self._refuse(scope, receive, send, busy)
            return
        self.active[job_id] += 1
        try:
            if kind == "http" and scope["method"] not in READS:
                # A save or a new notebook is the job's use; JupyterLab's own
                # polling (GETs, every few seconds while a tab is open) is not.
                await activity.atouch(job_id)
            if kind == "http":
                await self._http(scope, receive, send, target)
            else:
                await self._websocket(scope, receive, send, target)
        finally:
            self.active[job_id] -= 1
            if self.active[job_id] <= 0:
                del self.active[job_id]

    # ------------------------------------------------------------ access

    async def _target(
        self, scope: Scope, job_id: int, *, fresh: bool = False
    ) -> Target | Refusal:
        """The lookup for this session and job (``fresh``: not the kept one)."""
        key = _cookie(scope, settings.SESSION_COOKIE_NAME)
        now = time.monotonic()
        if key is not None and fresh:
            self._cache.pop((key, job_id), None)
        elif key is not None:
            hit = self._cache.get((key, job_id))
            if hit is not None and hit[0] > now:
                return hit[1]
        got: Target | Refusal = await self._resolve(key, job_id)
        if isinstance(got, Target) and key is not None:
            if len(self._cache) > 10_000:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            self._cache[(key, job_id)] = (now + CACHE_S, got)
        return got

    # ------------------------------------------------------------ HTTP

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    ANSWER_TIMEOUT_S,
                    connect=settings.GPULAB_INTERACTIVE_CONNECT_TIMEOUT,
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    async def _http(
        self, scope: Scope, receive: Receive, send: Send, target: Target
    ) -> None:
        method = scope["method"]
        headers = _forward_headers(scope, target)
        has_body = any(
            name in (b"content-length", b"transfer-encoding")
            for name, _ in scope["headers"]
        )
        url = _upstream_url("http", target, scope)
        request = self.client.build_request(
            method,
            url,
            headers=headers,
            content=_body(receive) if has_body else None,
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            # The job may have ended since its lookup was kept: ask again.
            again = await self._target(scope, target.job_id, fresh=True)
            if isinstance(again, Refusal):
                await _page(send, again)
                return
            starting = Refusal(
                502,
                "JupyterLab does not answer",
                f"Job #{target.job_id}'s JupyterLab at {target.host}:{target.port}"
                f" does not answer ({type(exc).__name__}); it may still be starting.",
                retry=True,
            )
            await _page(send, starting)
            return
        try:
            headers = [
                (k, v)
                for k, v in response.headers.raw
                if k.lower().decode("latin-1") not in HOP_BY_HOP
            ]
            if response.headers.get("content-type", "").startswith("text/html"):
                await _send_scrubbed(send, response, headers, target.token)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": headers,
                }
            )
            async for chunk in response.aiter_raw():
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                )
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    # ------------------------------------------------------------ websockets

    async def _websocket(
        self, scope: Scope, receive: Receive, send: Send, target: Target
    ) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in _forward_headers(scope, target)
            if k.decode("latin-1").lower() not in WS_OWN
        ]
        try:
            # The connection is bounded as for HTTP; the handshake then waits
            # for JupyterLab as long as a request does (ANSWER_TIMEOUT_S).
            sock = await _connect(target.host, target.port)
            upstream = await websockets.connect(
                _upstream_url("ws", target, scope),
                sock=sock,
                additional_headers=headers,
                subprotocols=scope.get("subprotocols") or None,
                open_timeout=ANSWER_TIMEOUT_S,
                max_size=None,
                compression=None,
                ping_interval=None,
                user_agent_header=None,
            )
        except (OSError, websockets.InvalidHandshake, TimeoutError):
            again = await self._target(scope, target.job_id, fresh=True)
            code = 4000 + again.status if isinstance(again, Refusal) else 1011
            await send({"type": "websocket.close", "code": code})
            return
        async with upstream:
            await send(
                {"type": "websocket.accept", "subprotocol": upstream.subprotocol}
            )
            await _relay(receive, send, upstream, target.job_id, target.user_id)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, refusal: Refusal
    ) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            # 4000 + the HTTP status: a client can tell 404 from 503.
            await send({"type": "websocket.close", "code": 4000 + refusal.status})
            return
        if refusal.login:
            path = scope["path"]
            login = resolve_url(settings.LOGIN_URL)
            await _redirect(send, f"{login}?next={quote(path)}")
            return
        await _page(send, refusal)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def _relay(
    receive: Receive,
    send: Send,
    upstream: websockets.ClientConnection,
    job_id: int,
    user_id: int,
) -> None:
    """Frames both ways until either side closes; then the other is closed. A
    frame from the browser (a cell to run, a keystroke in Jupyter's terminal) is
    the job's use, which the idle culling counts."""

    async def browser_to_node() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close()
                return
            await activity.atouch(job_id)
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    async def node_to_browser() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in upstream:
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await send(
                {"type": "websocket.close", "code": code if code != 1005 else 1000}
            )

    async def signed_out() -> None:
        """The user's account deactivated (directory, identity provider): the
        notebook's socket closes (4401), as the portal's live pages do."""
        layer = get_channel_layer()
        assert layer is not None  # CHANNEL_LAYERS is always configured
        group = user_group(user_id)
        try:
            channel = await layer.new_channel()
            await layer.group_add(group, channel)
        except (RedisError, OSError) as exc:
            # The session is checked again at the next connection.
            log.warning("job %s: cannot watch for sign-out: %r", job_id, exc)
            await asyncio.Event().wait()
        try:
            while (await layer.receive(channel)).get("type") != "user.signed_out":
                pass
        finally:
            with contextlib.suppress(RedisError, OSError):
                await layer.group_discard(group, channel)
        await upstream.close()
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": CLOSE_SIGNED_OUT})

    tasks = [
        asyncio.ensure_future(browser_to_node()),
        asyncio.ensure_future(node_to_browser()),
        asyncio.ensure_future(signed_out()),
    ]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    del pending


# ---------------------------------------------------------------- helpers


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    with contextlib.suppress(CookieError):
        jar.load(raw)
    morsel = jar.get(name)
    return morsel.value if morsel is not None else None


def _same_origin(scope: Scope) -> bool:
    """No Origin (not a browser's cross-site request), or Origin is this host.
    A browser sends Origin with every websocket and every state-changing fetch."""
    if scope["type"] == "http" and scope["method"] in SAFE_METHODS:
        return True
    origin = _header(scope, b"origin")
    if origin is None:
        return True
    host = _header(scope, b"host") or ""
    return urlsplit(origin).netloc.lower() == host.lower() and bool(host)


def _forward_headers(scope: Scope, target: Target) -> list[tuple[bytes, bytes]]:
    """The browser's headers minus hop-by-hop ones, the portal's cookies and
    ``Accept-Encoding`` (pages come back plain, so the token can be taken out of
    them: ``_send_scrubbed``), plus the token; JupyterLab's own cookies pass."""
    portal_cookies = {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME}
    headers = [
        (k, v)
        for k, v in scope["headers"]
        if k.lower().decode("latin-1") not in HOP_BY_HOP
        and k.lower() != b"accept-encoding"
    ]
    raw = _header(scope, b"cookie")
    if raw:
        kept = []
        for part in raw.split(";"):
            name = part.split("=", 1)[0].strip()
            if name and name not in portal_cookies:
                kept.append(part.strip())
        if kept:
            headers.append((b"cookie", "; ".join(kept).encode("latin-1")))
    headers.append((b"accept-encoding", b"identity"))
    headers.append((b"authorization", f"token {target.token}".encode("ascii")))
    return headers


async def _connect(host: str, port: int) -> socket.socket:
    """A TCP connection to the node's server within
    ``GPULAB_INTERACTIVE_CONNECT_TIMEOUT`` (raises OSError or TimeoutError)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(settings.GPULAB_INTERACTIVE_CONNECT_TIMEOUT):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(0.0)  # non-blocking
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
    return sock


def _upstream_url(scheme: str, target: Target, scope: Scope) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    url = f"{scheme}://{host}:{target.port}{path.decode('latin-1')}"
    return url + (f"?{query.decode('latin-1')}" if query else "")


async def _send_scrubbed(
    send: Send,
    response: httpx.Response,
    headers: list[tuple[bytes, bytes]],
    token: str,
) -> None:
    """An HTML page with the token taken out: JupyterLab writes its token into
    its pages' configuration (``page_config``), which would hand it to the
    browser; without it the page's scripts send none, and the proxy adds it."""
    body = (await response.aread()).replace(token.encode(), b"")
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": headers,
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


async def _redirect(send: Send, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 302,
            "headers": [(b"location", location.encode("latin-1"))],
        }
    )
    await send({"type": "http.response.body", "body": b""})


def _not_found() -> Refusal:
    return Refusal(404, "Not found", "There is no such interactive job.")


async def _page(send: Send, refusal: Refusal) -> None:
    """A small page of our own: the title, the sentence, a link to the jobs; it
    reloads itself every few seconds when the server is on its way."""
    refresh = '<meta http-equiv="refresh" content="3">' if refusal.retry else ""
    body = (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>{html.escape(refusal.title)} · gpulab</title>{refresh}</head>"
        f"<body><h1>{html.escape(refusal.title)}</h1>"
        f"<p id=detail>{html.escape(refusal.detail)}</p>"
        '<p><a href="/jobs/">Your jobs</a></p></body></html>'
    ).encode()
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if refusal.retry:
        headers.append((b"retry-after", b"3"))
    await send(
        {"type": "http.response.start", "status": refusal.status, "headers": headers}
    )
    await send({"type": "http.response.body", "body": body})
