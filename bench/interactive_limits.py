"""Interactive jobs at their time limit and when culled idle: how long past the
limit (or the cull) their processes live, and whether their GPUs are released.

    python -m portal.stack.run -- python bench/interactive_limits.py [--jobs 4]

A fresh database and ``make up``'s processes on it (``bench/real_stack.py``,
``--cluster`` default ``2x8:A100-80GB``), agents running this venv's JupyterLab
as a Unix account of its own (run as root; ``tests.interactive.accounts``), with
short settings: ``GPULAB_KILL_GRACE`` ``--grace`` (10 s),
``GPULAB_INTERACTIVE_IDLE_TIMEOUT`` ``--idle-timeout`` (120 s, warning 30 s
before), the idle check every 2 s and samples persisted every second. The
simulated GPUs report every job at 60 % SM (a job cannot choose otherwise), so
``GPULAB_IDLE_THRESHOLD`` is 100: every simulated GPU counts as idle, as a real
idle notebook's GPU at 0 %; what keeps a job alive is then its use through the
portal only.

One user starts, at once:

- ``--jobs`` JupyterLab jobs with a ``--limit`` (60 s) time limit, each with a
  kernel opened through the proxy (``interactive_load.Kernel``);
- ``--jobs`` terminal jobs with the same limit, each with a terminal running a
  program that ignores SIGTERM, SIGHUP and SIGINT (only SIGKILL ends it);
- ``--jobs`` JupyterLab jobs with a 600 s limit and a kernel opened, then left
  alone: the idle check must cull them.

Meanwhile every process is watched in ``/proc`` every 0.2 s: the job's own
process group (``Attempt.pid``), its kernel (its pid, printed by the kernel)
or its terminal's program (printed by it). Per job, once everything ended:

- limit jobs: ``overrun`` = the last of its processes gone - (started +
  limit), beside the kill grace (the goal: overrun <= grace), and the job's
  recorded end - (started + limit);
- culled jobs: culled (cancelled by the idle check), the last process gone -
  the cancel, every ``Allocation`` of the job released, and the GPU's first
  sample after the end listing none of the job's processes.

Prints a row per job and the maxima; writes ``<out-dir>/interactive_limits.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interactive_load import Kernel, make_users, session_cookie
from real_stack import ROOT, bench_record, interactive_stack, is_root, loadavg
from terminal_rtt import open_terminal, ws_url

sys.path.insert(0, str(ROOT))

STUBBORN = "trap '' TERM HUP INT; echo PID=$$; exec sleep 3600"
KERNEL_PID = "import os; print('PID=%d' % os.getpid())"
POLL_S = 0.2


def live_processes() -> dict[int, int]:
    """pid -> process group of every process that is not a zombie."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            out[int(entry.name)] = int(fields[2])
    return out


def submit(api: httpx.Client, kind: str, limit: int, workdir: str) -> int:
    resp = api.post(
        "/api/v1/jobs/",
        json={"interactive": kind, "time_limit_s": limit, "workdir": workdir},
    )
    if resp.status_code != 201:
        raise RuntimeError(f"POST {kind}: {resp.status_code} {resp.text[:300]}")
    return int(resp.json()["id"])


def job_row(job_id: int) -> dict[str, Any]:
    from scheduler.models import Attempt, Job

    job = Job.objects.get(pk=job_id)
    attempt = Attempt.objects.filter(job_id=job_id).order_by("number").last()
    return {
        "state": job.status,
        "limit": job.time_limit_s,
        "grace": job.kill_grace_s,
        "cancel_requested": _ts(job.cancel_requested_at),
        "attempt": None if attempt is None else attempt.pk,
        "pid": None if attempt is None else attempt.pid,
        "started": None if attempt is None else _ts(attempt.started_at),
        "ended": None if attempt is None else _ts(attempt.ended_at),
        "terminal": job.is_terminal,
    }


def _ts(at: Any) -> float | None:
    return None if at is None else at.timestamp()


async def open_kernel(base_url: str, cookie: str, job_id: int) -> int:
    """A kernel in the job's JupyterLab once it answers; the kernel's pid."""
    async with httpx.AsyncClient(timeout=60) as http:
        url = f"{base_url}/interactive/{job_id}/api/status"
        deadline = time.monotonic() + 300
        while (await http.get(url, headers={"Cookie": cookie})).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id}: JupyterLab not answering")
            await asyncio.sleep(0.3)
        kernel = await Kernel(base_url, cookie, job_id).open(http)
        printed = await kernel.run(KERNEL_PID)
        assert kernel.ws is not None
        await kernel.ws.close()  # the kernel lives on in JupyterLab
        return int(re.search(r"PID=(\d+)", printed).group(1))  # type: ignore[union-attr]


async def open_stubborn_terminal(base_url: str, token: str, job_id: int) -> int:
    """A terminal running a program only SIGKILL ends; its pid."""
    from scheduler.models import Job

    deadline = time.monotonic() + 300
    while True:
        status = await asyncio.to_thread(
            lambda: Job.objects.values_list("status", flat=True).get(pk=job_id)
        )
        if status == "running":
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"terminal job {job_id} not running")
        await asyncio.sleep(0.2)
    ws, _ = await open_terminal(ws_url(base_url, job_id), token, STUBBORN)
    seen = ""
    async with asyncio.timeout(60):
        while (m := re.search(r"PID=(\d+)", seen)) is None:
            message = json.loads(await ws.recv())
            if message["type"] == "output":
                seen += message["data"]
    await ws.close()  # the terminal lives on with its job
    return int(m.group(1))


async def open_all(
    base_url: str, token: str, cookie: str, kinds: dict[int, str]
) -> dict[int, int | str]:
    async def one(job_id: int, kind: str) -> int | str:
        try:
            if kind == "terminal":
                return await open_stubborn_terminal(base_url, token, job_id)
            return await open_kernel(base_url, cookie, job_id)
        except Exception as exc:  # the job may reach its limit first
            return repr(exc)

    got = await asyncio.gather(*(one(j, k) for j, k in kinds.items()))
    return dict(zip(kinds, got, strict=True))


def watch(jobs: dict[int, dict[str, Any]], timeout: float) -> None:
    """Until every job ended and all its processes are gone (or ``timeout``):
    each process's last time seen alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.time()
        live = live_processes()
        pending = False
        for job_id, job in jobs.items():
            if not job.get("terminal"):
                job.update({k: v for k, v in job_row(job_id).items() if v is not None})
            pgid = job.get("pid")
            if pgid is not None and any(g == pgid for g in live.values()):
                job["group_seen"] = now
            helper = job.get("helper_pid")
            if isinstance(helper, int) and helper in live:
                job["helper_seen"] = now
            if (
                not job.get("terminal")
                or job.get("group_seen", 0) >= now
                or (isinstance(helper, int) and job.get("helper_seen", 0) >= now)
            ):
                pending = True
        if not pending:
            return
        time.sleep(POLL_S)


def released(job_id: int, ended: float | None) -> dict[str, Any]:
    """The job's allocations all released, and its GPUs' first sample after its
    end listing none of its processes."""
    from datetime import UTC, datetime

    from scheduler.models import Allocation, GpuSample

    allocs = list(Allocation.objects.filter(attempt__job_id=job_id))
    attempts = {a.attempt_id for a in allocs}
    clean = True
    if ended is not None:
        after = datetime.fromtimestamp(ended, UTC)
        for alloc in allocs:
            # The agent's next persisted sample (every second here).
            deadline = time.monotonic() + 15
            while True:
                sample = (
                    GpuSample.objects.filter(gpu_id=alloc.gpu_id, at__gt=after)
                    .order_by("at")
                    .first()
                )
                if sample is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            procs = [] if sample is None else (sample.processes or [])
            if sample is None or any(p.get("attempt_id") in attempts for p in procs):
                clean = False
    return {
        "allocations": len(allocs),
        "unreleased": sum(1 for a in allocs if a.released_at is None),
        "gpu_sample_clean": clean,
    }


def culled_by_idle(job_id: int) -> bool:
    from portal.idle.models import IdleFlag

    return IdleFlag.objects.filter(job_id=job_id, cancelled_at__isnull=False).exists()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--grace", type=int, default=10)
    parser.add_argument("--idle-timeout", type=int, default=120)
    parser.add_argument("--cluster", default="2x8:A100-80GB")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not is_root():
        return 1
    extra_env = {
        "GPULAB_INTERACTIVE_MAX_PER_USER": str(3 * args.jobs),
        "GPULAB_KILL_GRACE": str(args.grace),
        "GPULAB_INTERACTIVE_IDLE_TIMEOUT": str(args.idle_timeout),
        "GPULAB_INTERACTIVE_IDLE_WARNING": "30",
        "GPULAB_IDLE_CHECK_INTERVAL": "2",
        "GPULAB_METRICS_PERSIST_INTERVAL": "1",
        "GPULAB_IDLE_THRESHOLD": "100",
    }
    result = bench_record(settings={**extra_env, "limit": args.limit})
    with interactive_stack(
        "interactive_limits", args.cluster, make_users, extra_env
    ) as lab:
        api, workdir, token = lab.api, lab.workdir, lab.token
        cookie = session_cookie(lab.stack.base_url, "bench-owner")
        kinds: dict[int, str] = {}
        for _ in range(args.jobs):
            kinds[submit(api, "jupyter", args.limit, str(workdir))] = "limit"
            kinds[submit(api, "shell", args.limit, str(workdir))] = "terminal"
            kinds[submit(api, "jupyter", 600, str(workdir))] = "culled"
        helpers = asyncio.run(open_all(lab.stack.base_url, token, cookie, kinds))
        jobs: dict[int, dict[str, Any]] = {
            j: {"kind": k, "helper_pid": helpers[j]} for j, k in kinds.items()
        }
        watch(jobs, timeout=args.idle_timeout + 600)
        for job_id, job in jobs.items():
            job.update(job_row(job_id))
            job.update(released(job_id, job.get("ended")))
            job["culled_by_idle"] = culled_by_idle(job_id)
    result["load_end"] = loadavg()
    result["jobs"] = jobs
    report(jobs, result)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interactive_limits.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def report(jobs: dict[int, dict[str, Any]], result: dict[str, Any]) -> None:
    def gone(job: dict[str, Any]) -> float | None:
        seen = [job.get("group_seen"), job.get("helper_seen")]
        times = [t for t in seen if t is not None]
        return max(times) + POLL_S if times else None

    overruns, after_cull = [], []
    print(
        "job  kind      state      helper  overrun(procs)  overrun(recorded)"
        "  after cull  grace  allocs unreleased  gpu clean"
    )
    for job_id, job in sorted(jobs.items()):
        end = gone(job)
        over = rec = cull = None
        if job["kind"] != "culled" and job.get("started") and end:
            deadline = job["started"] + job["limit"]
            over = end - deadline
            overruns.append(over)
            if job.get("ended"):
                rec = job["ended"] - deadline
        if job["kind"] == "culled" and job.get("cancel_requested") and end:
            cull = end - job["cancel_requested"]
            after_cull.append(cull)
        helper = job["helper_pid"] if isinstance(job["helper_pid"], int) else "-"
        print(
            f"{job_id:>3}  {job['kind']:<8}  {job['state']:<9}  {helper!s:>6}"
            f"  {_f(over):>14}  {_f(rec):>17}  {_f(cull):>10}  {job['grace']:>5}"
            f"  {job['allocations']:>6} {job['unreleased']:>10}"
            f"  {job['gpu_sample_clean']!s:>9}"
        )
        if not isinstance(job["helper_pid"], int):
            print(f"     helper not opened: {job['helper_pid'][:200]}")
    culled = [j for j in jobs.values() if j["kind"] == "culled"]
    result["max_overrun_s"] = max(overruns, default=None)
    result["max_after_cull_s"] = max(after_cull, default=None)
    print(
        f"limit jobs: max overrun past the limit {_f(result['max_overrun_s'])} s"
        f" (kill grace {next(iter(jobs.values()))['grace']} s)"
    )
    print(
        f"culled: {sum(j['culled_by_idle'] for j in culled)}/{len(culled)} by the"
        f" idle check; processes gone at most {_f(result['max_after_cull_s'])} s"
        " after the cull;"
        f" unreleased allocations {sum(j['unreleased'] for j in culled)};"
        f" GPUs clean after {sum(j['gpu_sample_clean'] for j in culled)}/{len(culled)}"
    )
    print(f"load average at end: {result['load_end']}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
