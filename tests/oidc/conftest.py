"""A real OpenID Connect provider (``tests/oidc_provider``: django-oidc-provider) in
its own process, on a database of its own on this run's PostgreSQL server, and the
portal's OIDC settings pointing at it.

``provider`` (one per module) migrates the provider's database and serves it with
uvicorn on a free port; ``provider.seed(...)`` makes the client and users (their lab
claims as stored JSON, so a test can send a claim of the wrong type). ``oidc_env``
puts the portal's settings in the environment before the e2e ``stack`` starts its
processes, which read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.e2e.conftest import ROOT, Proc, free_port, stack, stop_all  # noqa: F401

if TYPE_CHECKING:
    from collections.abc import Iterator

CLIENT_ID = "gpulab-portal"
CLIENT_SECRET = "provider-test-client-secret"
SCOPES = "openid email profile lab"


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@dataclass
class Provider:
    """The running provider: its issuer URL and database, and a seeding helper."""

    base_url: str
    database_url: str
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    @property
    def issuer(self) -> str:
        return f"{self.base_url}/openid"

    def manage(self, *args: str, stdin: str = "") -> str:
        done = subprocess.run(
            [sys.executable, "-m", "django", *args],
            cwd=ROOT,
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def seed(
        self,
        users: list[dict[str, Any]] | None = None,
        redirect_base: str | None = None,
        *,
        consent: bool = True,
    ) -> None:
        spec: dict[str, Any] = {"users": users or []}
        if redirect_base is not None:
            spec["client"] = {
                "id": CLIENT_ID,
                "secret": CLIENT_SECRET,
                "redirect_uris": [f"{redirect_base}/oidc/callback/"],
                "post_logout_redirect_uris": [f"{redirect_base}/accounts/login/"],
                "consent": consent,
            }
        assert "seeded" in self.manage("seed_lab", stdin=json.dumps(spec))

    def serve(self, port: int) -> Proc:
        """One more server process of this provider on ``port``, listening."""
        popen = subprocess.Popen(
            [
                sys.executable, "-m", "uvicorn", "tests.oidc_provider.asgi:application",
                "--host", "127.0.0.1", "--port", str(port),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )  # fmt: skip
        proc = Proc(f"provider:{port}", popen)
        proc.start_reader()
        self.procs.append(proc)
        proc.wait_for(r"Uvicorn running on")
        return proc


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    server_url = os.environ["DATABASE_URL"]
    name = f"gpulab_oidcp_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(
        _with_database(server_url, "postgres"), autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.oidc_provider.settings",
        "OIDC_PROVIDER_DATABASE_URL": _with_database(server_url, name),
        "PYTHONUNBUFFERED": "1",
    }
    p = Provider(f"http://127.0.0.1:{port}", env["OIDC_PROVIDER_DATABASE_URL"], env)
    try:
        p.manage("migrate", "-v0")
        p.serve(port)
        yield p
    finally:
        stop_all(p.procs)
        with psycopg.connect(
            _with_database(server_url, "postgres"), autocommit=True
        ) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def portal_env(issuer: str) -> dict[str, str]:
    """The portal's settings for the test provider: claims of the lab scope, the
    directory mapping vision-lab -> vision (leaders: vision-pis), staff: lab-admins."""
    return {
        "GPULAB_OIDC_DISCOVERY_URL": issuer,
        "GPULAB_OIDC_CLIENT_ID": CLIENT_ID,
        "GPULAB_OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "GPULAB_OIDC_SCOPES": SCOPES,
        "GPULAB_OIDC_BUTTON_LABEL": "Sign in with Lab SSO",
        "GPULAB_OIDC_UNIX_NAME_CLAIM": "unix_name",
        "GPULAB_OIDC_UID_CLAIM": "uid",
        "GPULAB_OIDC_GID_CLAIM": "gid",
        "GPULAB_OIDC_GIDS_CLAIM": "gids",
        "GPULAB_OIDC_ACTIVE_CLAIM": "active",
        "GPULAB_DIRECTORY_GROUP_MAP": "vision-lab=vision,nlp-lab=nlp",
        "GPULAB_DIRECTORY_LEADER_GROUPS": "vision-pis=vision",
        "GPULAB_DIRECTORY_STAFF_GROUPS": "lab-admins",
    }


@pytest.fixture
def oidc_env(provider: Provider, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The portal's OIDC settings in this process's environment (the e2e stack's
    processes inherit it; request ``stack`` after this fixture)."""
    env = portal_env(provider.issuer)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def lab_user(username: str, **claims: Any) -> dict[str, Any]:
    """A provider user whose password is ``pw-<username>``: in vision-lab, uid
    20001, unless ``claims`` say otherwise (a claim set to ``...`` is left out)."""
    data: dict[str, Any] = {
        "groups": ["vision-lab"],
        "unix_name": username,
        "uid": 20001,
        "gid": 20001,
        "gids": [20001, 3000],
        "active": True,
    }
    data.update(claims)
    return {
        "username": username,
        "password": f"pw-{username}",
        "email": f"{username}@lab.example.org",
        "first_name": username.title(),
        "claims": {k: v for k, v in data.items() if v is not ...},
    }
