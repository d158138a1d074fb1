"""The provider's endpoints, read from its discovery document
(``.well-known/openid-configuration``) when someone signs in, cached per process.

A provider that cannot be reached, answers an error or sends a document that is not
a usable discovery document raises ``ProviderUnavailable`` with a message naming the
URL and what is wrong: the login page shows it and the log keeps it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

WELL_KNOWN = "/.well-known/openid-configuration"
REQUIRED = ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri")


class ProviderUnavailable(Exception):
    """The identity provider cannot be used now; the message names its URL."""


@dataclass(frozen=True)
class Provider:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    userinfo_endpoint: str
    jwks_uri: str
    end_session_endpoint: str = ""


_lock = threading.Lock()
_cache: dict[str, tuple[float, Provider]] = {}


def discovery_url() -> str:
    """The configured URL, with the well-known path added to a bare issuer URL."""
    url = str(settings.GPULAB_OIDC_DISCOVERY_URL).rstrip("/")
    return url if url.endswith(WELL_KNOWN) else url + WELL_KNOWN


def provider() -> Provider:
    """The provider's endpoints (cached ``GPULAB_OIDC_DISCOVERY_TTL`` seconds; a
    failure is not cached, so the next sign-in tries again)."""
    url = discovery_url()
    now = time.monotonic()
    with _lock:
        hit = _cache.get(url)
        if hit and now - hit[0] < float(settings.GPULAB_OIDC_DISCOVERY_TTL):
            return hit[1]
    found = fetch(url)
    with _lock:
        _cache[url] = (now, found)
    return found


def forget() -> None:
    """Drop the cached documents (a test that changes the provider)."""
    with _lock:
        _cache.clear()


def fetch(url: str) -> Provider:
    try:
        response = httpx.get(
            url,
            timeout=float(settings.OIDC_TIMEOUT),
            verify=bool(settings.OIDC_VERIFY_SSL),
            follow_redirects=True,
            headers={"Accept": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise ProviderUnavailable(
            f"The identity provider cannot be reached at {url}: {describe(exc)}"
        ) from exc
    if response.status_code != 200:
        raise ProviderUnavailable(
            f"The identity provider's discovery document at {url} answered HTTP"
            f" {response.status_code}"
        )
    try:
        document = response.json()
    except ValueError:
        raise ProviderUnavailable(
            f"The identity provider's discovery document at {url} is not JSON"
        ) from None
    return parse(url, document)


def parse(url: str, document: Any) -> Provider:
    """A ``Provider`` from a discovery document; every missing or non-URL endpoint
    named at once."""
    if not isinstance(document, dict):
        raise ProviderUnavailable(
            f"The identity provider's discovery document at {url} is not a JSON object"
        )
    wrong = [key for key in REQUIRED if not _is_url(document.get(key))]
    end_session = document.get("end_session_endpoint")
    if end_session is not None and not _is_url(end_session):
        wrong.append("end_session_endpoint")
    if wrong:
        raise ProviderUnavailable(
            f"The identity provider's discovery document at {url} lacks a usable"
            f" {', '.join(wrong)}"
        )
    return Provider(
        issuer=str(document.get("issuer", "")),
        authorization_endpoint=document["authorization_endpoint"],
        token_endpoint=document["token_endpoint"],
        userinfo_endpoint=document["userinfo_endpoint"],
        jwks_uri=document["jwks_uri"],
        end_session_endpoint=end_session or "",
    )


def _is_url(value: object) -> bool:
    return isinstance(value, str) and value.lower().startswith(("https://", "http://"))


def describe(exc: BaseException) -> str:
    """A short reason for a failed call (connection refused, timed out, ...)."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    text = str(exc).strip()
    return text or type(exc).__name__
