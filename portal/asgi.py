"""ASGI entry point: HTTP (Django), browser websockets and agent websockets; the
lifespan runs the process's hearing pulse (``presence.hear_agents``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from django.conf import settings
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
# A connection pool, not persistent connections, under ASGI (portal/settings.py),
# for this process's settings only: a process that imported this module after its
# settings were loaded (a test run) must not hand the flag to its children.
_pool_was_set = "GPULAB_DB_POOL" in os.environ
os.environ.setdefault("GPULAB_DB_POOL", "1")
# Initialise Django before importing anything that touches models.
django_asgi_app = get_asgi_application()
if not _pool_was_set:
    del os.environ["GPULAB_DB_POOL"]
# A light request's thread waits about a switch interval for the GIL at each
# step while a heavy render runs (portal/gate.py).
sys.setswitchinterval(settings.GPULAB_WEB_SWITCH_INTERVAL_MS / 1000)

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from portal.api.middleware import BodyLimit  # noqa: E402
from portal.consumers import DashboardConsumer  # noqa: E402
from portal.gate import ConcurrencyGate  # noqa: E402
from portal.interactive.proxy import InteractiveProxy  # noqa: E402
from portal.terminal.consumers import TerminalConsumer  # noqa: E402
from scheduler.consumers import AgentConsumer  # noqa: E402
from scheduler.services.presence import hear_agents  # noqa: E402

_terminal_path = path(
    "ws/interactive/<int:job_id>/terminal/",
    TerminalConsumer.as_asgi(),  # type: ignore[arg-type]
)
# Agents send no Origin header: the Origin check stays off their route (they
# authenticate by token) and on the browsers' route (session cookies).
browser_routes = AllowedHostsOriginValidator(
    AuthMiddlewareStack(
        URLRouter([path("ws/dashboard/", DashboardConsumer.as_asgi()), _terminal_path])  # type: ignore[arg-type, list-item]
    )
)
agent_routes = URLRouter([path("ws/agent/", AgentConsumer.as_asgi())])  # type: ignore[arg-type, list-item]
# ``gpulab shell``: an API token in the handshake, no Origin (a browser cannot
# set that header on a websocket, so no other site can use it either).
token_routes = URLRouter([_terminal_path])  # type: ignore[list-item]


def _has_authorization(scope) -> bool:  # type: ignore[no-untyped-def]
    return any(name.lower() == b"authorization" for name, _ in scope["headers"])


async def _websocket_router(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["path"].startswith("/ws/agent/"):
        return await agent_routes(scope, receive, send)
    if scope["path"].startswith("/ws/interactive/") and _has_authorization(scope):
        return await token_routes(scope, receive, send)
    return await browser_routes(scope, receive, send)


async def _lifespan(scope, receive, send):  # type: ignore[no-untyped-def]
    """While the server serves, pulse that the portal hears its agents."""
    pulse: asyncio.Task[None] | None = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            pulse = asyncio.create_task(hear_agents())
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if pulse is not None:
                pulse.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pulse
            await send({"type": "lifespan.shutdown.complete"})
            return


# Interactive jobs' JupyterLab (/interactive/<id>/...), HTTP and websockets,
# goes to the proxy ahead of the gate and the browser router: it streams on the
# event loop with its own cap per job (portal/interactive/proxy.py).
interactive = InteractiveProxy(
    http=BodyLimit(ConcurrencyGate(django_asgi_app)), websocket=_websocket_router
)

application = ProtocolTypeRouter(
    # The API's body limit holds before Django's handler reads the body, and
    # before the request waits for its turn (a slow body holds no slot).
    {
        "http": interactive,
        "websocket": interactive,
        "lifespan": _lifespan,
    }
)
