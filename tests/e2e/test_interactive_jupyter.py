"""JupyterLab interactive jobs end to end: the real stack (uvicorn with the
proxy, a Celery worker, a simulated node's agent), a real JupyterLab started by
the agent as a non-root account, and Chromium through the portal's proxy.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.browser import chromium, log_in, outside_the_loop
from tests.e2e.conftest import login, wait_for_job, wait_until
from tests.interactive.accounts import jupyter_account, root_only

if TYPE_CHECKING:
    import pwd
    from collections.abc import Iterator

    import httpx
    from django.contrib.auth.models import User

    from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), root_only]

# Generous: the machine is shared and JupyterLab's page is heavy; nothing here
# measures speed (bench/interactive_start.py does).
WAIT_MS = 180_000


@pytest.fixture(scope="module")
def account() -> Iterator[pwd.struct_passwd]:
    with jupyter_account() as acct:
        yield acct


def jupyter_stack(stack: Stack) -> None:
    """The node's agent finds this venv's jupyter on its PATH, and binds
    JupyterLab to loopback (the portal's address for this one-machine cluster)."""
    bin_dir = str(Path(sys.executable).parent)
    stack.env["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    stack.env["GPULAB_JUPYTER_HOST"] = "127.0.0.1"
    stack.env.pop("GPULAB_JUPYTER_COMMAND", None)
    stack.start_node("lab-node", "2xA100-80GB", 2)


def stack_workdir(account: pwd.struct_passwd) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="gpulab-lab-", dir="/tmp"))
    workdir.chmod(0o755)
    os.chown(workdir, account.pw_uid, account.pw_gid)
    return workdir


def give_account(user: User, name: str) -> None:
    from scheduler.models import Profile

    Profile.objects.update_or_create(user=user, defaults={"unix_account": name})


def job_token(job_id: int) -> str:
    from scheduler.models import Job

    return str(Job.objects.values_list("interactive_token", flat=True).get(pk=job_id))


def test_a_notebook_cell_runs_on_the_jobs_gpus_through_the_portal(
    stack: Stack, alice: User, bob: User, account: pwd.struct_passwd
) -> None:
    from playwright.sync_api import expect

    give_account(alice, account.pw_name)
    jupyter_stack(stack)
    # A directory of the account's own: JupyterLab saves notebooks there.
    workdir = stack_workdir(account)

    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        log_in(page, stack.base_url, "alice", "pw-alice")
        page.goto(f"{stack.base_url}/jobs/new/")
        page.get_by_test_id("start-jupyter").click()
        page.fill("input[name=gpus]", "1")
        page.fill("input[name=workdir]", str(workdir))
        page.get_by_role("button", name="Start JupyterLab").click()
        page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
        job_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
        token = outside_the_loop(lambda: job_token(job_id))

        # Open appears without a reload once the agent reports the server.
        open_button = page.get_by_test_id("open-interactive")
        expect(open_button).to_be_visible(timeout=WAIT_MS)
        assert open_button.get_attribute("href") == f"/interactive/{job_id}/lab"
        page.reload()  # the request's facts are not live: the command that ran
        expect(page.get_by_test_id("interactive-command")).to_contain_text(
            f"{Path(sys.executable).parent}/jupyter lab"
        )
        assert token not in page.content()

        lab = context.new_page()  # a tab beside it: the same session
        seen: list[str] = []
        lab.on("response", lambda r: seen.append(r.url))
        lab.goto(f"{stack.base_url}/interactive/{job_id}/lab")
        lab.locator('.jp-LauncherCard[data-category="Notebook"]').first.click(
            timeout=WAIT_MS
        )
        # A cell run before its kernel is connected is dropped: wait for it.
        expect(lab.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(
            timeout=WAIT_MS
        )
        cell = lab.locator(".jp-Notebook .jp-Cell .cm-content").first
        cell.click(timeout=WAIT_MS)
        lab.keyboard.type(
            "import os; print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES'])"
        )
        lab.keyboard.press("Shift+Enter")
        output = lab.locator(".jp-OutputArea-output").first
        expect(output).to_contain_text("gpus=GPU-", timeout=WAIT_MS)
        printed = output.inner_text().strip()
        assert token not in lab.content()
        assert all(token not in url for url in seen)
        assert token not in str(lab.context.cookies())

    # What ran is the job's GPU: the one the portal allocated.
    from scheduler.models import Allocation

    uuids = outside_the_loop(
        lambda: list(
            Allocation.objects.filter(attempt__job_id=job_id).values_list(
                "gpu__uuid", flat=True
            )
        )
    )
    assert printed == f"gpus={uuids[0]}"

    # Bob (same lab group) gets the 404 of a job that does not exist, on the
    # proxy (page and websocket path) and in the API.
    other = login(stack.base_url, "bob", "pw-bob")
    assert other.get(f"/interactive/{job_id}/lab").status_code == 404
    assert other.get(f"/interactive/{job_id}/api/kernels").status_code == 404
    assert other.get(f"/interactive/{job_id + 1000}/lab").status_code == 404
    # The owner's session reaches it; without a session the browser is sent to sign in.
    owner = login(stack.base_url, "alice", "pw-alice")
    assert owner.get(f"/interactive/{job_id}/api/status").status_code == 200
    anonymous = owner.__class__(base_url=stack.base_url)
    signin = anonymous.get(f"/interactive/{job_id}/lab")
    assert signin.status_code == 302
    assert signin.headers["location"] == (
        f"/accounts/login/?next=/interactive/{job_id}/lab"
    )

    owner.post(
        f"/jobs/{job_id}/cancel/",
        data={"csrfmiddlewaretoken": owner.cookies["csrftoken"]},
    )
    wait_for_job(job_id, {"cancelled"}, timeout=120)
    gone = owner.get(f"/interactive/{job_id}/lab")
    assert gone.status_code == 410
    assert "has ended" in gone.text
    shutil.rmtree(workdir, ignore_errors=True)


def test_jupyterlab_that_cannot_start_fails_the_job_with_the_reason(
    stack: Stack, bob: User
) -> None:
    from scheduler import services
    from scheduler.models import Job

    jupyter_stack(stack)
    # Bob has no Unix account: the job would run as the agent's root.
    job = services.submit_job(bob, services.interactive_request("jupyter"))
    assert wait_for_job(job.pk, {"failed"}, timeout=120) == "failed"
    job.refresh_from_db()
    assert "could not be started: JupyterLab is never run as root" in job.end_reason
    client = login(stack.base_url, "bob", "pw-bob")
    page = client.get(f"/jobs/{job.pk}/")
    assert "JupyterLab is never run as root" in page.text
    assert Job.objects.get(pk=job.pk).interactive_token not in page.text


def kernel_socket(
    client: httpx.Client, job_id: int, kernel_id: str
) -> ClientConnection:
    """The kernel's websocket through the proxy, with the client's session."""
    url = str(client.base_url).replace("http://", "ws://").rstrip("/")
    cookie = "; ".join(f"{k}={v}" for k, v in client.cookies.items())
    return connect(
        f"{url}/interactive/{job_id}/api/kernels/{kernel_id}/channels"
        f"?session_id={uuid.uuid4().hex}",
        additional_headers={"Cookie": cookie},
    )


def run_cell(ws: ClientConnection, code: str) -> str:
    """Run ``code`` in the kernel (Jupyter's JSON frames, messaging 5.3); what it
    printed, once its reply and the kernel's idle status are back."""
    msg_id = uuid.uuid4().hex
    ws.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id, "username": "alice", "session": uuid.uuid4().hex,
                    "msg_type": "execute_request", "version": "5.3",
                    "date": dt.datetime.now(dt.UTC).isoformat(),
                },
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {
                    "code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False,
                },
            }
        )
    )  # fmt: skip
    printed, replied, idle = "", False, False
    while not (replied and idle):
        frame = json.loads(ws.recv(timeout=120))
        if frame["parent_header"].get("msg_id") != msg_id:
            continue
        kind = frame["header"]["msg_type"]
        if kind == "stream":
            printed += frame["content"]["text"]
        elif kind == "error":
            raise AssertionError(f"the cell failed: {frame['content']}")
        elif kind == "execute_reply":
            replied = True
        elif kind == "status" and frame["content"]["execution_state"] == "idle":
            idle = True
    return printed.strip()


def test_a_notebooks_kernel_lives_on_across_a_web_process_restart(
    stack: Stack, alice: User, account: pwd.struct_passwd
) -> None:
    from scheduler import services

    give_account(alice, account.pw_name)
    jupyter_stack(stack)
    workdir = stack_workdir(account)
    job = services.submit_job(
        alice, services.interactive_request("jupyter", workdir=str(workdir))
    )
    assert wait_for_job(job.pk, {"running"}, timeout=120) == "running"
    owner = login(stack.base_url, "alice", "pw-alice")
    base = f"/interactive/{job.pk}/"
    wait_until(
        lambda: owner.get(base + "api/status").status_code == 200,
        timeout=180,
        what="JupyterLab answering through the proxy",
    )
    server_started = owner.get(base + "api/status").json()["started"]
    created = owner.post(base + "api/kernels", json={"name": "python3"})
    assert created.status_code == 201, created.text
    kernel_id = created.json()["id"]
    with kernel_socket(owner, job.pk, kernel_id) as ws:
        kernel_pid = run_cell(ws, "import os; x = 6 * 7; print(os.getpid())")
        # The web process goes: the notebook's socket is closed (not left
        # hanging), and the next one, through the new web process, reaches
        # the same server and the same kernel, which still has its variable.
        stack.restart_web("web-2")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
    after = owner.get(base + "api/status")
    assert after.status_code == 200
    assert after.json()["started"] == server_started
    assert [k["id"] for k in owner.get(base + "api/kernels").json()] == [kernel_id]
    with kernel_socket(owner, job.pk, kernel_id) as again:
        assert run_cell(again, "print(os.getpid(), x)") == f"{kernel_pid} 42"
    assert wait_for_job(job.pk, {"running"}) == "running"

    services.cancel_job(job.pk, by=alice)
    assert wait_for_job(job.pk, {"cancelled"}, timeout=120) == "cancelled"
    shutil.rmtree(workdir, ignore_errors=True)
