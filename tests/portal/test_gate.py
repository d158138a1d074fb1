"""The web process's concurrency gate (portal/gate.py): API calls and pages each
run at most N at once in Django, wait their turn beyond that, and are turned
away with 503 + Retry-After once a lane's queue is full; a full API lane never
holds up a page."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from portal.gate import ConcurrencyGate

if TYPE_CHECKING:
    from collections.abc import Mapping


class BlockingApp:
    """An ASGI app whose requests run until released; counts how many run."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.release = asyncio.Event()
        self.started: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        self.started.append(scope["path"])
        try:
            await self.release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            self.running -= 1


async def call(gate: ConcurrencyGate, path: str) -> list[Mapping[str, Any]]:
    sent: list[Mapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)

    await gate({"type": "http", "path": path, "headers": []}, receive, send)
    return sent


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_api_calls_beyond_the_limit_wait_their_turn_and_all_run() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=3, pages=2, queue=100)
        calls = [asyncio.create_task(call(gate, "/api/v1/jobs/")) for _ in range(10)]
        await settle()
        assert app.running == 3
        assert gate.api.waiting == 7
        app.release.set()
        answers = await asyncio.gather(*calls)
        assert app.most == 3
        assert [a[0]["status"] for a in answers] == [200] * 10
        assert gate.api.running == gate.api.waiting == 0

    asyncio.run(scenario())


def test_a_page_is_not_held_up_by_a_full_api_lane() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=2, pages=2, queue=100)
        api = [asyncio.create_task(call(gate, "/api/v1/jobs/")) for _ in range(50)]
        await settle()
        page = asyncio.create_task(call(gate, "/queue/"))
        await settle()
        # the page runs now, beside the two API calls; 48 of those still wait
        assert app.started.count("/queue/") == 1
        assert app.running == 3
        app.release.set()
        await asyncio.gather(page, *api)

    asyncio.run(scenario())


class PerPathApp:
    """Each path's requests run until that path is released; counts each path's."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.now: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        self.now[path] = self.now.get(path, 0) + 1
        try:
            await self.gates.setdefault(path, asyncio.Event()).wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        finally:
            self.now[path] -= 1


def test_while_a_page_runs_the_api_starts_one_call_at_a_time() -> None:
    """Pages first: API calls started before the page go on, but while a page
    runs no more than API_BESIDE_PAGES (1) run beside it; then the lane refills."""

    async def scenario() -> None:
        app = PerPathApp()
        gate = ConcurrencyGate(app, api=3, pages=2, queue=100)
        page = asyncio.create_task(call(gate, "/queue/"))
        await settle()
        api = [asyncio.create_task(call(gate, "/api/v1/jobs/")) for _ in range(6)]
        await settle()
        assert app.now["/api/v1/jobs/"] == 1
        assert gate.api.waiting == 5
        app.gates["/queue/"].set()  # the page is answered: the API lane refills
        await page
        await settle()
        assert app.now["/api/v1/jobs/"] == 3
        app.gates["/api/v1/jobs/"].set()
        answers = await asyncio.gather(*api)
        assert [a[0]["status"] for a in answers] == [200] * 6

    asyncio.run(scenario())


def test_a_waiting_request_that_goes_away_gives_up_its_place() -> None:
    async def scenario() -> None:
        app = PerPathApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=100)
        first = asyncio.create_task(call(gate, "/api/v1/jobs/"))
        await settle()
        gone = asyncio.create_task(call(gate, "/api/v1/jobs/"))
        await settle()
        assert gate.api.waiting == 1
        gone.cancel()  # the client disconnected while it waited
        await settle()
        assert gate.api.waiting == 0
        app.gates["/api/v1/jobs/"].set()
        await first
        assert gate.api.running == 0
        assert (await call(gate, "/api/v1/jobs/"))[0]["status"] == 200

    asyncio.run(scenario())


def test_a_full_queue_answers_503_with_retry_after_at_once() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=2)
        held = [asyncio.create_task(call(gate, "/api/v1/jobs/")) for _ in range(3)]
        pages = [asyncio.create_task(call(gate, "/")) for _ in range(3)]
        await settle()
        refused = await call(gate, "/api/v1/jobs/")
        start, body = refused
        assert start["status"] == 503
        headers = dict(start["headers"])
        assert headers[b"retry-after"] == b"1"
        assert headers[b"content-type"] == b"application/json"
        assert json.loads(body["body"]) == {
            "error": "busy",
            "detail": "The server is busy; try again in 1 s.",
            "fields": {},
        }
        page = await call(gate, "/jobs/")
        assert page[0]["status"] == 503
        assert dict(page[0]["headers"])[b"retry-after"] == b"1"
        assert app.started.count("/jobs/") == 0
        app.release.set()
        answers = await asyncio.gather(*held, *pages)
        assert [a[0]["status"] for a in answers] == [200] * 6
        # room again: the next one runs
        assert (await call(gate, "/api/v1/jobs/"))[0]["status"] == 200

    asyncio.run(scenario())


def test_websockets_pass_through_uncounted() -> None:
    async def scenario() -> None:
        seen: list[str] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append(scope["type"])

        gate = ConcurrencyGate(app, api=1, pages=1, queue=0)
        for _ in range(3):
            await gate({"type": "websocket", "path": "/ws/agent/"}, None, None)  # type: ignore[arg-type]
        assert seen == ["websocket"] * 3
        assert gate.pages.running == gate.api.running == 0

    asyncio.run(scenario())


def test_the_asgi_application_puts_http_through_the_gate(settings: Any) -> None:
    from portal.asgi import application
    from portal.gate import ConcurrencyGate

    http = application.application_mapping["http"]
    assert isinstance(http.app, ConcurrencyGate)
    assert http.app.api.limit == settings.GPULAB_WEB_API_CONCURRENCY
    assert http.app.pages.limit == settings.GPULAB_WEB_PAGE_CONCURRENCY
    assert http.app.api.max_waiting == settings.GPULAB_WEB_QUEUE
