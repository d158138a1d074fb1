"""The API from the command line: one HTTP client (httpx), every failure turned
into a ``CliError`` with its exit code and a sentence that says what to do.

The API answers every error with ``{"error", "detail", "fields"}``; a 400's
``fields`` name the request's fields, which the caller maps to its options
(``time_limit_s`` -> ``--time``), so the user reads the option they typed.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import click
import httpx

from portal.cli.errors import CliError, Exit

if TYPE_CHECKING:
    from collections.abc import Mapping

API = "/api/v1/"
TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
# A 429, or the 503 of a server too busy to take the request (the concurrency
# gate's "busy": refused before anything ran, so repeating it does nothing
# twice), is waited out (Retry-After) this many times when the wait is short;
# a longer wait is the user's call. Other 503s (the database away) are not
# repeated: the request may have been carried out.
RETRIES_429 = 3
MAX_WAIT_429_S = 30.0


def cli_version() -> str:
    try:
        return version("gpulab")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


class Api:
    """``/api/v1/`` of one server, authenticated with a token."""

    def __init__(self, server: str, token: str | None) -> None:
        self.server = server
        # Also what ``gpulab shell`` presents on the terminal's websocket.
        self.token = token or ""
        headers = {"User-Agent": f"gpulab-cli/{cli_version()}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=server + API,
            headers=headers,
            timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, **params: Any) -> Any:
        query = {k: v for k, v in params.items() if v is not None}
        return self.request("GET", path, params=query)

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        fields: Mapping[str, str] | None = None,
    ) -> Any:
        return self.request("POST", path, json=body, fields=fields)

    def exchange(self, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to an OAuth-style endpoint, whose 400 and 429 are
        answers for the caller to read (``{"error": ...}``, e.g. RFC 8628's
        authorization_pending) rather than failures: their status and body, or
        a 2xx's. Anything else fails as in ``request``."""
        response = self._send("POST", path, None, body)
        got = _json(response)
        code = response.status_code
        if code in (400, 429) and isinstance(got, dict) and "error" in got:
            return code, got
        result = self._result(response, {})
        return code, result if isinstance(result, dict) else {}

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        fields: Mapping[str, str] | None = None,
    ) -> Any:
        """The decoded JSON of a 2xx answer; a ``CliError`` otherwise.
        ``fields`` maps the API's field names to the option names shown."""
        for attempt in range(RETRIES_429 + 1):
            response = self._send(method, path, params, json)
            why = _wait_out(response)
            if why is None or attempt == RETRIES_429:
                break
            wait = _retry_after(response)
            if wait is None or wait > MAX_WAIT_429_S:
                break
            click.echo(
                f"gpulab: {why.format(self.server)}; retrying in {wait:g} s", err=True
            )
            time.sleep(wait)
        return self._result(response, fields or {})

    def _send(
        self, method: str, path: str, params: Mapping[str, Any] | None, json: Any
    ) -> httpx.Response:
        try:
            return self._http.request(
                method, path.lstrip("/"), params=params, json=json
            )
        except httpx.TimeoutException:
            raise CliError(
                Exit.NETWORK,
                f"{self.server} did not answer within {TIMEOUT_S:g} s; try again later",
            ) from None
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise CliError(
                Exit.NETWORK,
                f"cannot reach {self.server} ({reason}); is the portal running"
                " and is the address right (--server, GPULAB_SERVER)?",
            ) from None

    def _result(self, response: httpx.Response, fields: Mapping[str, str]) -> Any:
        code = response.status_code
        body = _json(response)
        if 200 <= code < 300 and body is not _NOT_JSON:
            return body
        if body is _NOT_JSON or not isinstance(body, dict) or "error" not in body:
            where = response.headers.get("location")
            hint = (
                f"; it redirects to {where}: use that as --server"
                if 300 <= code < 400 and where
                else "; is --server the portal's address?"
            )
            raise CliError(
                Exit.SERVER,
                f"{self.server} answered {code} without the gpulab API's JSON{hint}",
            )
        detail = str(body.get("detail") or body["error"])
        if code == 400:
            raise CliError(Exit.USAGE, _invalid(body, fields))
        if code == 401:
            raise CliError(
                Exit.AUTH,
                f"{detail} (server {self.server}); run 'gpulab login' to sign in"
                " again (or set GPULAB_TOKEN)",
            )
        if code == 404:
            raise CliError(Exit.NOT_FOUND, detail)
        if code == 413:
            raise CliError(Exit.USAGE, detail)
        why = _wait_out(response)
        if why is not None:
            wait = _retry_after(response)
            after = f"; retry in {wait:g} s" if wait is not None else ""
            raise CliError(Exit.SERVER, f"{why.format(self.server)}{after}")
        if code == 403:
            raise CliError(Exit.SERVER, f"not allowed: {detail}")
        raise CliError(Exit.SERVER, detail if code < 500 else f"server error: {detail}")


_NOT_JSON: Any = object()


def _json(response: httpx.Response) -> Any:
    if not response.headers.get("content-type", "").startswith("application/json"):
        return _NOT_JSON
    try:
        return response.json()
    except ValueError:
        return _NOT_JSON


def _wait_out(response: httpx.Response) -> str | None:
    """What a refusal worth repeating after its Retry-After says (``{}``: the
    server), or None."""
    if response.status_code == 429:
        return "rate limited by {}"
    if response.status_code == 503:
        body = _json(response)
        if isinstance(body, dict) and body.get("error") == "busy":
            return "{} is too busy"
    return None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


def _invalid(body: dict[str, Any], names: Mapping[str, str]) -> str:
    """``invalid: --gpus: Only 6 GPU(s) in all ...`` one line per field, named as
    the user wrote it (an option, or COMMAND)."""
    errors = body.get("fields") or {}
    if not isinstance(errors, dict) or not errors:
        return f"invalid input: {body.get('detail', '')}"
    lines = ["the server refused the request:"]
    for name, messages in errors.items():
        top = str(name).split(".")[0]
        shown = names.get(top, top)
        if "." in str(name) and top in names:
            shown += f" ({str(name).split('.', 1)[1]})"
        text = messages if isinstance(messages, list) else [messages]
        lines += [f"  {shown}: {m}" for m in text]
    return "\n".join(lines)
