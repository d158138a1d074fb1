"""ASGI: how many HTTP requests run in Django at once, per lane, per client, and
how many heavy ones.

Django's ASGI handler runs each request's synchronous code in a thread of its
own, with a PostgreSQL connection of its own. Without a bound, a burst of API
submissions (bench/submit_burst.py: 10,000 in a minute) puts hundreds of
requests in threads at once: each opens a connection until PostgreSQL refuses
more (503 "database unavailable"), they all share the one GIL, and a page takes
seconds. So at most ``GPULAB_WEB_API_CONCURRENCY`` API requests (``/api/``) and
``GPULAB_WEB_PAGE_CONCURRENCY`` other requests (pages, forms, static files) run
at once in each web process; the others wait their turn in the event loop (no
thread, no connection). The lanes are separate, so a queue of API calls never
holds up a page, and pages come first: while one runs, the API lane starts no
more than ``API_BESIDE_PAGES`` (1) light calls at once, so a page shares the
process's one GIL with at most that many calls it did not find running (in a
burst, a page's own time is 2-4 times its idle time beside four). Heavy calls
and a client's calls beside its own page are bounded by the caps below instead.
A lane with ``GPULAB_WEB_QUEUE`` requests already waiting answers the next at
once: 503 with ``Retry-After`` (the API's JSON error body under ``/api/``).

Who waits for whom. A client is its credential (the ``Authorization`` header,
else the session cookie), else its address: people behind one address (a login
node) are told apart by their tokens.

- One client may hold at most ``GPULAB_WEB_API_PER_CLIENT`` places in the API
  lane (running or waiting): its next call is answered at once with 429 and
  ``Retry-After``, the API's ``throttled`` body. So one user's script cannot
  fill the queue that everyone's calls wait in, and it is told to slow down
  (429) where the server as a whole is not out of room (503). The per-token rate
  limit (``portal/api/throttling.py``) counts requests over a minute; this counts
  requests at once, before anything runs, with no Redis round trip.
- One client *runs* at most ``GPULAB_WEB_RUNNING_PER_CLIENT`` requests at once,
  pages and API calls together (in a lane whose places are capped, also at most
  all but one of the lane's places); the rest of its requests wait.
- When a place frees, it goes to the waiting request whose client runs the
  fewest requests now, pages before API calls, then the longest-waiting: a
  client that already runs something never takes a second place while another
  client, running less, waits for one.
- At most ``GPULAB_WEB_HEAVY_CONCURRENCY`` heavy requests (``heavy``: a big
  page of a list, the Usage CSV) run at once in the process, in both lanes
  together. Each is long work under the GIL (decoding rows, serializers,
  encoding; ``portal/api/renderers.py`` encodes a long list item by item), and
  the interpreter hands the GIL on only every switch interval
  (``GPULAB_WEB_SWITCH_INTERVAL_MS``, 1 ms) or when C code lets go of it: a
  short call's every step (the event loop's, its thread's after each query)
  waits about that long per heavy thread running. Bounding them bounds what one
  member's four exports cost everyone else; the heavy calls beyond it wait, the
  light ones do not.

Websockets are not counted: they are long-lived and run no thread per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from django.conf import settings

from portal.api.errors import body

if TYPE_CHECKING:
    from portal.api.middleware import AsgiApp, Receive, Scope, Send

API_PREFIX = "/api/"
RETRY_AFTER_S = 1
# Light API requests that may run while a page does (pages first; the API still
# moves). Heavy ones are bounded by the heavy cap instead.
API_BESIDE_PAGES = 1
# A list page of more rows than this is heavy (the API's default page is 100).
HEAVY_ROWS = 100
# Requests whose cost grows with what they ask for: path -> the query parameter
# that sets the number of rows and its default; None: always heavy.
HEAVY_REQUESTS: dict[str, tuple[str, int] | None] = {
    "/api/v1/jobs/": ("limit", 100),
    "/api/v1/queue/": ("limit", 1000),
    "/usage/csv/": None,
}


def is_heavy(scope: Scope) -> bool:
    """Whether a request may render many rows (see ``HEAVY_REQUESTS``): decided
    from its path and query before it runs, so it can wait without a thread."""
    path = scope["path"]
    if path not in HEAVY_REQUESTS:
        return False
    rule = HEAVY_REQUESTS[path]
    if rule is None:
        return True
    name, default = rule
    raw = scope.get("query_string", b"").decode("latin-1")
    rows = default
    for key, value in parse_qsl(raw, keep_blank_values=True):
        if key == name:
            # a bad value is refused by the view with a 400 (cheap): not heavy;
            # so is one past the biggest page (and int() of 4,301 digits fails)
            ok = value.isascii() and value.isdigit() and len(value) <= 9
            rows = int(value) if ok else 0
    return rows > HEAVY_ROWS


@dataclass(eq=False)
class Waiter:
    """A request waiting for its turn."""

    client: bytes
    heavy: bool  # holds a heavy place (while waiting: will need one)
    order: int  # arrival order, for the longest-waiting first
    rendered: bool = False  # was heavy; its whole answer is made, only sent
    turn: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


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
        self.heavy_running = 0
        self.queue: deque[Waiter] = deque()  # in arrival order
        self.clients: Counter[bytes] = Counter()  # places held, running or waiting
        self.running_by: Counter[bytes] = Counter()
        self.light_by: Counter[bytes] = Counter()  # running, not heavy

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
        running_per_client: int | None = None,
        heavy: int | None = None,
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
        # requests one client runs at once, both lanes together; 0: no cap
        self.running_per_client = (
            settings.GPULAB_WEB_RUNNING_PER_CLIENT
            if running_per_client is None
            else running_per_client
        )
        # heavy requests running at once, both lanes together; 0: no cap
        self.heavy_limit = (
            settings.GPULAB_WEB_HEAVY_CONCURRENCY if heavy is None else heavy
        )
        self.running_by: Counter[bytes] = Counter()  # both lanes
        self._order = itertools.count()

    @property
    def heavy_running(self) -> int:
        return self.api.heavy_running + self.pages.heavy_running

    def lane(self, scope: Scope) -> Lane:
        return self.api if scope["path"].startswith(API_PREFIX) else self.pages

    def may_start(self, lane: Lane, waiter: Waiter) -> bool:
        """Whether ``waiter`` may run now: room in its lane (pages first: while
        one runs, at most ``API_BESIDE_PAGES`` light API calls of clients that
        run no page), its client under its running caps, and room for one more
        heavy request if it is one."""
        client = waiter.client
        if waiter.heavy:
            if self.heavy_limit and self.heavy_running >= self.heavy_limit:
                return False
            if lane.running >= lane.limit:
                return False
        elif (
            lane is self.api
            and self.pages.running
            and not self.pages.running_by[client]
        ):
            if lane.running >= lane.limit or self._beside_pages() >= API_BESIDE_PAGES:
                return False
        elif lane.running >= lane.limit:
            return False
        if lane.running_by[client] >= lane.client_running_cap:
            return False
        cap = self.running_per_client
        return not cap or self.running_by[client] < cap

    def _beside_pages(self) -> int:
        """Light API calls running of clients that run no page (a client's calls
        beside its own page are bounded by its running cap)."""
        pages = self.pages.running_by
        return sum(n for c, n in self.api.light_by.items() if c not in pages)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lane = self.lane(scope)
        client = client_key(scope)
        if lane.per_client and lane.clients[client] >= lane.per_client:
            await _refuse(send, api=lane is self.api, per_client=lane.per_client)
            return
        lane.clients[client] += 1
        try:
            waiter = Waiter(client, is_heavy(scope), next(self._order))
            await self._run(lane, waiter, scope, receive, send)
        finally:
            lane.clients[client] -= 1
            if not lane.clients[client]:
                del lane.clients[client]

    async def _run(
        self,
        lane: Lane,
        waiter: Waiter,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """The request in its turn, or 503 at once if ``lane``'s queue is full."""
        if not await self._enter(lane, waiter):
            await _refuse(send, api=lane is self.api)
            return
        if waiter.heavy:
            send = self._sender(lane, waiter, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self._leave(lane, waiter)

    def _sender(self, lane: Lane, waiter: Waiter, send: Send) -> Send:
        """``send`` that gives back a heavy request's heavy place as its answer
        starts, if that answer has a ``Content-Length``: Django made it whole
        before sending, so the heavy work is over, and a client reading it slowly
        holds only its place in the lane. A streamed answer (the Usage CSV) is
        made as it is sent and keeps its heavy place to the end."""

        async def sender(message: Any) -> None:
            if (
                waiter.heavy
                and message["type"] == "http.response.start"
                and any(k.lower() == b"content-length" for k, _ in message["headers"])
            ):
                waiter.heavy, waiter.rendered = False, True
                lane.heavy_running -= 1
                self._dispatch()
            await send(message)

        return sender

    async def _enter(self, lane: Lane, waiter: Waiter) -> bool:
        """Wait for a turn in ``lane``; False (at once) if its queue is full.

        Every change that could let a waiting request start runs the dispatch,
        so none that may start is waiting: a new one either starts at once or
        queues behind requests that may not start yet."""
        if self.may_start(lane, waiter):
            self._start(lane, waiter)
            return True
        if lane.waiting >= lane.max_waiting:
            return False
        lane.queue.append(waiter)
        turn = waiter.turn
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                # still queued, unless a dispatch already dropped it
                with contextlib.suppress(ValueError):
                    lane.queue.remove(waiter)
            else:  # given its turn as it was cancelled: hand the turn on
                self._leave(lane, waiter)
            raise
        return True

    def _counters(self, lane: Lane, waiter: Waiter) -> list[Counter[bytes]]:
        """The per-client counts a running ``waiter`` is in."""
        counters = [lane.running_by, self.running_by]
        light = not (waiter.heavy or waiter.rendered)
        return [*counters, lane.light_by] if light else counters

    def _start(self, lane: Lane, waiter: Waiter) -> None:
        lane.running += 1
        lane.heavy_running += waiter.heavy
        for counter in self._counters(lane, waiter):
            counter[waiter.client] += 1

    def _leave(self, lane: Lane, waiter: Waiter) -> None:
        lane.running -= 1
        lane.heavy_running -= waiter.heavy
        for counter in self._counters(lane, waiter):
            counter[waiter.client] -= 1
            if not counter[waiter.client]:
                del counter[waiter.client]
        self._dispatch()

    def _next(self) -> tuple[Lane, Waiter] | None:
        """The waiting request to start next, if any may: of those that may
        start, the one whose client runs the fewest now, pages first, then the
        longest-waiting."""
        best: tuple[tuple[int, int, int], Lane, Waiter] | None = None
        for rank, lane in enumerate((self.pages, self.api)):
            for waiter in lane.queue:
                key = (self.running_by[waiter.client], rank, waiter.order)
                if best is not None and key >= best[0]:
                    continue
                if waiter.turn.done() or self.may_start(lane, waiter):
                    best = (key, lane, waiter)
        return None if best is None else (best[1], best[2])

    def _dispatch(self) -> None:
        """Start waiting requests while any may start (see ``_next``)."""
        while (chosen := self._next()) is not None:
            lane, waiter = chosen
            lane.queue.remove(waiter)
            if waiter.turn.done():  # cancelled (the client went away) but its
                continue  # task has not run since: it takes no place
            self._start(lane, waiter)
            waiter.turn.set_result(None)


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
