"""Where a webhook may go: not into the portal's own network (SSRF).

A user's webhook URL is fetched by the notifier from inside the lab. So its host
must resolve only to public addresses: loopback, private, link-local (cloud
metadata at 169.254.169.254), multicast, reserved, unspecified and shared
addresses are refused, unless inside ``GPULAB_WEBHOOK_ALLOWED_NETWORKS``.

Checked when the preferences are saved (a form error naming the address and
why), and again at each send: the host is resolved once, every address checked,
and the request goes to a checked address (``pinned``) with the URL's host kept
in the Host header and as the TLS server name, so a DNS answer that changed
since (rebinding) cannot move the request elsewhere. Redirects are not followed
and proxy settings from the environment are not used (a proxy would connect
elsewhere than the checked address).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings

if TYPE_CHECKING:
    from collections.abc import Iterable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class RefusedTarget(ValueError):
    """A webhook URL that may not be used; ``str()`` says why, for its owner."""


def category(address: Address) -> str | None:
    """Why an address is no place for a webhook (None: a public address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    checks = (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("non-public", not address.is_global),
    )
    return next((name for name, hit in checks if hit), None)


def allowed(address: Address) -> bool:
    networks = settings.GPULAB_WEBHOOK_ALLOWED_NETWORKS
    candidates: list[Address] = [address]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        candidates.append(address.ipv4_mapped)
    if any(a in n for a in candidates for n in networks if a.version == n.version):
        return True
    return category(address) is None


def _host_port(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RefusedTarget("Use an http:// or https:// address with a host name.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise RefusedTarget("The port of the address is not a number.") from None
    return parts.hostname, port, parts.scheme


def resolve(host: str, port: int) -> list[Address]:
    """The host's addresses, in the resolver's order, each once."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise RefusedTarget(f"{host} cannot be resolved ({exc}).") from None
    out: list[Address] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in out:
            out.append(address)
    if not out:
        raise RefusedTarget(f"{host} has no address.")
    return out


def checked(addresses: Iterable[Address], host: str) -> list[Address]:
    """All of them, if every one may be used: a host that also resolves to an
    internal address is refused whichever address a client would pick."""
    addresses = list(addresses)
    for address in addresses:
        if not allowed(address):
            shown = host if host == str(address) else f"{host} resolves to {address}"
            kind = category(address) or "refused"
            article = "an" if kind[0] in "aeiou" else "a"
            raise RefusedTarget(
                f"{shown}, {article} {kind} address: webhooks may not reach "
                "the portal's own network (an admin can allow a network with "
                "GPULAB_WEBHOOK_ALLOWED_NETWORKS)."
            )
    return addresses


def check(url: str) -> list[Address]:
    """Resolve the URL's host and check every address; raises ``RefusedTarget``."""
    host, port, _ = _host_port(url)
    return checked(resolve(host, port), host)


@dataclass(frozen=True)
class Pinned:
    """A request to a checked address: the URL with the address as its host, the
    Host header and the TLS server name of the original URL."""

    url: str
    host_header: str
    server_name: str | None  # for https: what the certificate must name


def pinned(url: str, address: Address) -> Pinned:
    parts = urlsplit(url)
    host, port, scheme = _host_port(url)
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{literal}:{port}"
    default = (scheme == "https" and port == 443) or (scheme == "http" and port == 80)
    shown = f"[{host}]" if ":" in host else host
    return Pinned(
        url=urlunsplit((scheme, netloc, parts.path or "/", parts.query, "")),
        host_header=shown if default else f"{shown}:{port}",
        server_name=host if scheme == "https" else None,
    )
