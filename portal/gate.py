"""ASGI: how many HTTP requests run in Django at once, per lane.

Django's ASGI handler runs each request's synchronous code in a thread of its
own, with a PostgreSQL connection of its own. Without a bound, a burst of API
submissions (bench/submit_burst.py: 10,000 in a minute) puts hundreds of
requests in threads at once: each opens a connection until PostgreSQL refuses
more (503 "database unavailable"), they all share the one GIL, and a page takes
seconds. So at most ``GPULAB_WEB_API_CONCURRENCY`` API requests (``/api/``) and
``GPULAB_WEB_PAGE_CONCURRENCY`` other requests (pages, forms, static files) run
at once in each web process; the others wait their turn in the event loop
(first come, first served, no thread, no connection). The lanes are separate,
so a queue of API calls never holds up a page, and pages come first: while one
runs, the API lane starts no more than ``API_BESIDE_PAGES`` (1) at once, so a
page shares the process's one GIL with at most that many calls it did not find
running (in a burst, a page's own time is 2-4 times its idle time beside four).
A lane with ``GPULAB_WEB_QUEUE`` requests already waiting answers the next at
once: 503 with ``Retry-After`` (the API's JSON error body under ``/api/``).

One client may hold at most ``GPULAB_WEB_API_PER_CLIENT`` places in the API
lane (running or waiting): its next call is answered at once with 429 and
``Retry-After``, the API's ``throttled`` body. A client is its credential (the
``Authorization`` header, else the session cookie), else its address: people
behind one address (a login node) are told apart by their tokens. So one user's
script cannot fill the queue that everyone's calls wait in, and it is told to slow
down (429) where the server as a whole is not out of room (503). The per-token rate
limit (``portal/api/throttling.py``) counts requests over a minute; this counts
requests at once, before anything runs, with no Redis round trip.
In a capped lane one client also *runs* at most all but one of the lane's places
(``client_running_cap``), and a freed place goes to the longest-waiting request
whose client is under that cap: a script holding its full share cannot make
another user's call wait for one of its slow requests to finish.
Websockets are not counted: they are long-lived and run no thread per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter, deque
from typing import TYPE_CHECKING

from django.conf import settings

from portal.api.errors import body

if TYPE_CHECKING:
    from portal.api.middleware import AsgiApp, Receive, Scope, Send

API_PREFIX = "/api/"
RETRY_AFTER_S = 1
# API requests that may run while a page does (pages first; the API still moves).
API_BESIDE_PAGES = 1


class Lane:
    """Requests of one kind: how many run, and the queue of those waiting."""

    def __init__(
        self, name: str, running: int, waiting: int, per_client: int = 0
    ) -> None:
        self.name = name
        self.limit = running
        self.max_waiting = waiting
        # places (running or waiting) one client may hold; 0: no cap
        self.per_client = per_client
        self.running = 0
        # waiting requests in arrival order: (client, turn)
        self.queue: deque[tuple[bytes, asyncio.Future[None]]] = deque()
        self.clients: Counter[bytes] = Counter()  # places held, running or waiting
        self.running_by: Counter[bytes] = Counter()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def client_running_cap(self) -> int:
        """How many of the lane's places one client may run at once: all but one
        when clients are capped (so another client always finds one), else all."""
        if not self.per_client:
            return self.limit
        return max(1, self.limit - 1)

    def may_run(self, client: bytes) -> bool:
        return self.running_by[client] < self.client_running_cap


class ConcurrencyGate:
    """Wraps the HTTP application (``portal/asgi.py``)."""

    def __init__(
        self,
        app: AsgiApp,
        *,
        api: int | None = None,
        pages: int | None = None,
        queue: int | None = None,
        per_client: int | None = None,
    ) -> None:
        self.app = app
        waiting = settings.GPULAB_WEB_QUEUE if queue is None else queue
        self.api = Lane(
            "api",
            settings.GPULAB_WEB_API_CONCURRENCY if api is None else api,
            waiting,
            settings.GPULAB_WEB_API_PER_CLIENT if per_client is None else per_client,
        )
        self.pages = Lane(
            "pages",
            settings.GPULAB_WEB_PAGE_CONCURRENCY if pages is None else pages,
            waiting,
        )

    def lane(self, scope: Scope) -> Lane:
        return self.api if scope["path"].startswith(API_PREFIX) else self.pages

    def limit(self, lane: Lane) -> int:
        """How many of ``lane`` may run now: pages come first, so while one runs
        the API lane starts no more than ``API_BESIDE_PAGES`` at once."""
        if lane is self.api and self.pages.running:
            return min(lane.limit, API_BESIDE_PAGES)
        return lane.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lane = self.lane(scope)
        if not lane.per_client:
            await self._run(lane, b"", scope, receive, send)
            return
        client = client_key(scope)
        if lane.clients[client] >= lane.per_client:
            await _refuse(send, api=lane is self.api, per_client=lane.per_client)
            return
        lane.clients[client] += 1
        try:
            await self._run(lane, client, scope, receive, send)
        finally:
            lane.clients[client] -= 1
            if not lane.clients[client]:
                del lane.clients[client]

    async def _run(
        self, lane: Lane, client: bytes, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """The request in its turn, or 503 at once if ``lane``'s queue is full."""
        if not await self._enter(lane, client):
            await _refuse(send, api=lane is self.api)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._leave(lane, client)

    async def _enter(self, lane: Lane, client: bytes) -> bool:
        """Wait for a turn in ``lane``; False (at once) if its queue is full."""
        if (
            lane.running < self.limit(lane)
            and lane.may_run(client)
            and not any(lane.may_run(c) for c, t in lane.queue if not t.done())
        ):
            self._start(lane, client)
            return True
        if lane.waiting >= lane.max_waiting:
            return False
        turn = asyncio.get_running_loop().create_future()
        entry = (client, turn)
        lane.queue.append(entry)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                # still queued, unless a dispatch already dropped it
                with contextlib.suppress(ValueError):
                    lane.queue.remove(entry)
            else:  # given its turn as it was cancelled: hand the turn on
                self._leave(lane, client)
            raise
        return True

    @staticmethod
    def _start(lane: Lane, client: bytes) -> None:
        lane.running += 1
        lane.running_by[client] += 1

    def _leave(self, lane: Lane, client: bytes) -> None:
        lane.running -= 1
        lane.running_by[client] -= 1
        if not lane.running_by[client]:
            del lane.running_by[client]
        self._dispatch()

    def _dispatch(self) -> None:
        """Start waiting requests while their lane has room, pages first; in each
        lane the longest-waiting one whose client may run one more."""
        for lane in (self.pages, self.api):
            while lane.queue and lane.running < self.limit(lane):
                for entry in lane.queue:
                    client, turn = entry
                    if turn.done() or lane.may_run(client):
                        break
                else:
                    break  # every waiting client is at its running cap
                lane.queue.remove(entry)
                if turn.done():  # cancelled (the client went away) but its
                    continue  # task has not run since: it takes no place
                self._start(lane, client)
                turn.set_result(None)


def client_key(scope: Scope) -> bytes:
    """Who sends a request, for the per-client cap: its ``Authorization`` header,
    else its session cookie, else its address."""
    cookie = b""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name == b"authorization" and value:
            return b"auth " + value
        if name == b"cookie":
            cookie = value
    session = settings.SESSION_COOKIE_NAME.encode() + b"="
    for part in cookie.split(b";"):
        part = part.strip()
        if part.startswith(session) and len(part) > len(session):
            return b"session " + part[len(session) :]
    client = scope.get("client")
    return b"addr " + (client[0] if client else "").encode()


async def _refuse(send: Send, *, api: bool, per_client: int = 0) -> None:
    """503 ``busy`` (the lane's queue is full) or, for a client over its cap,
    429 ``throttled``; both with ``Retry-After``."""
    if per_client:
        status, code = 429, "throttled"
        detail = (
            f"Too many requests at once from this client (at most {per_client}); "
            f"try again in {RETRY_AFTER_S} s."
        )
    else:
        status, code = 503, "busy"
        detail = f"The server is busy; try again in {RETRY_AFTER_S} s."
    if api:
        payload = json.dumps(body(code, detail))
        kind = b"application/json"
    else:
        payload = detail + "\n"
        kind = b"text/plain; charset=utf-8"
    data = payload.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(data)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
