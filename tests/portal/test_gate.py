"""The web process's concurrency gate (portal/gate.py): API calls and pages each
run at most N at once in Django, wait their turn beyond that, and are turned
away with 503 + Retry-After once a lane's queue is full; a full API lane never
holds up a page."""

from __future__ import annotations

import asyncio
import itertools
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


_callers = itertools.count()


async def call(gate: ConcurrencyGate, path: str) -> list[Mapping[str, Any]]:
    """One request from a client of its own (an address no other call has)."""
    sent: list[Mapping[str, Any]] = []
    n = next(_callers)
    addr = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": [], "client": (addr, 5555)}
    await gate(scope, receive, send)
    return sent


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_api_calls_beyond_the_limit_wait_their_turn_and_all_run() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=3, pages=2, queue=100, per_client=0)
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
        gate = ConcurrencyGate(app, api=2, pages=2, queue=100, per_client=0)
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
        gate = ConcurrencyGate(app, api=3, pages=2, queue=100, per_client=0)
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
        gate = ConcurrencyGate(app, api=1, pages=1, queue=100, per_client=0)
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


def test_a_request_cancelled_just_as_its_turn_comes_takes_no_place() -> None:
    """The client of a waiting request goes away in the same loop step as the
    running one ends: the dispatch meets an already-cancelled turn. It must skip
    it (not fail the finishing request, not leak the place) and start the next."""

    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=100, per_client=0)
        running = asyncio.create_task(call(gate, "/api/v1/jobs/"))
        await settle()
        gone = asyncio.create_task(call(gate, "/api/v1/jobs/"))
        after = asyncio.create_task(call(gate, "/api/v1/jobs/"))
        await settle()
        assert gate.api.waiting == 2
        app.release.set()  # the running call ends in the next step ...
        gone.cancel()  # ... and the first waiting one's client is gone by then
        assert (await running)[0]["status"] == 200
        assert (await after)[0]["status"] == 200
        assert gone.cancelled()
        assert gate.api.running == gate.api.waiting == 0
        assert app.started == ["/api/v1/jobs/"] * 2

    asyncio.run(scenario())


def test_a_full_queue_answers_503_with_retry_after_at_once() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=2, per_client=0)
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


def asgi_gate() -> ConcurrencyGate:
    """The gate the ASGI application puts HTTP through (inside the body limit)."""
    from portal.asgi import application
    from portal.interactive.proxy import InteractiveProxy

    # Interactive jobs' proxy first (it streams outside the lanes), then the gate.
    proxy = application.application_mapping["http"]
    assert isinstance(proxy, InteractiveProxy)
    assert proxy is application.application_mapping["websocket"]
    http: Any = proxy.apps["http"]
    assert isinstance(http.app, ConcurrencyGate)
    return http.app


def test_the_asgi_application_puts_http_through_the_gate(settings: Any) -> None:
    gate = asgi_gate()
    assert gate.api.limit == settings.GPULAB_WEB_API_CONCURRENCY
    assert gate.pages.limit == settings.GPULAB_WEB_PAGE_CONCURRENCY
    assert gate.api.max_waiting == settings.GPULAB_WEB_QUEUE


def scope(
    url: str, headers: list[tuple[bytes, bytes]], addr: str = "10.0.0.7"
) -> dict[str, Any]:
    path, _, query = url.partition("?")
    return {
        "type": "http",
        "path": path,
        "query_string": query.encode(),
        "headers": headers,
        "client": (addr, 5555),
    }


def url_of(scope: dict[str, Any]) -> str:
    path: str = scope["path"]
    query: bytes = scope.get("query_string", b"")
    return path + (f"?{query.decode()}" if query else "")


async def call_as(
    gate: ConcurrencyGate, path: str, headers: list[tuple[bytes, bytes]]
) -> list[Mapping[str, Any]]:
    sent: list[Mapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)

    await gate(scope(path, headers), receive, send)
    return sent


ALICE = [(b"authorization", b"Bearer alice-token")]
BOB = [(b"authorization", b"Bearer bob-token")]


def test_a_client_over_its_share_is_told_429_and_others_still_get_in() -> None:
    """One token holds at most ``per_client`` places (running or waiting); its next
    call is refused at once with 429 + Retry-After, while another token, from the
    same address, still queues; a place given back is usable again."""

    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=100, per_client=3)
        mine = [
            asyncio.create_task(call_as(gate, "/api/v1/jobs/", ALICE)) for _ in range(3)
        ]
        await settle()
        assert gate.api.running == 1 and gate.api.waiting == 2
        start, body = await call_as(gate, "/api/v1/jobs/", ALICE)
        assert start["status"] == 429
        headers = dict(start["headers"])
        assert headers[b"retry-after"] == b"1"
        assert headers[b"content-type"] == b"application/json"
        assert json.loads(body["body"]) == {
            "error": "throttled",
            "detail": "Too many requests at once from this client (at most 3); "
            "try again in 1 s.",
            "fields": {},
        }
        theirs = asyncio.create_task(call_as(gate, "/api/v1/jobs/", BOB))
        await settle()
        assert gate.api.waiting == 3  # Bob's call waits its turn, not refused
        assert app.started == ["/api/v1/jobs/"]  # the refused call never ran
        app.release.set()
        answers = await asyncio.gather(*mine, theirs)
        assert [a[0]["status"] for a in answers] == [200] * 4
        assert not gate.api.clients  # every place given back
        assert (await call_as(gate, "/api/v1/jobs/", ALICE))[0]["status"] == 200

    asyncio.run(scenario())


def test_a_call_refused_503_gives_back_its_clients_place() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=0, per_client=2)
        held = asyncio.create_task(call_as(gate, "/api/v1/jobs/", BOB))
        await settle()
        assert (await call_as(gate, "/api/v1/jobs/", ALICE))[0]["status"] == 503
        assert gate.api.clients == {b"auth Bearer bob-token": 1}
        app.release.set()
        await held
        assert not gate.api.clients

    asyncio.run(scenario())


def test_pages_and_an_uncapped_lane_count_no_client() -> None:
    async def scenario() -> None:
        app = BlockingApp()
        gate = ConcurrencyGate(app, api=1, pages=1, queue=100, per_client=0)
        calls = [
            asyncio.create_task(call_as(gate, "/api/v1/jobs/", ALICE)) for _ in range(5)
        ]
        capped = ConcurrencyGate(app, api=1, pages=1, queue=100, per_client=1)
        pages = [
            asyncio.create_task(call_as(capped, "/queue/", ALICE)) for _ in range(5)
        ]
        await settle()
        assert gate.api.waiting == 4 and capped.pages.waiting == 4
        app.release.set()
        answers = await asyncio.gather(*calls, *pages)
        assert [a[0]["status"] for a in answers] == [200] * 10

    asyncio.run(scenario())


def test_a_client_is_its_token_else_its_session_else_its_address(settings: Any) -> None:
    from portal.gate import client_key

    settings.SESSION_COOKIE_NAME = "sessionid"
    cookie = (b"cookie", b"csrftoken=abc; sessionid=s3ss; theme=dark")
    assert client_key(scope("/api/", [cookie, *ALICE])) == b"auth Bearer alice-token"
    assert client_key(scope("/api/", [cookie])) == b"session s3ss"
    assert client_key(scope("/api/", [(b"cookie", b"sessionid=")])) == b"addr 10.0.0.7"
    assert client_key(scope("/api/", [])) == b"addr 10.0.0.7"
    assert client_key(scope("/api/", [], addr="10.0.0.8")) != client_key(
        scope("/api/", [])
    )
    assert client_key({"type": "http", "path": "/api/", "headers": []}) == b"addr "


def test_the_asgi_gate_caps_each_client_by_the_setting(settings: Any) -> None:
    gate = asgi_gate()
    assert gate.api.per_client == settings.GPULAB_WEB_API_PER_CLIENT
    assert gate.pages.per_client == 0
    assert gate.running_per_client == settings.GPULAB_WEB_RUNNING_PER_CLIENT
    assert gate.heavy_limit == settings.GPULAB_WEB_HEAVY_CONCURRENCY


class OwnReleaseApp:
    """An ASGI app whose requests each run until their own URL is released."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        url = url_of(scope)
        self.started.append(url)
        await self.release.setdefault(url, asyncio.Event()).wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def finish(self, path: str) -> None:
        self.release.setdefault(path, asyncio.Event()).set()


def test_one_client_runs_all_but_one_place_so_another_starts_at_once() -> None:
    """Alice holds her whole share (4 places in a lane of 4): three run, one waits;
    Bob's call takes the fourth place at once instead of waiting for one of
    Alice's slow requests to finish."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(
            app, api=4, pages=1, queue=100, per_client=4, running_per_client=0
        )
        alice = [
            asyncio.create_task(call_as(gate, f"/api/v1/a{i}/", ALICE))
            for i in range(4)
        ]
        await settle()
        assert app.started == ["/api/v1/a0/", "/api/v1/a1/", "/api/v1/a2/"]
        assert gate.api.running == 3 and gate.api.waiting == 1
        bob = asyncio.create_task(call_as(gate, "/api/v1/me/", BOB))
        await settle()
        assert app.started[-1] == "/api/v1/me/"  # started while Alice's still run
        app.finish("/api/v1/me/")
        assert (await bob)[0]["status"] == 200
        await settle()
        assert app.started[-1] == "/api/v1/me/"  # Alice is still at her cap
        app.finish("/api/v1/a0/")
        await settle()
        assert app.started[-1] == "/api/v1/a3/"  # her waiting call takes her place
        for i in range(1, 4):
            app.finish(f"/api/v1/a{i}/")
        assert [(await t)[0]["status"] for t in alice] == [200] * 4
        assert not gate.api.running_by and not gate.api.clients

    asyncio.run(scenario())


def test_a_freed_place_goes_to_the_oldest_call_whose_client_is_under_its_cap() -> None:
    """Waiting: Alice's (she is at her running cap), then Bob's. When a place frees
    that Alice may not take, Bob's call starts ahead of hers, and hers keeps its
    turn."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(app, api=3, pages=1, queue=100, per_client=3)
        carol = [(b"authorization", b"Bearer carol-token")]
        first = [
            asyncio.create_task(call_as(gate, f"/api/v1/a{i}/", ALICE))
            for i in range(2)
        ]
        await settle()
        c0 = asyncio.create_task(call_as(gate, "/api/v1/c0/", carol))
        await settle()
        a2 = asyncio.create_task(call_as(gate, "/api/v1/a2/", ALICE))
        await settle()
        b0 = asyncio.create_task(call_as(gate, "/api/v1/b0/", BOB))
        await settle()
        assert gate.api.running == 3 and gate.api.waiting == 2
        app.finish("/api/v1/c0/")  # Carol's place frees: Alice is at her cap of 2
        await c0
        await settle()
        assert app.started[-1] == "/api/v1/b0/"
        app.finish("/api/v1/a0/")
        await settle()
        assert app.started[-1] == "/api/v1/a2/"
        for path in ("/api/v1/a1/", "/api/v1/a2/", "/api/v1/b0/"):
            app.finish(path)
        assert [(await t)[0]["status"] for t in (*first, a2, b0)] == [200] * 4

    asyncio.run(scenario())


CAROL = [(b"authorization", b"Bearer carol-token")]
BIG_PAGE = "/api/v1/jobs/?limit=1000"


def test_one_client_runs_at_most_its_share_of_both_lanes_together() -> None:
    """With a running cap of 2, Alice's page and one API call run; her second
    API call waits although the API lane has room, and Bob's starts at once.
    When one of hers ends, her waiting call takes its place."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(
            app, api=4, pages=4, queue=100, per_client=4, running_per_client=2
        )
        tasks = [
            asyncio.create_task(call_as(gate, url, ALICE))
            for url in ("/usage/", "/api/v1/a0/", "/api/v1/a1/")
        ]
        await settle()
        assert app.started == ["/usage/", "/api/v1/a0/"]
        assert gate.api.waiting == 1 and gate.api.running == 1
        bob = asyncio.create_task(call_as(gate, "/api/v1/me/", BOB))
        await settle()
        assert app.started[-1] == "/api/v1/me/"
        app.finish("/usage/")
        await settle()
        assert app.started[-1] == "/api/v1/a1/"
        assert gate.running_by[b"auth Bearer alice-token"] == 2
        for url in ("/api/v1/me/", "/api/v1/a0/", "/api/v1/a1/"):
            app.finish(url)
        assert [(await t)[0]["status"] for t in (*tasks, bob)] == [200] * 4
        assert not gate.running_by

    asyncio.run(scenario())


def test_a_client_already_running_takes_no_second_place_while_another_waits() -> None:
    """Pages lane of 2, full with Alice's and Bob's pages. Alice's second page
    waits, then Carol's first. When Bob's ends, Carol's starts before Alice's
    older one: Alice already runs a page, Carol runs nothing. Then Alice's."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(
            app, api=2, pages=2, queue=100, per_client=0, running_per_client=2
        )
        a0 = asyncio.create_task(call_as(gate, "/jobs/a0/", ALICE))
        b0 = asyncio.create_task(call_as(gate, "/jobs/b0/", BOB))
        await settle()
        a1 = asyncio.create_task(call_as(gate, "/jobs/a1/", ALICE))
        await settle()
        c0 = asyncio.create_task(call_as(gate, "/jobs/c0/", CAROL))
        await settle()
        assert gate.pages.running == 2 and gate.pages.waiting == 2
        app.finish("/jobs/b0/")
        await b0
        await settle()
        assert app.started[-1] == "/jobs/c0/"
        assert gate.pages.waiting == 1  # Alice's second page
        app.finish("/jobs/c0/")
        await c0
        await settle()
        assert app.started[-1] == "/jobs/a1/"
        app.finish("/jobs/a0/")
        app.finish("/jobs/a1/")
        assert [(await t)[0]["status"] for t in (a0, a1)] == [200] * 2

    asyncio.run(scenario())


def test_heavy_requests_run_one_at_a_time_in_both_lanes_and_light_ones_pass() -> None:
    """With a heavy cap of 1: Alice's 1,000-job page runs; Bob's Usage CSV (a
    heavy page) waits although the pages lane is empty, while Bob's light call
    and Carol's 50-job page start at once. When Alice's page ends, Bob's CSV
    starts before Alice's next big page (she ran one, he none)."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(
            app, api=4, pages=4, queue=100, per_client=4, running_per_client=2,
            heavy=1,
        )  # fmt: skip
        first = asyncio.create_task(call_as(gate, BIG_PAGE, ALICE))
        await settle()
        csv = asyncio.create_task(call_as(gate, "/usage/csv/?group=g0", BOB))
        await settle()
        again = asyncio.create_task(call_as(gate, BIG_PAGE + "&offset=1000", ALICE))
        me = asyncio.create_task(call_as(gate, "/api/v1/me/", BOB))
        small = asyncio.create_task(call_as(gate, "/api/v1/jobs/?limit=50", CAROL))
        await settle()
        assert app.started == [BIG_PAGE, "/api/v1/me/", "/api/v1/jobs/?limit=50"]
        assert gate.pages.waiting == 1 and gate.api.waiting == 1
        assert gate.heavy_running == 1
        app.finish("/api/v1/me/")
        app.finish("/api/v1/jobs/?limit=50")
        await asyncio.gather(me, small)
        app.finish(BIG_PAGE)
        await first
        await settle()
        assert app.started[-1] == "/usage/csv/?group=g0"
        assert gate.heavy_running == 1 and gate.api.waiting == 1
        app.finish("/usage/csv/?group=g0")
        await csv
        await settle()
        assert app.started[-1] == BIG_PAGE + "&offset=1000"
        app.finish(BIG_PAGE + "&offset=1000")
        assert (await again)[0]["status"] == 200
        assert gate.heavy_running == 0

    asyncio.run(scenario())


def test_a_heavy_call_leaves_the_place_beside_a_page_to_a_light_one() -> None:
    """While a page runs the API lane starts one light call at a time; Alice's
    running 1,000-job page is bounded by the heavy cap instead, so Bob's light
    call still starts at once beside Carol's page, and Dave's waits for Bob's.
    Carol's own call beside her page counts against her running cap only."""

    async def scenario() -> None:
        app = OwnReleaseApp()
        gate = ConcurrencyGate(
            app, api=4, pages=4, queue=100, per_client=4, running_per_client=2,
            heavy=1,
        )  # fmt: skip
        page = asyncio.create_task(call_as(gate, "/queue/", CAROL))
        await settle()
        big = asyncio.create_task(call_as(gate, BIG_PAGE, ALICE))
        await settle()
        assert app.started == ["/queue/", BIG_PAGE]
        me = asyncio.create_task(call_as(gate, "/api/v1/me/", BOB))
        await settle()
        assert app.started[-1] == "/api/v1/me/"
        dave = [(b"authorization", b"Bearer dave-token")]
        other = asyncio.create_task(call_as(gate, "/api/v1/other/", dave))
        await settle()
        assert gate.api.waiting == 1  # pages first: one light call beside a page
        own = asyncio.create_task(call_as(gate, "/api/v1/own/", CAROL))
        await settle()
        # Carol's call beside her own page is bounded by her running cap instead
        assert app.started[-1] == "/api/v1/own/"
        app.finish("/api/v1/own/")
        await own
        app.finish("/api/v1/me/")
        await me
        await settle()
        assert app.started[-1] == "/api/v1/other/"
        for url in ("/api/v1/other/", BIG_PAGE, "/queue/"):
            app.finish(url)
        assert [(await t)[0]["status"] for t in (page, big, other)] == [200] * 3

    asyncio.run(scenario())


def test_what_is_heavy_is_read_from_the_path_and_the_rows_asked() -> None:
    from portal.gate import is_heavy

    def heavy(url: str) -> bool:
        return is_heavy(scope(url, []))

    assert heavy("/usage/csv/") and heavy("/usage/csv/?group=g0&from=2026-01-01")
    assert heavy("/api/v1/jobs/?limit=101") and heavy("/api/v1/jobs/?limit=1000")
    assert heavy("/api/v1/queue/")  # its default page is 1,000 jobs
    assert heavy("/api/v1/jobs/?limit=10&state=done&limit=500")  # the last counts
    assert not heavy("/api/v1/jobs/") and not heavy("/api/v1/jobs/?limit=100")
    assert not heavy("/api/v1/queue/?limit=100")
    # refused by the view's validation at once: not worth a heavy place
    assert not heavy("/api/v1/jobs/?limit=lots") and not heavy("/api/v1/jobs/?limit=")
    assert not heavy("/api/v1/jobs/?limit=%C2%B2")
    assert not heavy("/api/v1/jobs/?limit=" + "9" * 5000)  # no ValueError
    assert not heavy("/usage/") and not heavy("/api/v1/usage/?group=g0")
    assert not heavy("/api/v1/jobs/12/")


class TwoStepApp:
    """Each request sends its answer's start (with a Content-Length, or streamed
    without one), then waits for its URL's release before sending the body, as a
    client reading a big answer slowly holds the send."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        url = url_of(scope)
        self.started.append(url)
        streamed = scope["path"] == "/usage/csv/"
        headers = [] if streamed else [(b"Content-Length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.release.setdefault(url, asyncio.Event()).wait()
        await send({"type": "http.response.body", "body": b"ok"})

    def finish(self, url: str) -> None:
        self.release.setdefault(url, asyncio.Event()).set()


def test_a_heavy_answer_made_whole_gives_back_its_heavy_place_as_it_is_sent() -> None:
    """Alice's 1,000-job page is made and starts going out (its Content-Length
    sent) to a slow reader: Bob's big page starts although the heavy cap is 1.
    A streamed Usage CSV is made as it goes: it keeps its heavy place until its
    end, and Carol's big page waits for it."""

    async def scenario() -> None:
        app = TwoStepApp()
        gate = ConcurrencyGate(
            app, api=4, pages=4, queue=100, per_client=4, running_per_client=2,
            heavy=1,
        )  # fmt: skip
        alice = asyncio.create_task(call_as(gate, BIG_PAGE, ALICE))
        await settle()
        bob = asyncio.create_task(call_as(gate, BIG_PAGE + "&offset=1", BOB))
        await settle()
        assert app.started == [BIG_PAGE, BIG_PAGE + "&offset=1"]
        assert gate.api.running == 2 and gate.heavy_running == 0
        app.finish(BIG_PAGE)
        app.finish(BIG_PAGE + "&offset=1")
        assert [(await t)[0]["status"] for t in (alice, bob)] == [200] * 2

        csv = asyncio.create_task(call_as(gate, "/usage/csv/", BOB))
        await settle()
        carols = BIG_PAGE + "&offset=2"
        carol = asyncio.create_task(call_as(gate, carols, CAROL))
        await settle()
        assert app.started[-1] == "/usage/csv/" and gate.heavy_running == 1
        assert gate.api.waiting == 1
        app.finish("/usage/csv/")
        await csv
        await settle()
        assert app.started[-1] == carols
        app.finish(carols)
        assert (await carol)[0]["status"] == 200
        assert gate.heavy_running == 0 and not gate.api.light_by
        assert gate.api.running == gate.pages.running == 0

    asyncio.run(scenario())
