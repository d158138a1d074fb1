"""The Usage page and its CSV export have a bounded cost: a range longer than
GPULAB_USAGE_MAX_DAYS is refused with a message naming the limit (the CSV before
it streams), the calendar's first and last days overflow nothing, and under ASGI
the export is sent in batches instead of being read whole into memory (issue
#27). The API's side: tests/api/test_bounded_cost.py."""

from __future__ import annotations

import asyncio
import csv
import io
import warnings
from typing import TYPE_CHECKING, Any

import pytest
from asgiref.sync import async_to_sync
from django.core import signals
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections

from scheduler.models import Membership, UsageRecord

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test import Client

pytestmark = pytest.mark.django_db

T0_DAY = "2027-01-15"  # the day of the usage fixture


def _lead(user: User, group: str) -> None:
    Membership.objects.filter(user=user, group__name=group).update(is_leader=True)


def test_the_usage_page_refuses_a_wide_range_with_a_message(
    client: Client, alice: User, settings: Any
) -> None:
    settings.GPULAB_USAGE_MAX_DAYS = 31
    client.force_login(alice)

    page = client.get("/usage/?from=2027-01-01&to=2027-03-01")

    assert page.status_code == 400
    text = page.content.decode()
    assert "spans 60 days; at most 31 days (GPULAB_USAGE_MAX_DAYS)" in text
    assert page.context["report"] is None


def test_the_csv_export_refuses_a_wide_range_before_streaming(
    client: Client, alice: User
) -> None:
    client.force_login(alice)

    export = client.get("/usage/csv/?to=9999-12-31")

    assert export.status_code == 400
    assert not export.streaming
    assert "at most 366 days (GPULAB_USAGE_MAX_DAYS)" in export.content.decode()


def _csv(response: Any) -> list[dict[str, str]]:
    body = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(body)))


def test_the_csv_export_of_the_calendars_last_month_is_whole(
    client: Client, alice: User, usage: None
) -> None:
    client.force_login(alice)

    export = client.get("/usage/csv/?from=9999-12-01&to=9999-12-31")

    assert export.status_code == 200
    # before: the header, then an OverflowError mid-stream (no next day)
    assert _csv(export) == []


def test_the_csv_export_of_the_calendars_first_month_is_whole(
    client: Client, alice: User, usage: None
) -> None:
    client.force_login(alice)

    export = client.get("/usage/csv/?from=0001-01-01&to=0001-01-31")

    assert export.status_code == 200
    assert _csv(export) == []


def _asgi_get(path: str, query: str, cookie: str) -> tuple[list[Any], list[Any]]:
    """GET through Django's real ASGI handler (what uvicorn calls), in this
    test's thread and transaction (as Django's test client does, the handler's
    connection closing is set aside). Returns the messages sent and the
    warnings raised."""
    sent: list[Any] = []
    asked: list[bool] = []

    async def receive() -> dict[str, Any]:
        if not asked:
            asked.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"cookie", cookie.encode())],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async_to_sync(ASGIHandler())(scope, receive, send)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
    return sent, list(caught)


def test_the_csv_export_streams_in_batches_under_asgi(
    client: Client, alice: User, usage: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ASGI Django reads a synchronous iterator whole into memory before
    sending its first byte (and warns): the export's memory grew with its rows.
    It sends them in batches of CSV_BATCH instead."""
    from portal.accounting import views

    monkeypatch.setattr(views, "CSV_BATCH", 1)
    _lead(alice, "vision")
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}"

    sent, caught = _asgi_get(
        "/usage/csv/", f"group=vision&from={T0_DAY}&to={T0_DAY}", cookie
    )

    assert [str(w.message) for w in caught if "synchronous" in str(w.message)] == []
    assert sent[0]["status"] == 200
    chunks = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    rows = list(csv.DictReader(io.StringIO(b"".join(chunks).decode())))
    expected = UsageRecord.objects.filter(group__name="vision").count()
    assert len(rows) == expected == 3  # alice's 2 GPUs, bob's 1
    assert sum(1 for c in chunks if c) == expected + 1  # header, then a row a batch
