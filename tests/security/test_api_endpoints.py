"""Every API endpoint (``/api/v1/``), table-driven over its URL conf: each route
and each HTTP method it accepts has a row here (a new route or method without one
fails), and each row says, for every persona, the status and the error body's
``error`` code, and for a call that changes something what the object is
afterwards (unchanged for every persona refused).

Personas: no token; a bad, a revoked and an expired token; alice (the owner);
bob (her group, a plain member); dora (leads her group: sees its jobs read only);
charlie (another group); root (staff, no console permission); sam (staff with
the one console permission the row names: ``cancel_any_job``, ``hold_job``,
``requeue_job``, ``drain_node``). A job or array one may not see is a 404 with
the same answer as one that does not exist. Also: methods a route does not accept
(405, nothing changes), the session's CSRF check on every POST.

Each row builds its world once and asks as each persona in turn, each inside a
savepoint rolled back afterwards, so every persona starts from the same state.
The web views' table is test_web_views.py (the Tokens pages are web views)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from django.contrib.auth.models import Permission
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from portal.api import tokens
from portal.api.models import ApiToken
from scheduler import services
from scheduler.models import Attempt, Job, JobArray, Node
from tests.conftest import _user, make_node
from tests.factories import start_job, started_data

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

NO_USER = ("anonymous", "bad_token", "revoked_token", "expired_token")
USERS = {
    "owner": "alice",
    "same_group": "bob",
    "leader": "dora",
    "other_group": "charlie",
    "staff": "root",
    "staff_perm": "sam",
}
PERSONAS = (*NO_USER, *USERS)
SIGNED_IN = tuple(USERS)
# The error code of each refusal (401: which one depends on the persona).
ERRORS = {
    400: "invalid",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "wrong_state",
}
PREFIX = "api/v1/"
SUBMIT = {"name": "api-submitted", "command": "true", "workdir": "/tmp"}
MISSING = 987654321  # no job, array or node has this id


@dataclass
class World:
    """alice's pending job, her running job, her array of two tasks, a node,
    every persona's user and the secret it sends."""

    users: dict[str, User]
    job: Job
    running: Job
    array: JobArray
    node_id: int
    secrets: dict[str, str]


def no_args(w: World) -> list[int]:
    return []


def no_data(w: World) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Case:
    """One route and method and what each persona gets (``expect``: a status).

    ``perm``: the console permission sam (``staff_perm``) holds for this row.
    ``arrange``: run once before the personas ask (after ``perm`` is granted).
    ``state``: what the call may change, read after it; ``before`` what it is
    beforehand (and stays for every persona not in ``changed``).
    ``shows``: on a 2xx, whether the body shows the thing (True exactly for the
    personas in ``shown_to``)."""

    name: str
    method: str
    expect: dict[str, int]
    args: Callable[[World], list[int]] = no_args
    query: str = ""
    data: Callable[[World], dict[str, Any]] = no_data
    perm: str = ""
    arrange: Callable[[World], None] | None = None
    state: Callable[[World], str] | None = None
    before: str = ""
    changed: dict[str, str] = field(default_factory=dict)
    shows: Callable[[World, Any, str], bool] | None = None
    shown_to: tuple[str, ...] = ()
    label: str = ""
    error: str = ""  # a 400's error code when it is not "invalid"

    @property
    def id(self) -> str:
        return f"{self.method} {self.name}{self.query}{self.label}"


# ------------------------------------------------------------------ expectations


def signed_in(status: int, **other: int) -> dict[str, int]:
    """Every persona with a user gets ``status`` (unless named in ``other``);
    no token or a bad one: 401."""
    return {p: 401 for p in NO_USER} | {p: status for p in SIGNED_IN} | other


def public(status: int) -> dict[str, int]:
    """No token needed; a bad token is still refused (DRF authenticates first)."""
    return signed_in(status, anonymous=status)


def reads(ok: int) -> dict[str, int]:
    """Who sees alice's job: she, her group's leader, staff. Her group's other
    members and other groups: 404, as for a job that does not exist."""
    return signed_in(ok, same_group=404, other_group=404)


def verb(**ok: int) -> dict[str, int]:
    """A verb on alice's job or array: those who cannot see it get 404; those who
    see it without the right (the leader, staff without the permission) 403."""
    return reads(403) | ok


def admin_only(ok: int) -> dict[str, int]:
    """Only sam, with the row's permission."""
    return signed_in(403, staff_perm=ok)


# ------------------------------------------------------------------ arguments, state


def job(w: World) -> list[int]:
    return [w.job.pk]


def running(w: World) -> list[int]:
    return [w.running.pk]


def array(w: World) -> list[int]:
    return [w.array.pk]


def node(w: World) -> list[int]:
    return [w.node_id]


def submit(w: World) -> dict[str, Any]:
    return dict(SUBMIT)


def submit_after(w: World) -> dict[str, Any]:
    return {**SUBMIT, "after": f"afterok:{w.job.pk}"}


def submit_array(w: World) -> dict[str, Any]:
    return {**SUBMIT, "name": "api-array", "array": "0-1"}


def job_status(w: World) -> str:
    w.job.refresh_from_db()
    return str(w.job.status)


def running_state(w: World) -> str:
    attempt = Attempt.objects.get(job=w.running, ended_at__isnull=True)
    return f"{Job.objects.get(pk=w.running.pk).status} kill={attempt.kill_reason}"


def array_tasks(w: World) -> str:
    return ",".join(
        w.array.tasks.order_by("array_index").values_list("status", flat=True)
    )


def node_mode(w: World) -> str:
    return Node.objects.get(pk=w.node_id).mode or "takes jobs"


def submitters(w: World) -> str:
    """Who submitted a job named api-submitted (no one, before)."""
    owners = Job.objects.filter(name="api-submitted").values_list(
        "owner__username", flat=True
    )
    return ",".join(sorted(owners)) or "none"


def array_submitters(w: World) -> str:
    owners = JobArray.objects.filter(name="api-array").values_list(
        "owner__username", flat=True
    )
    return ",".join(sorted(owners)) or "none"


def hold_by_owner(w: World) -> None:
    services.hold_job(w.job.pk, by=w.users["owner"])


def hold_by_admin(w: World) -> None:
    services.hold_job(w.job.pk, by=w.users["staff_perm"])


def drain(w: World) -> None:
    services.set_node_mode(w.node_id, "drain", by=None)


def lists_alices_job(w: World, body: Any, username: str) -> bool:
    return w.job.pk in [j["id"] for j in body["results"]]


def queue_lists_alices_job(w: World, body: Any, username: str) -> bool:
    return w.job.pk in [j["id"] for j in body]


def nodes_list_the_running_job(w: World, body: Any, username: str) -> bool:
    rows = body if isinstance(body, list) else [body]
    ids = [j["id"] for n in rows for g in n["gpus"] for j in g["jobs"]]
    return w.running.pk in ids


def is_me(w: World, body: Any, username: str) -> bool:
    return bool(body["username"] == username)


def fresh_device_budget(w: World) -> None:
    """The test client's address may ask for device codes again (earlier tests
    of the run spent its budget)."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        client.delete(f"{settings.REDIS_PREFIX}:api:rate:device-code:127.0.0.1")
    finally:
        client.close()


def everyone_made() -> dict[str, str]:
    """What a submit leaves for each persona with a user: their own job."""
    return dict(USERS)


HELD = str(Job.Status.HELD)
PENDING = str(Job.Status.PENDING)
CANCELLED = str(Job.Status.CANCELLED)
RUNNING = f"{Job.Status.RUNNING} kill="

CASES = [
    # ---------------------------------------------------------------- jobs
    Case(
        "api-jobs",
        "GET",
        signed_in(200),
        shows=lists_alices_job,
        shown_to=("owner", "leader", "staff", "staff_perm"),
    ),
    # a filter never widens what one sees
    Case(
        "api-jobs",
        "GET",
        signed_in(200),
        query="?owner=alice",
        shows=lists_alices_job,
        shown_to=("owner", "leader", "staff", "staff_perm"),
    ),
    Case(
        "api-jobs",
        "POST",
        signed_in(201),
        data=submit,
        state=submitters,
        before="none",
        changed=everyone_made(),
    ),
    # Running after alice's job needs seeing it: the others get the answer of a
    # job that does not exist (test_a_hidden_object_answers_as_a_missing_one).
    Case(
        "api-jobs",
        "POST",
        signed_in(201, same_group=400, other_group=400),
        data=submit_after,
        state=submitters,
        before="none",
        changed={
            p: u for p, u in USERS.items() if p not in ("same_group", "other_group")
        },
        label=" after alice's job",
    ),
    Case("api-job", "GET", reads(200), args=job),
    Case(
        "api-job-cancel",
        "POST",
        verb(owner=200, staff_perm=200),
        args=job,
        perm="cancel_any_job",
        state=job_status,
        before=PENDING,
        changed={"owner": CANCELLED, "staff_perm": CANCELLED},
    ),
    Case(
        "api-job-hold",
        "POST",
        verb(owner=200, staff_perm=200),
        args=job,
        perm="hold_job",
        state=job_status,
        before=PENDING,
        changed={"owner": HELD, "staff_perm": HELD},
    ),
    Case(
        "api-job-release",
        "POST",
        verb(owner=200, staff_perm=200),
        args=job,
        perm="hold_job",
        arrange=hold_by_owner,
        state=job_status,
        before=HELD,
        changed={"owner": PENDING, "staff_perm": PENDING},
        label=" (alice's hold)",
    ),
    # An admin's hold: only an admin releases it, not even the owner.
    Case(
        "api-job-release",
        "POST",
        verb(staff_perm=200),
        args=job,
        perm="hold_job",
        arrange=hold_by_admin,
        state=job_status,
        before=HELD,
        changed={"staff_perm": PENDING},
        label=" (an admin's hold)",
    ),
    # Only an admin with requeue_job requeues, not even the owner.
    Case(
        "api-job-requeue",
        "POST",
        verb(staff_perm=200),
        args=running,
        perm="requeue_job",
        state=running_state,
        before=RUNNING,
        changed={"staff_perm": RUNNING + "requeued"},
    ),
    Case("api-job-logs", "GET", reads(200), args=running),
    Case("api-job-events", "GET", reads(200), args=job),
    # ---------------------------------------------------------------- arrays
    Case(
        "api-arrays",
        "POST",
        signed_in(201),
        data=submit_array,
        state=array_submitters,
        before="none",
        changed=everyone_made(),
    ),
    Case("api-array", "GET", reads(200), args=array),
    Case(
        "api-array-cancel",
        "POST",
        verb(owner=200, staff_perm=200),
        args=array,
        perm="cancel_any_job",
        state=array_tasks,
        before="pending,pending",
        changed={"owner": "cancelled,cancelled", "staff_perm": "cancelled,cancelled"},
    ),
    # ---------------------------------------------------------------- nodes
    # Every signed-in user sees every node and the jobs on it (number, name,
    # owner), as the cluster page and Slurm's squeue show them.
    Case(
        "api-nodes",
        "GET",
        signed_in(200),
        shows=nodes_list_the_running_job,
        shown_to=SIGNED_IN,
    ),
    Case(
        "api-node",
        "GET",
        signed_in(200),
        args=node,
        shows=nodes_list_the_running_job,
        shown_to=SIGNED_IN,
    ),
    Case(
        "api-node-drain",
        "POST",
        admin_only(200),
        args=node,
        perm="drain_node",
        state=node_mode,
        before="takes jobs",
        changed={"staff_perm": "draining"},
    ),
    Case(
        "api-node-maintenance",
        "POST",
        admin_only(200),
        args=node,
        perm="drain_node",
        state=node_mode,
        before="takes jobs",
        changed={"staff_perm": "maintenance"},
    ),
    Case(
        "api-node-resume",
        "POST",
        admin_only(200),
        args=node,
        perm="drain_node",
        arrange=drain,
        state=node_mode,
        before="draining",
        changed={"staff_perm": "takes jobs"},
    ),
    # ---------------------------------------------------------------- queue, usage, me
    Case(
        "api-queue",
        "GET",
        signed_in(200),
        shows=queue_lists_alices_job,
        shown_to=SIGNED_IN,
    ),
    Case("api-usage", "GET", signed_in(200)),
    # A group's usage: its leaders and staff.
    Case(
        "api-usage",
        "GET",
        signed_in(403, leader=200, staff=200, staff_perm=200),
        query="?group=vision",
    ),
    Case(
        "api-usage",
        "GET",
        signed_in(403, staff=200, staff_perm=200),
        query="?group=nlp",
    ),
    # A group that does not exist: the same 403 (which groups exist is not told).
    Case("api-usage", "GET", signed_in(403), query="?group=nosuch"),
    Case("api-me", "GET", signed_in(200), shows=is_me, shown_to=SIGNED_IN),
    # ---------------------------------------------------------------- gpulab login
    # No token needed (the CLI has none yet); a bad one is still refused.
    Case(
        "api-device-code",
        "POST",
        public(200),
        data=lambda w: {"client_name": "laptop"},
        arrange=fresh_device_budget,
    ),
    # An unknown device code: RFC 6749's invalid_grant, for anyone.
    Case(
        "api-device-token",
        "POST",
        public(400),
        data=lambda w: {"device_code": "never-issued"},
        error="invalid_grant",
    ),
    # ---------------------------------------------------------------- schema, docs
    # What exists, never whose data: public.
    Case("api-schema", "GET", public(200)),
    Case("api-docs", "GET", public(200)),
]

# Routes any caller may use, without a token: the schema, gpulab login's.
PUBLIC_CALLS = ("api-schema", "api-device-code", "api-device-token")

# Every GET row is asked with HEAD too (GET without the body: the same status).
# OPTIONS (DRF's metadata: the view's name and parsers, never an object's) needs
# a user like any call, on every route.
CASES += [
    Case(
        name,
        "OPTIONS",
        public(200) if name in PUBLIC_CALLS else signed_in(200),
        args=args,
    )
    for name, args in {c.name: c.args for c in CASES}.items()
    if name != "api-docs"  # a page: GET and HEAD only
]


# ------------------------------------------------------------------ the URL conf


def routes() -> dict[str, set[str]]:
    """Every named route of the API and the methods its view accepts."""
    (api,) = [e for e in get_resolver().url_patterns if str(e.pattern) == PREFIX]
    assert isinstance(api, URLResolver)
    out = {}
    for entry in api.url_patterns:
        assert isinstance(entry, URLPattern), f"{entry}: an include nobody tests here"
        assert entry.name, f"{entry.pattern} has no name: give it one and a case"
        cls = entry.callback.cls  # type: ignore[attr-defined]
        names = entry.callback.initkwargs.get(  # type: ignore[attr-defined]
            "http_method_names", cls.http_method_names
        )
        methods = {m.upper() for m in names if hasattr(cls, m)}
        if "GET" in methods:
            methods.add("HEAD")  # Django's View answers HEAD with its GET
        out[entry.name] = methods
    return out


def test_every_route_and_method_of_the_api_has_a_case() -> None:
    table = {(c.name, c.method) for c in CASES}
    table |= {(c.name, "HEAD") for c in CASES if c.method == "GET"}
    conf = {(name, m) for name, methods in routes().items() for m in methods}
    assert conf - table == set(), "routes or methods without a case"
    assert table - conf == set(), "cases of routes or methods that do not exist"


# ------------------------------------------------------------------ the world


def alice_request(name: str) -> services.JobRequest:
    return services.JobRequest(name=name, command="true", workdir="/tmp")


@pytest.fixture
def world(
    alice: User, bob: User, charlie: User, admin_user: User, leader: User
) -> World:
    sam = _user("sam", None, staff=True)
    users = {
        "owner": alice,
        "same_group": bob,
        "leader": leader,
        "other_group": charlie,
        "staff": admin_user,
        "staff_perm": sam,
    }
    node_row, _ = make_node("api-node", 2)
    pending = services.submit_job(alice, alice_request("alice-job"))
    on_node = services.submit_job(alice, alice_request("alice-running"))
    attempt = start_job(on_node, node_row)
    services.mark_started(node_row.pk, started_data(attempt))
    tasks = services.submit_array(
        alice,
        alice_request("alice-array"),
        "0-1",
    )
    secrets = {p: tokens.create_token(u, "tests", None)[1] for p, u in users.items()}
    secrets["bad_token"] = ApiToken.new_secret()  # well formed, never issued
    revoked, secrets["revoked_token"] = tokens.create_token(alice, "old", None)
    assert tokens.revoke_token(alice, revoked.pk)
    expired, secrets["expired_token"] = tokens.create_token(alice, "expired", 1)
    ApiToken.objects.filter(pk=expired.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    return World(users, pending, on_node, tasks, node_row.pk, secrets)


def grant(user: User, codename: str) -> None:
    user.user_permissions.add(Permission.objects.get(codename=codename))


def prepare(w: World, case: Case) -> None:
    """sam gets the row's permission, then the row's arrangement."""
    if case.perm:
        grant(w.users["staff_perm"], case.perm)
    if case.arrange is not None:
        case.arrange(w)


def ask(client: Client, case: Case, w: World, persona: str) -> Any:
    url = reverse(case.name, args=case.args(w)) + case.query
    secret = w.secrets.get(persona)
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    body = json.dumps(case.data(w)) if case.method == "POST" else ""
    return client.generic(
        case.method, url, body, content_type="application/json", headers=headers
    )


def error_body(response: Any) -> Any:
    """The error body: JSON, or YAML from the schema's own renderer."""
    if response["Content-Type"].startswith("application/vnd.oai.openapi"):
        return yaml.safe_load(response.content)
    return response.json()


def problems(case: Case, w: World, persona: str, response: Any) -> list[str]:
    """What the response and the state afterwards got wrong for ``persona``."""
    wrong = []
    status = response.status_code
    want = case.expect[persona]
    if status != want:
        wrong.append(f"status {status}, expected {want}: {response.content[:300]!r}")
    # HEAD has no body; the docs page is HTML, its refusals too ("401 Unauthorized")
    has_body = case.method != "HEAD" and case.name != "api-docs"
    if status >= 400 and has_body:
        got = error_body(response)
        code = (
            (case.error if status == 400 and case.error else None)
            or ERRORS.get(status)
            or (
                "not_authenticated"
                if persona == "anonymous"
                else "authentication_failed"
            )
        )
        if set(got) != {"error", "detail", "fields"} or got["error"] != code:
            wrong.append(f"error body {got}, expected error {code!r}")
        if b"alice-" in response.content:
            wrong.append(f"a refusal shows alice's things: {got}")
    if case.shows is not None and 200 <= status < 300:
        username = USERS.get(persona, "")
        shown = case.shows(w, response.json(), username)
        if shown != (persona in case.shown_to):
            wrong.append(f"shows the thing: {shown}")
    if case.state is not None:
        after = case.state(w)
        expected = case.changed.get(persona, case.before)
        if after != expected:
            wrong.append(f"state afterwards {after!r}, expected {expected!r}")
    return wrong


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_persona_gets_what_it_may(world: World, case: Case) -> None:
    assert set(case.expect) == set(PERSONAS), "a row names every persona"
    prepare(world, case)
    if case.state is not None:
        assert case.state(world) == case.before
    client = Client()
    wrong = []
    head = replace(case, method="HEAD", shows=None, shown_to=())
    asked = [case, head] if case.method == "GET" else [case]
    for persona in PERSONAS:
        for row in asked:
            with transaction.atomic():
                response = ask(client, row, world, persona)
                wrong += [
                    f"{persona} {row.method}: {p}"
                    for p in problems(row, world, persona, response)
                ]
                transaction.set_rollback(True)
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ no existence leak

# Every route that names one of alice's jobs or arrays, for those who may not see
# it: the answer (status, error, detail) is the one for an id nobody has.
HIDDEN = [c for c in CASES if c.args in (job, running, array) and c.method == "POST"]
HIDDEN += [c for c in CASES if c.args in (job, running, array) and c.method == "GET"]


def missing(w: World) -> list[int]:
    return [MISSING]


@pytest.mark.parametrize("case", HIDDEN, ids=lambda c: c.id)
def test_a_hidden_object_answers_as_a_missing_one(world: World, case: Case) -> None:
    prepare(world, case)
    real = str(case.args(world)[0])
    client = Client()
    for persona in ("same_group", "other_group"):
        got = ask(client, case, world, persona)
        none = ask(client, replace(case, args=missing), world, persona)
        assert got.status_code == none.status_code == 404, persona
        assert json.loads(none.content.decode().replace(str(MISSING), real)) == (
            got.json()
        ), persona
        # the detail names the id, so the comparison above is of like with like
        assert got.json()["detail"].count(real) == 1


def test_running_after_a_hidden_job_answers_as_after_a_missing_one(
    world: World,
) -> None:
    client = Client()
    real = str(world.job.pk)
    for persona in ("same_group", "other_group"):
        case = next(c for c in CASES if c.data is submit_after)
        got = ask(client, case, world, persona)
        gone = replace(case, data=lambda w: {**SUBMIT, "after": f"afterok:{MISSING}"})
        none = ask(client, gone, world, persona)
        assert got.status_code == none.status_code == 400, persona
        assert got.json()["fields"] == {
            "after": [f"No such job visible to you: {real}."]
        }
        assert json.loads(none.content.decode().replace(str(MISSING), real)) == (
            got.json()
        )
    assert submitters(world) == "none"


# ------------------------------------------------------------------ other methods

OTHER_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
PUBLIC = ("api-docs", *PUBLIC_CALLS)


def job_rows() -> list[tuple[int, str, str]]:
    return list(Job.objects.order_by("pk").values_list("pk", "status", "name"))


def test_a_method_a_route_does_not_accept_is_405_and_changes_nothing(
    world: World,
) -> None:
    """Every route, every method it does not accept: refused before anything is
    read or written. A user gets 405 (sam with every permission too), no token
    401 (the public schema and docs: 405 for anyone). One world for all routes."""
    for codename in ("cancel_any_job", "hold_job", "requeue_job", "drain_node"):
        grant(world.users["staff_perm"], codename)
    client = Client()
    before = (job_rows(), node_mode(world), ApiToken.objects.count())
    wrong = []
    for name, accepted in sorted(routes().items()):
        url = reverse(name, args=next(c.args for c in CASES if c.name == name)(world))
        refused = sorted(set(OTHER_METHODS) - accepted)
        if not refused:
            wrong.append(f"{name}: accepts every method")
        for method in refused:
            for persona in ("anonymous", "owner", "staff_perm"):
                secret = world.secrets.get(persona)
                headers = {"Authorization": f"Bearer {secret}"} if secret else {}
                got = client.generic(
                    method, url, "{}", "application/json", headers=headers
                )
                want = 401 if persona == "anonymous" and name not in PUBLIC else 405
                code = "not_authenticated" if want == 401 else "method_not_allowed"
                if got.status_code != want:
                    wrong.append(f"{method} {name} {persona}: {got.status_code}")
                elif (
                    name != "api-docs"
                    and method != "HEAD"
                    and error_body(got)["error"] != code
                ):
                    wrong.append(f"{method} {name} {persona}: {got.content!r}")
    assert not wrong, "\n".join(wrong)
    assert (job_rows(), node_mode(world), ApiToken.objects.count()) == before


# ------------------------------------------------------------------ CSRF


POSTS = [c for c in CASES if c.method == "POST"]


def session(w: World) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(w.users["owner"])
    return client


@pytest.mark.parametrize("case", POSTS, ids=lambda c: c.id)
def test_a_session_post_without_the_csrf_token_is_refused(
    world: World, case: Case
) -> None:
    """The browser's session works on the API, but an unsafe method needs the
    CSRF token (DRF's SessionAuthentication): refused, nothing changes, for the
    owner who could otherwise act."""
    prepare(world, case)
    if case.perm:
        grant(world.users["owner"], case.perm)
    client = session(world)
    url = reverse(case.name, args=case.args(world)) + case.query

    got = client.post(url, json.dumps(case.data(world)), "application/json")

    assert got.status_code == 403
    assert got.json()["error"] == "permission_denied"
    assert "CSRF" in got.json()["detail"]
    if case.state is not None:
        assert case.state(world) == case.before


def test_a_session_post_with_the_csrf_token_goes_through(world: World) -> None:
    # The refusals above are CSRF's, not the session refused everywhere.
    client = session(world)
    token = client.get(reverse("portal-jobs")).cookies["csrftoken"].value

    got = client.post(
        reverse("api-job-cancel", args=[world.job.pk]),
        "{}",
        "application/json",
        headers={"X-CSRFToken": token},
    )

    assert got.status_code == 200, got.content
    assert job_status(world) == CANCELLED
