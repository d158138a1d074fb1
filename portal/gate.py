"""ASGI: how many HTTP requests run in Django at once, per lane.

Django's ASGI handler runs each request's synchronous code in a thread of its
own, with a PostgreSQL connection of its own. Without a bound, a burst of API
submissions (bench/submit_burst.py: 10,000 in a minute) put hundreds of
requests in threads at once: each opened a connection until PostgreSQL refused
more (503 "database unavailable"), they all shared the one GIL, and a page took
seconds. So at most ``GPULAB_WEB_API_CONCURRENCY`` API requests (``/api/``) and
``GPULAB_WEB_PAGE_CONCURRENCY`` other requests (pages, forms, static files) run
at once in each web process; the others wait their turn in the event loop
(first come, first served, no thread, no connection). The lanes are separate,
so a queue of API calls never holds up a page. A lane with
``GPULAB_WEB_QUEUE`` requests already waiting answers the next at once: 503
with ``Retry-After`` (the API's JSON error body under ``/api/``).
Websockets are not counted: they are long-lived and run no thread per frame.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    Scope = dict[str, Any]
    Message = Mapping[str, Any]
    Receive = Callable[[], Awaitable[Message]]
    Send = Callable[[Message], Awaitable[None]]
    AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_PREFIX = "/api/"
RETRY_AFTER_S = 1


class Lane:
    """A bounded number of requests running, a bounded number waiting."""

    def __init__(self, name: str, running: int, waiting: int) -> None:
        self.name = name
        self.limit = running
        self.max_waiting = waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(running)

    def full(self) -> bool:
        return self.running >= self.limit and self.waiting >= self.max_waiting

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()


class ConcurrencyGate:
    """Wraps the HTTP application (``portal/asgi.py``)."""

    def __init__(
        self,
        app: AsgiApp,
        *,
        api: int | None = None,
        pages: int | None = None,
        queue: int | None = None,
    ) -> None:
        self.app = app
        waiting = settings.GPULAB_WEB_QUEUE if queue is None else queue
        self.api = Lane(
            "api", settings.GPULAB_WEB_API_CONCURRENCY if api is None else api, waiting
        )
        self.pages = Lane(
            "pages",
            settings.GPULAB_WEB_PAGE_CONCURRENCY if pages is None else pages,
            waiting,
        )

    def lane(self, scope: Scope) -> Lane:
        return self.api if scope["path"].startswith(API_PREFIX) else self.pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lane = self.lane(scope)
        if lane.full():
            await _busy(send, api=lane is self.api)
            return
        await lane.acquire()
        try:
            await self.app(scope, receive, send)
        finally:
            lane.release()


async def _busy(send: Send, *, api: bool) -> None:
    detail = f"The server is busy; try again in {RETRY_AFTER_S} s."
    if api:
        payload = json.dumps({"error": "busy", "detail": detail, "fields": {}})
        kind = b"application/json"
    else:
        payload = detail + "\n"
        kind = b"text/plain; charset=utf-8"
    data = payload.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(data)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
