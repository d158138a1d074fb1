"""``python -m portal.stack.screenshots``: the README's screenshots, from a demo.

Run it through the stack runner, which provides (or starts) PostgreSQL and Redis:
``python -m portal.stack.run -- python -m portal.stack.screenshots``.

1. A fresh database (dropped at the end) with a 64-GPU lab: six nodes of eight
   simulated A100s run by real agents (one of them loses GPU 5), one node whose
   GPUs someone else's process uses (the script speaks the agent protocol for it;
   it is in maintenance), and one node that went silent (lost); users of three
   groups; 7 days of history (samples, minute and hour rollups).
2. The real processes: uvicorn, a Celery worker, the agents.
3. Jobs submitted through the services as users would (some too big to start
   now, one held), then a wait for them to run and the metrics to flow.
4. Chromium (Playwright, Debian's) signed in as ``alice``, one screenshot per main
   page into ``docs/screenshots/`` (``--out``): cluster, queue, node, GPU, job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from portal.stack.up import web_argv

REPO = Path(__file__).resolve().parents[2]
NAMES = [
    "resnet50-imagenet",
    "llama-7b-finetune",
    "bert-base-squad",
    "sd-v2-dreambooth",
    "vit-b16-cifar",
    "whisper-small-asr",
    "gpt2-medium-lm",
    "detr-coco",
    "t5-large-summ",
    "ppo-atari",
    "unet-brats",
    "mae-pretrain",
]


def _db_url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Procs:
    """Child processes, stopped together."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()


def setup_django(db_url: str) -> None:
    os.environ["DATABASE_URL"] = db_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def people() -> dict[str, Any]:
    from django.contrib.auth.models import User

    from scheduler.models import Group, Membership

    groups = {n: Group.objects.create(name=n) for n in ("vision", "nlp", "rl")}
    users = {}
    for name, group in (
        ("alice", "vision"),
        ("bob", "vision"),
        ("chen", "nlp"),
        ("dana", "nlp"),
        ("emil", "rl"),
    ):
        users[name] = User.objects.create_user(name, password=f"pw-{name}-demo")
        Membership.objects.create(user=users[name], group=groups[group])
    return users


def history(since_days: int = 7) -> None:
    """Smooth made-up curves: raw samples every 10 s for the last 2 hours, minute
    rollups for 7 hours, hour rollups for 7 days."""
    from django.db import connection
    from django.utils import timezone

    from scheduler import metrics

    now = timezone.now()
    with connection.cursor() as cursor:
        metrics.ensure_partitions(cursor, now)
        curve = (
            "greatest(0, least(100, 55 + 40 * sin(extract(epoch FROM {t}) / 1800.0"
            " + g.id) + (abs(hashtext(g.id::text || {t}::text)) %% 9)))"
        )
        cursor.execute(
            f"""
            INSERT INTO scheduler_gpusample (gpu_id, at, util_gpu, memory_used_mib,
                temperature_c, power_w, lost, processes)
            SELECT g.id, t, {curve.format(t="t")}, 20000 + 15000 * sin(g.id + 0.0),
                   45 + 0.3 * {curve.format(t="t")}, 80 + 3 * {curve.format(t="t")},
                   false, '[]'::jsonb
            FROM scheduler_gpu g, generate_series(%(since)s::timestamptz,
                 %(now)s::timestamptz, interval '10 seconds') t
            """,
            {"since": now - timedelta(hours=2), "now": now},
        )
        for resolution, width, span in (
            ("1m", "1 minute", timedelta(hours=7)),
            ("1h", "1 hour", timedelta(days=since_days)),
        ):
            cursor.execute(
                f"""
                INSERT INTO scheduler_gpurollup (gpu_id, resolution, start, samples,
                    util_gpu_mean, memory_used_mean, power_mean, temperature_mean)
                SELECT g.id, %(res)s, t, 6, {curve.format(t="t")},
                       20000 + 15000 * sin(g.id + 0.0), 80 + 3 * {curve.format(t="t")},
                       45 + 0.3 * {curve.format(t="t")}
                FROM scheduler_gpu g, generate_series(
                    date_bin(%(width)s::interval, %(since)s::timestamptz,
                             TIMESTAMPTZ 'epoch'),
                    %(now)s::timestamptz, %(width)s::interval) t
                ON CONFLICT DO NOTHING
                """,
                {"res": resolution, "width": width, "since": now - span, "now": now},
            )


async def foreign_node(url: str, token: str, name: str, stop: asyncio.Event) -> None:
    """A node whose GPUs run processes nobody scheduled, spoken for by this
    script in the agent protocol."""
    from websockets.asyncio.client import connect

    from agents import protocol

    gpus = [
        protocol.GpuInfo(
            index=i, uuid=f"GPU-{name}-{i}", name="NVIDIA A100-80GB",
            memory_total_mib=81920,
        )
        for i in range(8)
    ]  # fmt: skip
    async with connect(
        f"{url}/ws/agent/", additional_headers=[("Authorization", f"Bearer {token}")]
    ) as ws:
        reader = asyncio.create_task(_drain(ws))
        hello = protocol.HelloData(
            agent_version="demo", hostname=name, incarnation=uuid.uuid4().hex,
            driver_version="550.54.15", cuda_version="12.4", gpus=gpus,
        )  # fmt: skip
        seq = 1
        await ws.send(
            protocol.Hello(seq=seq, ts=time.time(), data=hello).model_dump_json()
        )
        while not stop.is_set():
            seq += 1
            now = time.time()
            samples = []
            for g in gpus:
                busy = g.index in (2, 3)
                util = 70 + 20 * math.sin(now / 60 + g.index) if busy else 0.0
                procs = [
                    protocol.ProcessSample(pid=31337 + g.index, used_memory_mib=22000)
                ]
                samples.append(
                    protocol.GpuSample(
                        index=g.index, uuid=g.uuid, util_gpu=round(util, 1),
                        memory_used_mib=22400 if busy else 400, memory_total_mib=81920,
                        temperature_c=70.0 if busy else 33.0,
                        power_w=310.0 if busy else 55.0,
                        processes=procs if busy else [],
                    )
                )  # fmt: skip
            data = protocol.MetricsData(sampled_at=now, gpus=samples)
            await ws.send(
                protocol.Metrics(seq=seq, ts=now, data=data).model_dump_json()
            )
            seq += 1
            beat = protocol.Heartbeat(seq=seq, ts=now, data=protocol.HeartbeatData())
            await ws.send(beat.model_dump_json())
            await asyncio.sleep(1)
        reader.cancel()


async def _drain(ws: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in ws:
            pass


def submit_jobs(users: dict[str, Any]) -> list[int]:
    from scheduler import services

    random.seed(7)
    ids = []
    plan = [
        ("alice", 1, 93), ("bob", 2, 78), ("chen", 4, 96), ("dana", 1, 35),
        ("emil", 1, 12), ("alice", 2, 64), ("chen", 8, 88), ("bob", 1, 97),
        ("dana", 4, 55), ("emil", 2, 81), ("alice", 1, 45), ("chen", 1, 99),
        ("bob", 4, 71), ("dana", 2, 90), ("emil", 1, 5), ("alice", 4, 84),
        # more than fits now: these wait, with their reasons
        ("chen", 8, 90), ("bob", 8, 80), ("alice", 4, 60), ("dana", 2, 70),
        ("emil", 8, 95), ("alice", 8, 50),
    ]  # fmt: skip
    for n, (who, gpus, util) in enumerate(plan):
        job = services.submit_job(
            users[who],
            services.JobRequest(
                name=f"{NAMES[n % len(NAMES)]}-{n:02d}",
                command=(
                    'for i in $(seq 100000); do echo "epoch $((i / 50)) step $i '
                    'loss $(( (100000 - i) % 997 ))e-3"; '
                    'echo "GPULAB_PROGRESS $i/100000"; sleep 1; done'
                ),
                gpus=gpus,
                env={
                    "GPULAB_SIM_UTIL": str(util),
                    "GPULAB_SIM_MEM_MIB": str(9000 + util * 600),
                },
            ),
        )
        ids.append(job.pk)
    return ids


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"screenshots: timed out waiting for {what}")


def shoot(base: str, out: Path, pages: dict[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(f"{base}/accounts/login/")
        page.fill("input[name=username]", "alice")
        page.fill("input[name=password]", "pw-alice-demo")
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/")
        for name, path in pages.items():
            page.goto(f"{base}{path}")
            page.wait_for_selector("#live-status.open")
            page.wait_for_timeout(3000)  # a few live updates: what a user sees
            page.screenshot(path=str(out / f"{name}.png"), full_page=True)
            print(f"screenshots: {out / f'{name}.png'}")  # noqa: T201
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "screenshots"))
    parser.add_argument("--settle", type=float, default=40.0, help="seconds of jobs")
    args = parser.parse_args()
    import psycopg

    url = os.environ["DATABASE_URL"]
    name = f"screenshots_{uuid.uuid4().hex[:8]}"
    admin = _db_url(url, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["GPULAB_REDIS_PREFIX"] = f"gpulab-shots-{uuid.uuid4().hex[:6]}"
    os.environ.setdefault("DJANGO_SECRET_KEY", "screenshots-only")
    tmp = Path(tempfile.mkdtemp(prefix="gpulab-shots-"))
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": _db_url(url, name),
        "DJANGO_SECURE_COOKIES": "false",
        "GPULAB_SCHEDULE_INTERVAL": "2",
    }
    procs = Procs(env, tmp)
    stop = asyncio.Event()
    try:
        setup_django(_db_url(url, name))
        from scheduler import services
        from scheduler.models import Job, Node

        users = people()
        py = sys.executable
        procs.start("web", *web_argv(port))
        procs.start(
            "worker", py, "-m", "celery", "-A", "portal", "worker", "--pool", "solo",
            "--concurrency", "1", "--without-gossip", "--without-mingle",
        )  # fmt: skip
        procs.start("beat", py, "-m", "celery", "-A", "portal", "beat",
                    "--schedule", str(tmp / "beat"))  # fmt: skip
        wait(lambda: _answers(port), 60, "the web server")
        server = f"ws://127.0.0.1:{port}"
        faults = tmp / "gpu-lost.json"
        faults.write_text(
            '{"gpus": {"count": 8, "model": "A100-80GB"}, "nvlink": true,'
            ' "faults": {"gpu_lost": [{"index": 5, "at": 5}]}}'
        )
        agents = {}
        for i in range(1, 8):
            node, token = services.create_node(f"gpu{i:02d}")
            token_file = tmp / f"gpu{i:02d}.token"
            token_file.write_text(token)
            spec = str(faults) if i == 2 else "8xA100-80GB:nvlink"
            agents[node.pk] = procs.start(
                f"agent-{i}", py, "-m", "agents", "--server", server, "--token-file",
                str(token_file), "--simulate", spec, "--state-dir", str(tmp / f"s{i}"),
                "--hostname", node.name, "--heartbeat", "2",
                *(["--allow-root-jobs"] if os.geteuid() == 0 else []),
            )  # fmt: skip
        foreign, foreign_token = services.create_node("gpu08")
        loop_thread = _thread_loop(foreign_node(server, foreign_token, "gpu08", stop))
        wait(
            lambda: Node.objects.filter(status=Node.Status.UP).count() == 8,
            90,
            "eight nodes up",
        )
        services.set_node_mode(foreign.pk, "maintenance", by=None)
        # gpu07 goes silent: its agent stops; the liveness check finds it.
        silent = Node.objects.get(name="gpu07")
        agents[silent.pk].terminate()
        history()
        ids = submit_jobs(users)
        wait(
            lambda: Job.objects.filter(pk__in=ids, status="running").count() >= 12,
            120,
            "the jobs to run",
        )
        waiting = Job.objects.filter(owner=users["alice"], status="pending").first()
        if waiting is not None:
            services.hold_job(waiting.pk, by=users["alice"])
        Node.objects.filter(pk=silent.pk).update(last_seen_at=_ago(3600))
        services.mark_lost_nodes()
        time.sleep(args.settle)  # the charts fill with live points
        mine = Job.objects.filter(
            owner=users["alice"], status="running", gpus__gte=2
        ).first()
        assert mine is not None
        gpu_node = mine.attempt_set.get(ended_at__isnull=True).node_id
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from django.db import connections

        connections.close_all()
        _in_thread(
            shoot,
            f"http://127.0.0.1:{port}",
            out,
            {
                "cluster": "/",
                "queue": "/queue/",
                "node": f"/nodes/{gpu_node}/",
                "gpu": f"/nodes/{gpu_node}/gpus/0/",
                "job": f"/jobs/{mine.pk}/",
            },
        )
        stop.set()
        loop_thread.join(10)
    finally:
        stop.set()
        procs.stop()
        stop_jobs(tmp)
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def stop_jobs(state: Path) -> None:
    """The demo's jobs outlive their agents (as on a real node: each runs under its
    shim); end them: their process groups, then their shims."""
    import signal

    for job in state.glob("s*/jobs/*"):
        for name, kill in (("pgid", os.killpg), ("shim.pid", os.kill)):
            with contextlib.suppress(OSError, ValueError):
                kill(int((job / name).read_text().split()[0]), signal.SIGKILL)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


def _ago(seconds: float) -> Any:
    from django.utils import timezone

    return timezone.now() - timedelta(seconds=seconds)


def _thread_loop(coro: Any) -> Any:
    import threading

    thread = threading.Thread(target=asyncio.run, args=(coro,), daemon=True)
    thread.start()
    return thread


def _in_thread(fn: Any, *args: Any) -> Any:
    """Playwright's sync API runs an event loop: keep it off Django's thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


if __name__ == "__main__":
    sys.exit(main())
