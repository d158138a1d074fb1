"""Every web view, table-driven over the URL conf: who may see or do what (owner,
same group, the group's leader, other group, staff, anonymous; 404 where a job's
existence must not leak), CSRF on every view that accepts POST, and a new view
without a row here fails. The admin console's own pages are tested in
tests/portal/test_admin_console.py (staff only, each action its permission); the
API's endpoints by the same kind of table in test_api_endpoints.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from portal.api.models import ApiToken
from portal.api.tokens import create_token
from scheduler import services
from scheduler.models import Job, Node
from tests.conftest import make_node

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

PERSONAS = ("anonymous", "owner", "same_group", "leader", "other_group", "staff")
FIXTURE = {"owner": "alice", "same_group": "bob", "other_group": "charlie"}
FIXTURE["staff"] = "admin_user"
FIXTURE["leader"] = "leader"  # dora leads alice's group: its jobs, read only
LOGIN = "login"  # expected: a redirect to the login page
ADMIN_LOGIN = "admin-login"  # expected: a redirect to the admin's login page


@dataclass
class World:
    """What a case's URL and checks need: alice's job, a node, alice's API token."""

    alice: User
    job: Job
    node_id: int
    token: ApiToken


@dataclass(frozen=True)
class Case:
    """One URL name and method; what each persona gets (a status, or a redirect to
    a login page); for a POST that changes something (``state`` reads it), what it
    then is for each persona that may act (``changed``), ``before`` for the rest."""

    name: str
    method: str
    expect: dict[str, int | str]
    args: Callable[[World], list[Any]] = lambda w: []
    query: str = ""
    data: dict[str, str] = field(default_factory=dict)
    state: Callable[[World], str] | None = None
    before: str = Job.Status.PENDING
    changed: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.method} {self.name}{self.query}"


def everyone(status: int) -> dict[str, int | str]:
    """Any logged-in persona gets ``status``; anonymous goes to log in."""
    return {p: status for p in PERSONAS} | {"anonymous": LOGIN}


def owner_and_staff(ok: int) -> dict[str, int | str]:
    """The job's owner, her group's leader and staff get ``ok``; the rest 404 (no
    existence leak)."""
    return {
        "anonymous": LOGIN,
        "owner": ok,
        "same_group": 404,
        "leader": ok,
        "other_group": 404,
        "staff": ok,
    }


def job(w: World) -> list[Any]:
    return [w.job.pk]


def node(w: World) -> list[Any]:
    return [w.node_id]


def token(w: World) -> list[Any]:
    return [w.token.pk]


def gpu(w: World) -> list[Any]:
    return [w.node_id, 0]


def node_mode(w: World) -> str:
    n = Node.objects.get(pk=w.node_id)
    return "draining" if n.draining else "takes jobs"


def job_status(w: World) -> str:
    w.job.refresh_from_db()
    return str(w.job.status)


def token_state(w: World) -> str:
    w.token.refresh_from_db()
    return "revoked" if w.token.revoked_at else "active"


CASES = [
    Case("portal-overview", "GET", everyone(200)),
    Case("portal-queue", "GET", everyone(200)),
    Case("portal-nodes", "GET", everyone(200)),
    Case("portal-node", "GET", everyone(200), args=node),
    Case("portal-node-series", "GET", everyone(200), args=node),
    Case("portal-gpu", "GET", everyone(200), args=gpu),
    Case("portal-gpu-series", "GET", everyone(200), args=gpu),
    # Drain / maintenance / resume need drain_node, which no persona here has
    # (staff included, as for the console's node actions): refused, nothing
    # changes. tests/portal/test_dashboard_pages.py drains with the permission.
    Case(
        "portal-node-mode",
        "POST",
        everyone(403),
        args=node,
        data={"mode": "drain"},
        state=node_mode,
        before="takes jobs",
    ),
    Case("portal-jobs", "GET", everyone(200)),
    Case("portal-job-new", "GET", everyone(200)),
    Case("portal-jupyter-new", "GET", everyone(200)),
    Case("portal-terminal-new", "GET", everyone(200)),
    Case("portal-job", "GET", owner_and_staff(200), args=job),
    Case("portal-job-series", "GET", owner_and_staff(200), args=job),
    # Staff see every job, and a leader the group's, but cancelling another's
    # needs cancel_any_job (the console's permission; test_api_endpoints grants
    # it): refused (the page says so), nothing changes.
    Case(
        "portal-job-cancel",
        "POST",
        owner_and_staff(302),
        args=job,
        state=job_status,
        changed={"owner": Job.Status.CANCELLED},
    ),
    # Staff (and the leader) see the job, but holding one needs the hold_job
    # permission (test_admin_console): without it the page says so and nothing
    # changes. Releasing alice's own hold too.
    Case(
        "portal-job-hold",
        "POST",
        owner_and_staff(302),
        args=job,
        state=job_status,
        changed={"owner": Job.Status.HELD},
    ),
    Case(
        "portal-job-release",
        "POST",
        owner_and_staff(302),
        args=job,
        state=job_status,
        before=Job.Status.HELD,
        changed={"owner": Job.Status.PENDING},
    ),
    Case("portal-usage", "GET", everyone(200)),
    # A group's usage: its leaders and staff.
    Case(
        "portal-usage",
        "GET",
        {**everyone(403), "leader": 200, "staff": 200, "anonymous": LOGIN},
        query="?group=vision",
    ),
    # dora leads vision, not nlp
    Case(
        "portal-usage",
        "GET",
        {**everyone(403), "staff": 200, "anonymous": LOGIN},
        query="?group=nlp",
    ),
    Case("portal-usage-csv", "GET", everyone(200)),
    Case(
        "portal-usage-csv",
        "GET",
        {**everyone(403), "leader": 200, "staff": 200, "anonymous": LOGIN},
        query="?group=vision",
    ),
    Case("notifications", "GET", everyone(200)),
    Case("notifications-test", "POST", everyone(302)),
    Case("login", "GET", {p: 200 for p in PERSONAS}),
    Case("logout", "POST", {p: 302 for p in PERSONAS}),
    # Signed in but not staff: forbidden; anonymous: the admin's login.
    Case(
        "admin-overview",
        "GET",
        {**everyone(403), "anonymous": ADMIN_LOGIN, "staff": 200},
    ),
    # API tokens: each user sees and revokes only their own; another's token id
    # gets the same answer as a token that does not exist.
    Case("api-tokens", "GET", everyone(200)),
    Case(
        "api-token-revoke",
        "POST",
        everyone(302),
        args=token,
        state=token_state,
        before="active",
        changed={"owner": "revoked"},
    ),
    # /metrics is for Prometheus, not for sessions: off by default for everyone
    # (tests/portal/test_metrics_export.py tests the token and the networks).
    Case("metrics", "GET", {p: 404 for p in PERSONAS}),
    # gpulab login's approval page: any signed-in user; a POST without a code
    # is refused naming it (tests/api/test_device_login.py has the rest).
    Case("device-login", "GET", everyone(200)),
    Case("device-login", "POST", everyone(400), data={"decision": "approve"}),
]

# Includes tested elsewhere: the admin site's (tests/portal/test_admin_console.py),
# the API's (test_api_endpoints.py, the same table for /api/v1/) and the OpenID
# Connect sign-in's (tests/oidc/: 404 unless configured, open to anonymous by design).
DELEGATED = {"admin/", "api/v1/", "oidc/"}


def url_names() -> set[str]:
    """Every named view of the URL conf outside the delegated includes."""
    names = set()
    for entry in get_resolver().url_patterns:
        if isinstance(entry, URLPattern):
            assert entry.name, f"{entry.pattern} has no name: give it one and a case"
            names.add(entry.name)
        else:
            assert isinstance(entry, URLResolver)
            assert str(entry.pattern) in DELEGATED, (
                f"{entry.pattern} includes views nobody tests here: add cases"
            )
    return names


def test_every_view_of_the_url_conf_has_a_case() -> None:
    assert url_names() == {c.name for c in CASES}


@pytest.fixture
def world(
    alice: User, bob: User, charlie: User, admin_user: User, leader: User
) -> World:
    node, _ = make_node("sec-node", 2)
    api_token, _ = create_token(alice, "laptop", 30)
    request = services.JobRequest(name="alice-job", command="true", workdir="/tmp")
    return World(alice, services.submit_job(alice, request), node.pk, api_token)


def client_as(request: pytest.FixtureRequest, persona: str) -> Client:
    client = Client()
    if persona != "anonymous":
        client.force_login(request.getfixturevalue(FIXTURE[persona]))
    return client


def perform(client: Client, case: Case, w: World) -> Any:
    url = reverse(case.name, args=case.args(w)) + case.query
    if case.method == "GET":
        return client.get(url)
    return client.post(url, case.data)


@pytest.mark.parametrize("persona", PERSONAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_persona_gets_what_it_may(
    request: pytest.FixtureRequest, world: World, case: Case, persona: str
) -> None:
    if case.before == Job.Status.HELD:
        services.hold_job(world.job.pk, by=world.alice)
    client = client_as(request, persona)

    response = perform(client, case, world)

    expected = case.expect[persona]
    if expected in (LOGIN, ADMIN_LOGIN):
        assert response.status_code == 302
        login = reverse("login" if expected == LOGIN else "admin:login")
        assert response.url.startswith(login), response.url
    else:
        assert response.status_code == expected, response.content[:500]
    if case.state is not None:
        assert case.state(world) == case.changed.get(persona, case.before)


@pytest.mark.parametrize("persona", ["same_group", "other_group"])
def test_a_job_is_listed_only_for_its_owner_leader_and_staff(
    request: pytest.FixtureRequest, world: World, persona: str
) -> None:
    for who, sees in (
        (persona, False),
        ("owner", True),
        ("leader", True),
        ("staff", True),
    ):
        page = client_as(request, who).get(reverse("portal-jobs"))
        assert ("alice-job" in page.content.decode()) is sees, who


def test_the_job_page_offers_its_verbs_only_to_whom_may_use_them(
    request: pytest.FixtureRequest, world: World
) -> None:
    # The leader and staff see alice's job, read only: no Hold / Cancel buttons.
    verbs = [
        reverse(v, args=[world.job.pk])
        for v in ("portal-job-hold", "portal-job-cancel")
    ]
    for who, offered in (("owner", True), ("leader", False), ("staff", False)):
        page = client_as(request, who).get(reverse("portal-job", args=[world.job.pk]))
        assert page.status_code == 200
        for url in verbs:
            assert (f'action="{url}"' in page.content.decode()) is offered, (who, url)


@pytest.mark.parametrize("persona", ["same_group", "leader", "staff"])
def test_the_tokens_page_lists_only_ones_own_tokens(
    request: pytest.FixtureRequest, world: World, persona: str
) -> None:
    mine = client_as(request, "owner").get(reverse("api-tokens")).content.decode()
    theirs = client_as(request, persona).get(reverse("api-tokens")).content.decode()
    assert world.token.prefix in mine
    assert world.token.prefix not in theirs


# ------------------------------------------------------------------ CSRF


# Every view, POSTed to without the token: CsrfViewMiddleware refuses it before
# the view runs, whether the view takes POST (forms, verbs) or not.
FORM_DATA = {
    "portal-job-new": {"name": "x", "command": "true", "gpus": "1"},
    "notifications": {"job_failed_email": "on"},
    "login": {"username": "alice", "password": "pw-alice"},
}
FORM_DATA["api-tokens"] = {"name": "x", "days": "1"}
CSRF_CASES = [
    Case(c.name, "POST", {}, args=c.args, query=c.query, data=FORM_DATA.get(c.name, {}))
    for c in {c.name: c for c in CASES}.values()
]


@pytest.mark.parametrize("case", CSRF_CASES, ids=lambda c: c.id)
def test_every_post_is_refused_without_the_csrf_token(world: World, case: Case) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.alice)
    jobs_before = Job.objects.count()

    response = perform(client, case, world)

    assert response.status_code == 403
    assert b"CSRF" in response.content
    world.job.refresh_from_db()
    assert world.job.status == Job.Status.PENDING
    assert Job.objects.count() == jobs_before
    assert token_state(world) == "active"
    assert ApiToken.objects.count() == 1


def test_a_post_with_the_pages_token_goes_through(world: World) -> None:
    # The refusals above are CSRF's, not the views refusing everything.
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.alice)
    page = client.get(reverse("portal-job", args=[world.job.pk]))
    token = page.cookies["csrftoken"].value

    response = client.post(
        reverse("portal-job-cancel", args=[world.job.pk]),
        {"csrfmiddlewaretoken": token},
    )

    assert response.status_code == 302
    world.job.refresh_from_db()
    assert world.job.status == Job.Status.CANCELLED
