"""Where the UI sends people who use the API: its browsable docs (Swagger UI)
work without the internet (the page loads its scripts and styles from this
server) and the Tokens page links to them and says a login command the CLI
accepts."""

from __future__ import annotations

import re
import shlex
from html import unescape
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

import pytest
from django.test import Client
from django.urls import reverse

if TYPE_CHECKING:
    from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db

# Every URL the page's HTML and inline script name: attributes and quoted strings.
URL = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|["'](\w+:)?//[^"'\s]+["']""")


def test_the_docs_page_loads_everything_from_this_server(alice: User) -> None:
    client = Client()
    client.force_login(alice)  # the page carries the session: nothing may leak out
    docs = reverse("api-docs")

    page = client.get(docs)

    assert page.status_code == 200
    html = page.content.decode()
    external = [
        m.group(0) for m in URL.finditer(html) if "//" in m.group(0).split("=")[-1]
    ]
    assert external == [], f"the docs page names other hosts: {external}"
    assets = {urljoin(docs, m.group(1)) for m in URL.finditer(html) if m.group(1)}
    scripts = {a for a in assets if a.endswith(".js")}
    styles = {a for a in assets if a.endswith(".css")}
    assert scripts and styles, assets
    for asset in sorted(scripts | styles):
        path = urlsplit(asset).path
        response = client.get(path)
        assert response.status_code == 200, path
        body = b"".join(response.streaming_content)  # type: ignore[attr-defined]
        assert len(body) > 1000, path  # the bundle, not an error page


def test_the_tokens_page_links_to_the_api_docs(alice: User) -> None:
    client = Client()
    client.force_login(alice)

    page = client.get(reverse("api-tokens")).content.decode()

    assert f'href="{reverse("api-docs")}"' in page


def test_the_tokens_page_says_a_login_command_the_cli_accepts(alice: User) -> None:
    from portal.cli.main import cli

    client = Client()
    client.force_login(alice)

    page = client.post(reverse("api-tokens"), {"name": "laptop", "days": 30})

    assert page.status_code == 200
    html = page.content.decode()
    commands = re.findall(r"<code>(gpulab [^<]*)</code>", html)
    assert commands, "the new token's page says which command to run"
    for command in commands:
        # Parsed by the CLI's own parser: an option it lacks raises NoSuchOption.
        args = shlex.split(unescape(command))[1:]
        assert "login" in args, command
        at = args.index("login")
        ctx = cli.make_context("gpulab", args[: at + 1])  # the group's options
        cli.commands["login"].make_context("login", args[at + 1 :], parent=ctx)
        assert ctx.params["server"] == "http://testserver"
