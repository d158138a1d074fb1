"""What the web process logs for a refused request, with the real LOGGING
configuration in a process of its own: one line naming the refusal, no
traceback (a 4xx is the client's doing, not a fault of the server's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from portal.stack.embedded import REPO_ROOT
from tests.e2e.conftest import database_url

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db(transaction=True)

RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")
REQUEST = """
import sys, django
django.setup()
from django.contrib.auth.models import User
from django.test import Client
client = Client(HTTP_HOST="localhost")  # an allowed host (not testserver)
client.force_login(User.objects.get(username=sys.argv[1]))
response = client.get(sys.argv[2])
print(response.status_code, file=sys.stdout)
"""


def logged(debug: str, *args: str) -> tuple[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_DEBUG": debug,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "GPULAB_LOG_LEVEL": "INFO",
    }
    done = subprocess.run(
        [sys.executable, "-c", REQUEST, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip(), done.stderr


def records(log: str) -> list[str]:
    """The log's lines that start a record (LOGGING's "plain" format)."""
    return [line for line in log.splitlines() if RECORD.match(line)]


@pytest.mark.parametrize("debug", ["false", "true"])
def test_a_403_is_one_log_line_without_a_traceback(alice: User, debug: str) -> None:
    status, log = logged(debug, "alice", "/admin/")

    assert status == "403"
    lines = records(log)
    assert len(lines) == 1, log
    assert "Forbidden (Permission denied): /admin/" in lines[0]
    assert log.count("Forbidden") == 1  # not a second copy in another format
    assert "Traceback" not in log
    assert "PermissionDenied" not in log


def test_a_404_is_one_log_line(alice: User) -> None:
    status, log = logged("false", "alice", "/jobs/999999/")

    assert status == "404"
    lines = records(log)
    assert len(lines) == 1, log
    assert "Not Found: /jobs/999999/" in lines[0]
    assert log.count("Not Found") == 1


LINES = """
import logging, django
django.setup()
logging.getLogger("celery.beat").info("beat: Starting...")
logging.getLogger("celery.beat").info(
    "Scheduler: Sending due task %s (%s)", "schedule-pass", "scheduler.tasks.x"
)
logging.getLogger("celery.worker.strategy").info("Task %s[%s] received", "t", "1")
logging.getLogger("celery.app.trace").info("Task %s[%s] succeeded", "t", "1")
logging.getLogger("celery.app.trace").error("Task %s[%s] raised", "t", "2")
logging.getLogger("celery.beat").error("beat: could not reach the broker")
"""


@pytest.mark.parametrize(("setting", "info"), [(None, False), ("INFO", True)])
def test_each_periodic_task_run_is_logged_only_when_asked(
    setting: str | None, *, info: bool
) -> None:
    """Celery's line per task sent, received and succeeded (the pass runs every
    few seconds) only with GPULAB_TASK_LOG_LEVEL=INFO; beat's start, warnings and
    failures always."""
    env = {k: v for k, v in os.environ.items() if k != "GPULAB_TASK_LOG_LEVEL"}
    if setting is not None:
        env["GPULAB_TASK_LOG_LEVEL"] = setting
    log = subprocess.run(
        [sys.executable, "-c", LINES],
        env={**env, "DJANGO_SETTINGS_MODULE": "portal.settings"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stderr

    assert "beat: Starting..." in log
    assert "raised" in log
    assert "could not reach the broker" in log
    for per_task in ("Sending due task schedule-pass", "received", "succeeded"):
        assert (per_task in log) is info, log
