"""``gpulab`` commands against the live server, by what a user types and what a
script reads back: the request each option makes (checked on the stored
rows), the output, the errors and their exit codes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from portal.api.models import ApiToken
from portal.cli.errors import Exit
from portal.cli.main import cli
from scheduler import services
from scheduler.models import Attempt, Gpu, Job, JobArray, JobDependency, JobLogChunk
from scheduler.pass_runner import run_one_pass
from tests.e2e.conftest import free_port
from tests.factories import JobFactory, exited_data, start_job, started_data

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from scheduler.models import Node
    from tests.cli.conftest import Gpulab

pytestmark = pytest.mark.django_db(transaction=True)


# ------------------------------------------------------------------ no Django

# Runs a command the way the console script does, then lists what got imported.
_PROBE = """
import json, sys
from portal.cli.main import main
sys.argv = ["gpulab", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in {"django", "celery", "rest_framework",
                                      "channels", "scheduler", "kombu"})
portal = sorted(m for m in sys.modules if m.startswith("portal"))
print(json.dumps({"code": code, "heavy": heavy, "portal": portal}), file=sys.stderr)
"""


def test_running_the_cli_loads_no_django(
    gpulab: Gpulab, alice: User, tmp_path: Path
) -> None:
    job = JobFactory(owner=alice)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO", "DATABASE", "GPULAB"))
    }
    env.update(
        GPULAB_SERVER=gpulab.server,
        GPULAB_TOKEN=gpulab.token_of(alice),
        XDG_CONFIG_HOME=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "ls", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), done.stderr
    assert [j["id"] for j in json.loads(done.stdout)] == [job.pk]
    assert report["heavy"] == []
    assert set(report["portal"]) <= {
        "portal",
        "portal.units",
        *(f"portal.cli{m}" for m in ("", ".main", ".client", ".config", ".errors")),
        *(f"portal.cli.{m}" for m in ("app", "account", "submit", "jobs", "watch")),
        *(f"portal.cli.{m}" for m in ("interactive", "shell", "terminal")),
        "portal.cli.output",
    }


# ------------------------------------------------------------------ login


def test_login_checks_the_token_and_stores_it_for_you_only(
    gpulab: Gpulab, alice: User
) -> None:
    secret = gpulab.token_of(alice)
    got = gpulab("login", input=secret + "\n")
    assert got.exit_code == 0, got.output
    assert f"Logged in to {gpulab.server} as alice (token 'cli', no expiry)" in (
        got.stdout
    )
    path = gpulab.config_home / "gpulab" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {
        "server": gpulab.server,
        "tokens": {gpulab.server: secret},
    }
    # later commands need neither GPULAB_SERVER nor GPULAB_TOKEN
    me = gpulab("whoami", server=None)
    assert me.exit_code == 0, me.output
    assert me.stdout.startswith(f"alice on {gpulab.server} (groups: vision)")
    assert gpulab("logout", server=None).exit_code == 0
    out = gpulab("ls", server=None)
    assert out.exit_code == Exit.AUTH
    assert f"not logged in to {gpulab.server}" in out.stderr


def test_login_refuses_a_bad_token_and_stores_nothing(
    gpulab: Gpulab, alice: User
) -> None:
    token, secret = gpulab.token_of(alice), "gpl_wrong"
    assert token
    got = gpulab("login", input=secret + "\n")
    assert got.exit_code == Exit.AUTH
    assert "Invalid, expired or revoked token" in got.stderr
    assert "gpulab login" in got.stderr
    assert not (gpulab.config_home / "gpulab" / "config.json").exists()
    empty = gpulab("login", input="\n")
    assert (empty.exit_code, "no token given" in empty.stderr) == (Exit.USAGE, True)
    # a token on stdin leaves no way to ask for the server
    nowhere = gpulab("login", input=token + "\n", server=None)
    assert nowhere.exit_code == Exit.USAGE
    assert "which server? give --server URL" in nowhere.stderr
    assert not (gpulab.config_home / "gpulab" / "config.json").exists()


def test_a_stored_token_goes_only_to_its_server(gpulab: Gpulab, alice: User) -> None:
    assert gpulab("login", input=gpulab.token_of(alice) + "\n").exit_code == 0
    elsewhere = f"http://127.0.0.1:{free_port()}"
    got = gpulab("--server", elsewhere, "ls", server=None)
    assert got.exit_code == Exit.AUTH
    assert f"not logged in to {elsewhere}" in got.stderr


def test_an_unreachable_server_and_a_bad_url_are_named(
    gpulab: Gpulab, alice: User
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    got = gpulab("ls", user=alice, server=down)
    assert got.exit_code == Exit.NETWORK
    assert f"cannot reach {down}" in got.stderr
    bad = gpulab("ls", user=alice, server="gpulab.lab:8000")
    assert bad.exit_code == Exit.USAGE
    assert "'gpulab.lab:8000' is not a URL" in bad.stderr
    login = gpulab("login", input="gpl_x\n", server=down)
    assert login.exit_code == Exit.NETWORK


def test_an_expired_or_revoked_token_is_exit_3(gpulab: Gpulab, alice: User) -> None:
    assert gpulab("ls", user=alice).exit_code == 0
    ApiToken.objects.filter(user=alice).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    got = gpulab("ls", user=alice)
    assert got.exit_code == Exit.AUTH
    assert "Invalid, expired or revoked token" in got.stderr


def test_rate_limited_beyond_a_short_wait_is_exit_1(
    gpulab: Gpulab, alice: User, settings: Any
) -> None:
    settings.GPULAB_API_RATE_LIMIT = 1
    settings.GPULAB_API_RATE_WINDOW = 3600  # the next request in an hour
    assert gpulab("queue", user=alice).exit_code == 0
    got = gpulab("queue", user=alice)
    assert got.exit_code == Exit.SERVER
    assert "rate limited by" in got.stderr and "retry in 3600 s" in got.stderr


def test_not_the_api_is_said_so(gpulab: Gpulab, alice: User) -> None:
    # the portal's root answers HTML: a --server that points at a page, not the API
    got = gpulab("ls", user=alice, server=gpulab.server + "/accounts/login")
    assert got.exit_code == Exit.SERVER
    assert "without the gpulab API's JSON" in got.stderr


# ------------------------------------------------------------------ submit


def test_submit_maps_each_option_to_the_job(
    gpulab: Gpulab,
    alice: User,
    cluster: list[Node],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    got = gpulab(
        "submit", "--gpus", "1", "--gpu-mem", "12G", "--time", "1h30m",
        "--class", "high", "--share", "--env", "A=1", "--env", "B=x=y",
        "--workload", "resnet", "--", "python", "train.py", "--lr", "0.1",
        user=alice,
    )  # fmt: skip
    assert got.exit_code == 0, got.output
    job = Job.objects.get()
    assert got.stdout == f"Submitted job {job.pk} (pending)\n"
    assert (job.name, job.command, job.workdir) == (
        "train.py",
        "python train.py --lr 0.1",
        str(tmp_path),
    )
    assert (job.gpus, job.gpu_memory_mib, job.time_limit_s) == (1, 12288, 5400)
    assert (job.priority_class, job.shareable, job.workload) == ("high", True, "resnet")
    assert job.env == {"A": "1", "B": "x=y"}
    assert job.owner == alice


def test_submit_without_dashes_keeps_the_commands_options(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab(
        "submit", "-q", "--name", "sweep", "--workdir", "/data/x", "sh", "-c",
        "'echo $GPULAB_ARRAY_INDEX'", user=alice,
    )  # fmt: skip
    assert got.exit_code == 0, got.output
    job = Job.objects.get()
    assert got.stdout == f"{job.pk}\n"
    assert (job.name, job.workdir) == ("sweep", "/data/x")
    assert job.command == "sh -c 'echo $GPULAB_ARRAY_INDEX'"


def test_the_servers_refusal_names_the_options(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab(
        "submit", "--gpus", "99", "--class", "urgent", "--after", "999999",
        "--", "python", "train.py", user=alice,
    )  # fmt: skip
    assert got.exit_code == Exit.USAGE
    lines = got.stderr.splitlines()
    assert lines[0] == "gpulab: the server refused the request:"
    assert any(line.startswith("  --gpus: ") and "6 GPU(s)" in line for line in lines)
    assert any(line.startswith("  --class: Unknown class 'urgent'") for line in lines)
    assert any(line.startswith("  --after: No such job") for line in lines)
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time", "4x"], "Invalid value for '--time': '4x': Write a duration"),
        (["--gpu-mem", "lots"], "Invalid value for '--gpu-mem': 'lots': Write an"),
        (["--gpus", "two"], "Invalid value for '--gpus'"),
        (["--env", "NOVALUE"], "Invalid value for '--env': 'NOVALUE': write NAME="),
    ],
)
def test_bad_options_are_usage_errors_before_any_request(
    gpulab: Gpulab, args: list[str], message: str
) -> None:
    # no user, no server: nothing is sent
    got = gpulab("submit", *args, "--", "true", server=None)
    assert got.exit_code == Exit.USAGE
    assert message in got.stderr
    assert "Usage: gpulab submit" in got.stderr


def test_submit_needs_a_command(gpulab: Gpulab) -> None:
    got = gpulab("submit", "--gpus", "1", server=None)
    assert got.exit_code == Exit.USAGE
    assert "Missing argument 'COMMAND...'" in got.stderr


def test_a_body_over_the_limit_is_a_usage_error(
    gpulab: Gpulab, alice: User, cluster: list[Node], settings: Any
) -> None:
    settings.GPULAB_API_MAX_BODY_BYTES = 2048
    got = gpulab("submit", "--", "x" * 4000, user=alice)
    assert got.exit_code == Exit.USAGE
    assert "the limit is 2048 bytes" in got.stderr
    assert not Job.objects.exists()


def test_an_array_and_a_dependency_on_it(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    got = gpulab("submit", "--array", "0-4%2", "-q", "--", "train", user=alice)
    assert got.exit_code == 0, got.output
    array = JobArray.objects.get()
    assert got.stdout == f"a{array.pk}\n"
    assert (array.size, array.max_running, array.spec) == (5, 2, "0-4%2")
    tasks = list(array.tasks.order_by("array_index"))
    assert [t.array_index for t in tasks] == [0, 1, 2, 3, 4]
    after = gpulab(
        "submit", "--after", f"afterok:a{array.pk}", "--", "evaluate", user=alice
    )
    assert after.exit_code == 0, after.output
    final = Job.objects.get(array__isnull=True)
    assert sorted(
        JobDependency.objects.filter(job=final).values_list("depends_on_id", "kind")
    ) == [(t.pk, "afterok") for t in tasks]
    shown = gpulab("show", f"a{array.pk}", user=alice)
    assert shown.exit_code == 0, shown.output
    assert "Tasks:   5 [0-4%2], at most 2 at once" in shown.stdout
    assert "States:  5 pending" in shown.stdout
    listed = gpulab("ls", "--array", f"a{array.pk}", "--json", user=alice)
    assert [j["array_index"] for j in json.loads(listed.stdout)] == [0, 1, 2, 3, 4]
    plain = gpulab("submit", "--array", "0-2", "--", "x", user=alice)
    assert plain.stdout.startswith(f"Submitted array a{array.pk + 1}: 3 tasks (jobs")
    bad = gpulab("submit", "--array", "9-1", "--", "x", user=alice)
    assert bad.exit_code == Exit.USAGE
    assert "  --array: '9-1': the range ends before it starts." in bad.stderr


# ------------------------------------------------------------------ ls, queue


def test_ls_is_mine_and_queue_is_everyones(
    gpulab: Gpulab,
    alice: User,
    charlie: User,
    admin_user: User,
    cluster: list[Node],
) -> None:
    mine = JobFactory(owner=admin_user, name="admins", queue_order=2)
    theirs = JobFactory(owner=charlie, name="charlies", queue_order=1)
    running = JobFactory(owner=alice, name="alices")
    start_job(running, cluster[1])
    ended = JobFactory(owner=admin_user, status=Job.Status.COMPLETED)
    ls = gpulab("ls", user=admin_user)  # staff: still only their own
    assert ls.exit_code == 0, ls.output
    header, *rows = ls.stdout.splitlines()
    assert header.split() == [
        "JOBID", "ARRAY", "NAME", "USER", "STATE", "CLASS", "GPUS", "TIME",
        "LIMIT", "NODES(REASON)",
    ]  # fmt: skip
    assert [r.split()[0] for r in rows] == [str(mine.pk)]
    every = gpulab("ls", "-a", "--json", user=admin_user)
    assert [j["id"] for j in json.loads(every.stdout)] == [mine.pk, ended.pk]
    failed = gpulab("ls", "--state", "completed", "--json", user=admin_user)
    assert [j["id"] for j in json.loads(failed.stdout)] == [ended.pk]
    # the API takes the schema's exact names; the CLI takes what people type
    typed = gpulab("ls", "--state", " Completed , ", "--json", user=admin_user)
    assert [j["id"] for j in json.loads(typed.stdout)] == [ended.pk]
    queue = gpulab("queue", user=alice)
    assert queue.exit_code == 0, queue.output
    rows = queue.stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [
        str(running.pk),
        str(theirs.pk),
        str(mine.pk),
    ]
    assert rows[0].split()[4] == "starting" and rows[0].endswith("node-b")
    assert rows[1].split()[3] == "charlie"
    as_json = json.loads(gpulab("queue", "--json", user=alice).stdout)
    assert [j["id"] for j in as_json] == [running.pk, theirs.pk, mine.pk]
    bad = gpulab("ls", "--state", "sleeping", user=alice)
    assert bad.exit_code == Exit.USAGE
    assert "Unknown state 'sleeping'" in bad.stderr


def test_queue_follows_the_apis_pages_to_the_end(
    gpulab: Gpulab, alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue API answers a page at a time (GPULAB_API_MAX_PAGE); `gpulab
    queue` asks for the next page until one comes back short, so the whole queue
    is shown in order (pages of 2 here: 2, 2, 1)."""
    waiting = [JobFactory(owner=alice, queue_order=i) for i in range(5)]
    monkeypatch.setattr("portal.cli.jobs.QUEUE_PAGE", 2)
    shown = gpulab("queue", "--json", user=alice)
    assert shown.exit_code == 0, shown.output
    assert [j["id"] for j in json.loads(shown.stdout)] == [j.pk for j in waiting]


def test_ls_follows_the_job_lists_pages_by_cursor(
    gpulab: Gpulab, alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpulab ls` asks each page from the last id of the one before (the API's
    ``before``: a deep page costs what a first one does): the newest ``-n``
    jobs, shown oldest first (pages of 2 here)."""
    jobs = [JobFactory(owner=alice).pk for _ in range(5)]
    monkeypatch.setattr("portal.cli.jobs.JOBS_PAGE", 2)
    for n, want in ((4, jobs[1:]), (100, jobs)):
        shown = gpulab("ls", "-a", "-n", str(n), "--json", user=alice)
        assert shown.exit_code == 0, shown.output
        assert [j["id"] for j in json.loads(shown.stdout)] == want


# ------------------------------------------------------------------ show, cancel


def test_show_a_job_and_what_is_not_yours(
    gpulab: Gpulab, alice: User, charlie: User, cluster: list[Node]
) -> None:
    first = JobFactory(owner=alice, status=Job.Status.COMPLETED)
    job = services.submit_job(
        alice,
        services.JobRequest(
            name="eval",
            command="python eval.py",
            workdir="/tmp/w",
            env={"SEED": "3"},
            after=f"afterok:{first.pk}",
        ),
    )
    got = gpulab("show", str(job.pk), "--events", user=alice)
    assert got.exit_code == 0, got.output
    fields = dict(
        line.split(":", 1) for line in got.stdout.split("\n\n")[0].splitlines()
    )
    assert fields["Job"].strip() == f"{job.pk}  eval"
    assert fields["Owner"].strip() == "alice (group vision)"
    assert fields["State"].strip().startswith("pending")
    assert fields["After"].strip() == f"afterok:{first.pk} (completed)"
    assert fields["Command"].strip() == "python eval.py"
    assert fields["Env"].strip() == "SEED=3"
    assert "submitted by alice" in got.stdout.split("\n\n")[1]
    as_json = json.loads(gpulab("show", str(job.pk), "--json", user=alice).stdout)
    assert (as_json["id"], as_json["dependencies"][0]["job"]) == (job.pk, first.pk)
    hidden = gpulab("show", str(job.pk), user=charlie)
    assert hidden.exit_code == Exit.NOT_FOUND
    assert f"No job {job.pk} visible to you." in hidden.stderr
    bad = gpulab("show", "job12", user=alice)
    assert bad.exit_code == Exit.USAGE
    assert "'job12' is not a job id" in bad.stderr


def test_cancel_jobs_and_an_array_each_reported(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    waiting = JobFactory(owner=alice)
    running = JobFactory(owner=alice)
    start_job(running, cluster[0])
    done = JobFactory(owner=alice, status=Job.Status.COMPLETED)
    array = services.submit_array(
        alice, services.JobRequest(name="s", command="x", workdir="/tmp/w"), "0-2"
    )
    got = gpulab(
        "cancel", str(waiting.pk), str(done.pk), f"a{array.pk}", str(running.pk),
        "999999", user=alice,
    )  # fmt: skip
    # the first failure (the ended job: 409) gives the exit code
    assert got.exit_code == Exit.SERVER
    tasks = sorted(array.tasks.values_list("pk", flat=True))
    assert got.stdout.splitlines() == [
        f"Job {waiting.pk}: cancelled",
        f"Array a{array.pk}: cancelled 3 task(s) ({', '.join(map(str, tasks))})",
        f"Job {running.pk}: stopping (starting)",
    ]
    assert f"gpulab: {done.pk}: Job #{done.pk} has already ended" in got.stderr
    assert "gpulab: 999999: No job 999999 visible to you." in got.stderr
    assert set(Job.objects.filter(pk__in=tasks).values_list("status", flat=True)) == {
        "cancelled"
    }
    running.refresh_from_db()
    assert running.cancel_requested_at is not None
    assert gpulab("cancel", "nope", user=alice).exit_code == Exit.USAGE
    waiting.refresh_from_db()
    assert waiting.status == "cancelled"


# ------------------------------------------------------------------ logs


@pytest.fixture
def ran(alice: User, cluster: list[Node]) -> Attempt:
    """A job of alice's that started an hour ago and wrote three lines, still
    running."""
    job = services.submit_job(
        alice, services.JobRequest(name="t", command="x", workdir="/tmp/w")
    )
    run_one_pass()
    attempt = Attempt.objects.get(job=job)
    services.mark_started(attempt.node_id, started_data(attempt, time.time() - 3600))
    for offset, text in ((0, "épo"), (4, "ch 1\nepoch 2\n"), (17, "epoch 3\n")):
        JobLogChunk.objects.create(
            attempt=attempt, node_id=attempt.node_id, offset=offset, data=text
        )
    return attempt


def test_logs_print_the_output_and_its_tail(
    gpulab: Gpulab, alice: User, ran: Attempt
) -> None:
    got = gpulab("logs", str(ran.job_id), user=alice)
    assert (got.exit_code, got.stdout) == (0, "époch 1\nepoch 2\nepoch 3\n")
    tail = gpulab("logs", str(ran.job_id), "--tail", "2", user=alice)
    assert tail.stdout == "epoch 2\nepoch 3\n"


def test_logs_follow_an_ended_job_to_its_end(
    gpulab: Gpulab, alice: User, ran: Attempt
) -> None:
    services.finish_attempt(ran.node_id, exited_data(ran, 0))
    got = gpulab("logs", "-f", str(ran.job_id), user=alice)
    assert (got.exit_code, got.stdout) == (0, "époch 1\nepoch 2\nepoch 3\n")


def test_logs_page_through_a_long_output(
    gpulab: Gpulab, alice: User, ran: Attempt
) -> None:
    big = "".join(f"line {i:06d}\n" for i in range(30_000))  # 360 kB > one page
    JobLogChunk.objects.create(attempt=ran, node_id=ran.node_id, offset=25, data=big)
    got = gpulab("logs", str(ran.job_id), user=alice)
    assert got.stdout == "époch 1\nepoch 2\nepoch 3\n" + big


def test_logs_of_a_job_that_never_ran(
    gpulab: Gpulab, alice: User, charlie: User
) -> None:
    job = JobFactory(owner=alice)
    got = gpulab("logs", str(job.pk), user=alice)
    assert (got.exit_code, got.stdout) == (0, "")
    assert f"job {job.pk} has not run (pending)" in got.stderr
    assert gpulab("logs", str(job.pk), user=charlie).exit_code == Exit.NOT_FOUND


# ------------------------------------------------------------------ top, usage


def test_top_once_draws_nodes_gpus_and_their_jobs(
    gpulab: Gpulab, alice: User, cluster: list[Node]
) -> None:
    job = JobFactory(owner=alice, name="resnet")
    start_job(job, cluster[1])
    Gpu.objects.filter(node=cluster[1], index=0).update(
        latest={
            "util_gpu": 87,
            "memory_used_mib": 40960,
            "temperature_c": 71,
            "power_w": 312,
        },
        latest_at=timezone.now(),
    )
    got = gpulab("top", "--once", user=alice)
    assert got.exit_code == 0, got.output
    out = got.stdout
    assert "2 nodes, 1/6 GPUs in use, 1 running, 0 pending" in out
    node_b = out[out.index("node-b") :]
    gpu0 = next(line for line in node_b.splitlines() if line.strip().startswith("0"))
    assert "87%" in gpu0 and "40.0G/80.0G" in gpu0
    assert "71C" in gpu0 and "312W" in gpu0
    assert f"alice:{job.pk} resnet" in gpu0
    gpu1 = next(line for line in node_b.splitlines() if line.strip().startswith("1"))
    assert gpu1.rstrip().endswith("idle") and "-" in gpu1  # no sample: not zero


def test_usage_shows_gpu_hours_and_top_jobs(
    gpulab: Gpulab, alice: User, ran: Attempt
) -> None:
    services.finish_attempt(ran.node_id, exited_data(ran, 0))
    got = gpulab("usage", user=alice)
    assert got.exit_code == 0, got.output
    assert got.stdout.startswith("Usage of user alice, ")
    assert "No quota applies." in got.stdout
    assert "  GPU-hours:  1.00\n" in got.stdout
    assert got.stdout.splitlines()[-1].split() == [str(ran.job_id), "t", "1.00"]
    data = json.loads(gpulab("usage", "--json", user=alice).stdout)
    assert data["top_jobs"][0]["job"] == ran.job_id
    bad = gpulab("usage", "--group", "vision", user=alice)
    assert bad.exit_code == Exit.SERVER
    assert "not allowed" in bad.stderr
    wrong = gpulab("usage", "--from", "2026-02-30", user=alice)
    assert wrong.exit_code == Exit.USAGE


# ------------------------------------------------------------------ help


def test_every_command_has_help_and_there_is_a_version(gpulab: Gpulab) -> None:
    from click.testing import CliRunner

    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    assert top.exit_code == 0 and "Exit codes:" in top.output
    for name in cli.commands:  # type: ignore[attr-defined]
        got = runner.invoke(cli, [name, "--help"])
        assert got.exit_code == 0, (name, got.output)
        assert got.output.startswith(f"Usage: cli {name}")
    version = runner.invoke(cli, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("gpulab, version ")


def test_the_console_script_is_installed() -> None:
    """``pip install`` puts ``gpulab`` beside the interpreter (pyproject's
    ``[project.scripts]``); the e2e tests run it as users do."""
    script = Path(sys.executable).parent / "gpulab"
    done = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.split()[:2]) == (0, ["gpulab,", "version"])


# ------------------------------------------------------------------ top, live


def _until(fd: int, seen: bytearray, pattern: bytes, times: int = 1) -> None:
    """Read the terminal's output until ``pattern`` has appeared ``times`` times
    (each frame is drawn on the screen: an event the program announces)."""
    import select

    deadline = time.monotonic() + 60
    while seen.count(pattern) < times:
        left = deadline - time.monotonic()
        assert left > 0, f"{pattern!r} not seen {times}x: {bytes(seen)[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            seen += os.read(fd, 65536)


def _terminal_window() -> None:
    import fcntl
    import signal
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("key", "code"), [(b"q", 0), (b"\x03", 130)])
def test_top_runs_live_in_a_terminal_until_q_or_ctrl_c(
    gpulab: Gpulab, alice: User, cluster: list[Node], key: bytes, code: int
) -> None:
    import pty

    master, slave = pty.openpty()
    env = {
        **os.environ,
        "GPULAB_SERVER": gpulab.server,
        "GPULAB_TOKEN": gpulab.token_of(alice),
        "TERM": "xterm",
        "COLUMNS": "140",
        "LINES": "40",
    }
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "gpulab"), "top", "--interval", "0.5"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        # a session of its own whose controlling terminal is the pty, as in a
        # terminal window: ^C there is SIGINT (with its default action, as a
        # terminal window gives it, even if this run of the suite ignores it)
        start_new_session=True,
        preexec_fn=_terminal_window,
    )
    os.close(slave)
    try:
        seen = bytearray()
        _until(master, seen, b"node-b")
        _until(master, seen, b"gpulab top", times=2)  # it redraws
        os.write(master, key)
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
