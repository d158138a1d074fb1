"""Reads for the Usage page and its CSV export: a user's or a group's GPU time by
UTC day and user, top jobs, GPU efficiency and per-record rows.

Ended attempts come from ``DailyUsage`` (one row per usage record per day, indexed
by (group, day) and (user, day)): a month of a group is a few thousand rows
whatever the history's size. Running attempts come live: charged up to now by
the same rule (``charging.split`` over their GPUs' runs, ``live``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.db.models import Q, Sum

from portal.accounting import live
from portal.accounting.models import DailyUsage
from scheduler.models import Attempt, Gpu, Group, Job, UsageRecord

if TYPE_CHECKING:
    from collections.abc import Iterator

    from portal.accounting.live import LiveRun


@dataclass(frozen=True)
class Scope:
    """Whose usage: one user's (in any group) or one group's (all its users)."""

    user_id: int | None = None
    group_id: int | None = None

    def q(self) -> Q:
        """Filter of rows with ``user`` and ``group`` (records, days)."""
        if self.group_id is not None:
            return Q(group_id=self.group_id)
        return Q(user_id=self.user_id)


def day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, UTC)


def day_end(day: date) -> datetime:
    """Where the UTC day ends: the next day's start, or for the last day a
    calendar has (9999-12-31) its last microsecond, which has no next day."""
    if day == date.max:
        return datetime.combine(day, time.max, UTC)
    return day_start(day + timedelta(1))


def live_runs(scope: Scope, now: datetime) -> list[LiveRun]:
    """The scope's running attempts, charged up to ``now`` by the charging rule,
    per GPU and UTC day (``portal.accounting.live``: one query)."""
    return list(
        live.load(now, user_id=scope.user_id, group_id=scope.group_id).per_gpu()
    )


@dataclass
class UsageReport:
    """What the Usage page shows for a scope and a range of UTC days."""

    first: date
    last: date
    days: list[date]
    # username -> GPU-hours per day of ``days`` (the stacked area)
    series: dict[str, list[float]]
    gpu_hours: float
    running_gpu_hours: float
    energy_kwh: float | None
    efficiency: float | None  # mean GPU utilisation (%) over the GPU time held
    top_jobs: list[dict[str, Any]] = field(default_factory=list)
    # Work lost by attempts stopped to be requeued (preempted, evicted, requeued):
    # their run after their last checkpoint, charged to nobody, so not in
    # ``gpu_hours`` nor ``series``; and the jobs that lost most.
    lost_gpu_hours: float = 0.0
    lost_jobs: list[dict[str, Any]] = field(default_factory=list)


def report(scope: Scope, first: date, last: date, now: datetime) -> UsageReport:
    """The scope's usage from ``first`` to ``last`` (UTC days, inclusive)."""
    days = [first + timedelta(d) for d in range((last - first).days + 1)]
    rows = DailyUsage.objects.filter(scope.q(), day__gte=first, day__lte=last)
    per_user_day: dict[int, dict[date, float]] = defaultdict(dict)
    for user_id, day, seconds in (
        rows.values("user_id", "day")
        .annotate(s=Sum("gpu_seconds"))
        .values_list("user_id", "day", "s")
    ):
        per_user_day[user_id][day] = float(seconds)
    totals = rows.aggregate(
        lost=Sum("lost_gpu_seconds"),
        energy=Sum("energy_j"),
        busy=Sum("busy_gpu_seconds"),
        measured=Sum("gpu_seconds", filter=Q(busy_gpu_seconds__isnull=False)),
    )
    per_job: dict[int, float] = {
        job_id: float(s)
        for job_id, s in rows.values("job_id")
        .annotate(s=Sum("gpu_seconds"))
        .order_by("-s")
        .values_list("job_id", "s")[:10]
    }
    running = 0.0
    for run in live_runs(scope, now):
        for day, seconds in run.by_day.items():
            if first <= day <= last:
                user_day = per_user_day[run.user_id]
                user_day[day] = user_day.get(day, 0.0) + seconds
                per_job[run.job_id] = per_job.get(run.job_id, 0.0) + seconds
                running += seconds
    names = dict(
        get_user_model()
        .objects.filter(pk__in=per_user_day)
        .values_list("pk", "username")
    )
    series = {
        names.get(user_id, str(user_id)): [
            round(by_day.get(d, 0.0) / 3600, 4) for d in days
        ]
        for user_id, by_day in sorted(
            per_user_day.items(), key=lambda kv: names.get(kv[0], "")
        )
    }
    lost_per_job = list(
        rows.filter(lost_gpu_seconds__gt=0)
        .values("job_id")
        .annotate(s=Sum("lost_gpu_seconds"))
        .order_by("-s", "job_id")
        .values_list("job_id", "s")[:10]
    )
    top = sorted(per_job.items(), key=lambda kv: -kv[1])[:10]
    jobs = Job.objects.in_bulk([j for j, _ in top] + [j for j, _ in lost_per_job])
    measured = float(totals["measured"] or 0.0)
    return UsageReport(
        first=first,
        last=last,
        days=days,
        series=series,
        gpu_hours=sum(sum(v) for v in series.values()),
        running_gpu_hours=running / 3600,
        energy_kwh=None
        if totals["energy"] is None
        else float(totals["energy"]) / 3.6e6,
        efficiency=float(totals["busy"]) / measured * 100 if measured else None,
        top_jobs=[{"job": jobs[j], "gpu_hours": s / 3600} for j, s in top if j in jobs],
        lost_gpu_hours=float(totals["lost"] or 0.0) / 3600,
        lost_jobs=[
            {"job": jobs[j], "gpu_hours": float(s) / 3600}
            for j, s in lost_per_job
            if j in jobs
        ],
    )


CSV_HEADER = (
    "job",
    "job_name",
    "attempt",
    "user",
    "group",
    "gpu",
    "start",
    "end",
    "gpu_hours",
    "share",
    "energy_kwh",
    "lost_gpu_hours",
)


def csv_rows(
    scope: Scope, first: date, last: date, now: datetime
) -> Iterator[list[str]]:
    """One row per usage record (an attempt on one GPU) whose run overlaps the UTC
    days ``first`` to ``last``, with its whole charge and, apart, the work it
    lost when stopped to be requeued (``lost_gpu_hours``, charged to nobody);
    then the running attempts (end empty, charged up to ``now`` at their current
    share, nothing lost). Streamed."""
    since, until = day_start(first), day_end(last)
    gpu_names = {
        g.pk: f"{g.node.name}:{g.index}" for g in Gpu.objects.select_related("node")
    }
    yield list(CSV_HEADER)
    records = (
        UsageRecord.objects.filter(scope.q(), started_at__lt=until, ended_at__gte=since)
        .order_by("started_at", "attempt_id", "gpu_id")
        .values_list(
            "attempt__job_id",
            "attempt__job__name",
            "attempt__number",
            "user__username",
            "group__name",
            "gpu_id",
            "started_at",
            "ended_at",
            "gpu_seconds",
            "share",
            "energy_j",
            "lost_gpu_seconds",
        )
    )
    for (
        job,
        name,
        number,
        user,
        group,
        gpu,
        start,
        end,
        seconds,
        share,
        energy,
        lost,
    ) in records.iterator(chunk_size=2000):
        yield [
            str(job),
            name,
            str(number),
            user,
            group,
            gpu_names.get(gpu, str(gpu)),
            start.isoformat(),
            end.isoformat(),
            f"{seconds / 3600:.6f}",
            f"{share:.6f}",
            "" if energy is None else f"{energy / 3.6e6:.6f}",
            f"{lost / 3600:.6f}",
        ]
    live = [
        run
        for run in (live_runs(scope, now) if now >= since else [])
        if run.start < until.timestamp()
    ]
    if not live:
        return
    attempts = {
        a.pk: a
        for a in Attempt.objects.filter(
            pk__in={r.attempt_id for r in live}
        ).select_related("job__owner", "job__group")
    }
    for run in sorted(live, key=lambda r: (r.start, r.attempt_id, r.gpu_id)):
        attempt = attempts[run.attempt_id]
        duration = now.timestamp() - run.start
        yield [
            str(attempt.job_id),
            attempt.job.name,
            str(attempt.number),
            attempt.job.owner.username,
            attempt.job.group.name,
            gpu_names.get(run.gpu_id, str(run.gpu_id)),
            datetime.fromtimestamp(run.start, UTC).isoformat(),
            "",
            f"{run.gpu_seconds / 3600:.6f}",
            f"{run.gpu_seconds / duration if duration > 0 else 1.0:.6f}",
            "",
            f"{0.0:.6f}",
        ]


def groups_visible_to(user: Any) -> list[Group]:
    """Groups whose usage the user may see: all for staff, those they lead."""
    if user.is_staff:
        return list(Group.objects.order_by("name"))
    return list(
        Group.objects.filter(
            membership__user=user, membership__is_leader=True
        ).order_by("name")
    )


def job_charges(job_id: int) -> dict[str, float | None]:
    """What a job's ended attempts were charged: GPU-hours, the GPU-hours its
    requeued attempts lost (charged to nobody) and energy (kWh, None when no GPU
    of it reported an energy counter). One query."""
    totals = UsageRecord.objects.filter(attempt__job_id=job_id).aggregate(
        seconds=Sum("gpu_seconds"),
        lost=Sum("lost_gpu_seconds"),
        energy=Sum("energy_j"),
    )
    seconds, energy = totals["seconds"], totals["energy"]
    return {
        "gpu_hours": None if seconds is None else float(seconds) / 3600,
        "lost_gpu_hours": float(totals["lost"] or 0.0) / 3600,
        "energy_kwh": None if energy is None else float(energy) / 3.6e6,
    }
