"""GPU-hours per group on /metrics come from totals PostgreSQL keeps as usage
records are written (``portal.prometheus.ledger``): after every kind of write
(the charging services' inserts and rewrites, a record moved to another group,
deleted, the table truncated) they equal the sum over the records, folded or not;
a fold never loses a delta whose transaction commits after it began; the
migration counts the records that were there before it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.db.models import Sum
from django.utils import timezone

from portal.prometheus import ledger, tasks
from portal.prometheus.models import GpuSecondsDelta, GpuSecondsTotal
from scheduler.models import Group, UsageRecord
from tests.accounting.test_charges import T0, end, join, run_alone
from tests.conftest import make_node
from tests.factories import JobFactory, start_job

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node


def by_sum() -> dict[str, float]:
    """Each group's GPU-seconds summed over its records (the old scrape query)."""
    sums = dict(
        UsageRecord.objects.values_list("group__name")
        .annotate(s=Sum("gpu_seconds"))
        .values_list("group__name", "s")
    )
    return {g.name: float(sums.get(g.name) or 0.0) for g in Group.objects.all()}


def check() -> None:
    """The ledger equals the sums before a fold, after it, and after a second."""
    expected = by_sum()
    for _ in range(2):
        got = dict(ledger.group_seconds())
        assert got.keys() == expected.keys()
        for name, seconds in expected.items():
            assert got[name] == pytest.approx(seconds, rel=1e-12, abs=1e-6), name
        ledger.fold()
    assert not GpuSecondsDelta.objects.exists()


def record(user: User, node: Node, seconds: float) -> UsageRecord:
    now = timezone.now()
    return UsageRecord.objects.create(
        attempt=start_job(JobFactory(owner=user), node),
        gpu=node.gpus.order_by("index")[0],
        user=user,
        group=user.lab_groups.get(),
        started_at=now - timedelta(hours=1),
        ended_at=now,
        share=1.0,
        gpu_seconds=seconds,
    )


@pytest.mark.django_db
def test_the_totals_follow_every_write_of_the_ledger(
    alice: User, charlie: User
) -> None:
    check()  # no records: every group at 0
    node, _ = make_node("node-a", 2)
    gpu = node.gpus.order_by("index").first()
    assert gpu is not None
    # The charging services: alice alone, charlie joins her GPU, both end; the
    # second end charges the GPU's overlapping runs again (upserts).
    a = JobFactory(owner=alice, shareable=True, gpu_memory_mib=20 * 1024)
    b = JobFactory(owner=charlie, shareable=True, gpu_memory_mib=60 * 1024)
    first = run_alone(a, node, T0)
    second = join(b, gpu, node, a, T0 + 100)
    end(node, first, T0 + 300)
    check()
    end(node, second, T0 + 400)
    assert UsageRecord.objects.count() == 2
    check()

    extra = record(alice, node, 5400.0)
    check()
    UsageRecord.objects.filter(pk=extra.pk).update(group=charlie.lab_groups.get())
    check()
    UsageRecord.objects.filter(pk=extra.pk).update(gpu_seconds=7200.5)
    ledger.fold()
    UsageRecord.objects.filter(pk=extra.pk).update(share=0.5)  # not a charge
    assert not GpuSecondsDelta.objects.exists()
    check()
    UsageRecord.objects.filter(pk=extra.pk).delete()
    check()
    with connection.cursor() as cursor:
        # (The test's transaction has deferred foreign-key checks pending.)
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("TRUNCATE scheduler_usagerecord CASCADE")
    assert not GpuSecondsTotal.objects.exists()
    check()


@pytest.mark.django_db(transaction=True)
def test_a_fold_keeps_a_delta_committed_after_it_began(alice: User) -> None:
    node, _ = make_node("node-a", 1)
    written, fold_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with transaction.atomic():
                record(alice, node, 3600.0)
                written.set()
                fold_done.wait(30)
        except BaseException as exc:
            errors.append(exc)
            written.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=writer)
    thread.start()
    assert written.wait(30)
    ledger.fold()  # the writer's delta is not visible yet
    assert dict(ledger.group_seconds())["vision"] == 0.0
    fold_done.set()
    thread.join(30)
    assert errors == []
    assert dict(ledger.group_seconds())["vision"] == 3600.0
    ledger.fold()
    assert GpuSecondsTotal.objects.get(group_id=alice.lab_groups.get().pk).seconds == (
        3600
    )


@pytest.mark.django_db(transaction=True)
def test_the_migration_counts_the_records_already_there(
    alice: User, charlie: User
) -> None:
    node, _ = make_node("node-a", 2)
    call_command("migrate", "prometheus", "zero", verbosity=0)
    try:
        for user, seconds in ((alice, 100.25), (alice, 50.0), (charlie, 7.5)):
            record(user, node, seconds)
    finally:
        call_command("migrate", "prometheus", verbosity=0)
    assert dict(ledger.group_seconds()) == {"nlp": 7.5, "vision": 150.25}
    assert not GpuSecondsDelta.objects.exists()
    record(charlie, node, 1.0)
    # Beat folds when nothing scrapes (the export off).
    assert tasks.fold() == 1
    assert not GpuSecondsDelta.objects.exists()
    check()
