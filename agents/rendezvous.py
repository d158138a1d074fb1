"""The rendezvous of a job spanning nodes, as the rank-0 agent sees it.

The portal gives every rank ``GPULAB_NNODES``, ``GPULAB_NODE_RANK``,
``GPULAB_MASTER_ADDR`` and ``GPULAB_MASTER_PORT`` (and torchrun's own names). Rank 0's
``torchrun`` listens on the master port (c10d's TCPStore, on every address); if
something else already listens there, every rank would fail or hang at the
rendezvous. So the rank-0 agent checks the port before it launches and, if it is
taken, does not launch (the portal relaunches the job as a new attempt, with a new
port).
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping


def rank0_rendezvous(env: Mapping[str, str]) -> tuple[str, int] | None:
    """``(master address, port)`` if these are rank 0's variables of a job spanning
    nodes, else None (a single-node job, another rank, or variables we cannot read:
    then there is nothing for this agent to check)."""
    try:
        nodes = int(env.get("GPULAB_NNODES", "1"))
        rank = int(env.get("GPULAB_NODE_RANK", "-1"))
        port = int(env["GPULAB_MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    if nodes < 2 or rank != 0 or not 0 < port < 65536:
        return None
    return env.get("GPULAB_MASTER_ADDR", ""), port


def port_busy(host: str, port: int) -> str | None:
    """Why ``port`` cannot be listened on here, or None when it is free.

    Binds (and closes at once) a TCP socket on the wildcard address and on each
    address ``host`` resolves to, with ``SO_REUSEADDR`` as c10d's TCPStore does, so
    a port held only by connections in TIME_WAIT counts as free and one with a
    listener as busy. An address that is not this node's (``EADDRNOTAVAIL``) or a
    name that does not resolve is not a busy port: it is skipped.
    """
    addresses: list[tuple[socket.AddressFamily, str]] = [(socket.AF_INET, "0.0.0.0")]
    if host:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            infos = []
        addresses += [
            (info[0], str(info[4][0]))
            for info in infos
            if info[0] in (socket.AF_INET, socket.AF_INET6)
        ]
    seen: set[tuple[socket.AddressFamily, str]] = set()
    for family, address in addresses:
        if (family, address) in seen:
            continue
        seen.add((family, address))
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"rendezvous port {port} busy ({address}: {exc.strerror})"
    return None
