"""``gpulab login`` through the browser: the two API endpoints of RFC 8628's
device authorization grant. The approval page is ``pages.device_login``; the
verbs are in ``tokens``.

1. ``POST device/code/`` (no token needed; ``GPULAB_DEVICE_CODE_RATE`` per
   client address per ``GPULAB_DEVICE_CODE_WINDOW``): the CLI sends its
   machine's name and gets a device code (kept secret by the CLI), a short user
   code and the approval page's URL, with and without the code in it.
2. The user opens the page, signed in, compares the code and approves or denies.
3. ``POST device/token/``: the CLI polls with the device code every ``interval``
   seconds; a 400 says why there is no token yet (RFC 8628 3.5's error codes in
   the API's error body), a 200 carries a token of the user's, named after the
   machine, listed on the Tokens page, issued once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.urls import reverse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api import throttling, tokens
from portal.api.errors import body
from portal.api.serializers import ErrorSerializer, Text
from portal.api.views.common import errors

if TYPE_CHECKING:
    from rest_framework.request import Request

log = logging.getLogger(__name__)


class DeviceCodeThrottle(throttling.RedisRateThrottle):
    """Device codes asked for per client address (POST only), on top of the
    API's own rate limit: each one is a row and a code to guess."""

    what = "device code rate limit"

    def budget(self, request: Request) -> tuple[str, int, float] | None:
        if request.method != "POST":
            return None
        return (
            f"device-code:{request.META.get('REMOTE_ADDR', '')}",
            settings.GPULAB_DEVICE_CODE_RATE,
            settings.GPULAB_DEVICE_CODE_WINDOW,
        )


class DeviceCodeIn(serializers.Serializer[Any]):
    client_name = Text(
        max_length=100,
        help_text="The machine asking (its host name): the approval page shows it "
        "and the token is named after it.",
    )


class DeviceCodeOut(serializers.Serializer[Any]):
    device_code = serializers.CharField(help_text="Secret: poll device/token/ with it.")
    user_code = serializers.CharField(help_text="Shown to the user: BCDF-GHJK.")
    verification_uri = serializers.CharField(help_text="The approval page.")
    verification_uri_complete = serializers.CharField(
        help_text="The approval page with the user code filled in."
    )
    expires_in = serializers.IntegerField(help_text="Seconds the codes stay valid.")
    interval = serializers.IntegerField(help_text="Seconds between polls.")


class DeviceTokenIn(serializers.Serializer[Any]):
    device_code = Text(max_length=200)


class DeviceTokenOut(serializers.Serializer[Any]):
    access_token = serializers.CharField(help_text="A personal token: gpl_...")
    token_type = serializers.CharField(help_text="Bearer")
    expires_in = serializers.IntegerField(
        allow_null=True, help_text="Seconds the token lives (null: no expiry)."
    )
    token_name = serializers.CharField()
    username = serializers.CharField()


POLL_ERRORS = (
    "No token (yet): error is authorization_pending (poll again after interval), "
    "slow_down (add 5 s to the interval), access_denied, expired_token, "
    "invalid_grant (unknown or already used) or invalid (see fields)."
)


class DeviceCode(APIView):
    permission_classes = (AllowAny,)
    throttle_classes = (throttling.RedisRateThrottle, DeviceCodeThrottle)

    @extend_schema(
        operation_id="device_code",
        request=DeviceCodeIn,
        responses={200: DeviceCodeOut, **errors(400, 415)},
        summary="Start gpulab login through the browser (RFC 8628)",
    )
    def post(self, request: Request) -> Response:
        data = DeviceCodeIn(data=request.data)
        data.is_valid(raise_exception=True)
        row, device_code = tokens.start_device_login(
            data.validated_data["client_name"], request.META.get("REMOTE_ADDR")
        )
        page = request.build_absolute_uri(reverse("device-login"))
        out = {
            "device_code": device_code,
            "user_code": row.shown_code,
            "verification_uri": page,
            "verification_uri_complete": f"{page}?code={row.shown_code}",
            "expires_in": int((row.expires_at - row.created_at).total_seconds()),
            "interval": row.interval,
        }
        return Response(DeviceCodeOut(out).data, headers={"Cache-Control": "no-store"})


class DeviceToken(APIView):
    permission_classes = (AllowAny,)

    @extend_schema(
        operation_id="device_token",
        request=DeviceTokenIn,
        responses={
            200: DeviceTokenOut,
            **errors(415),
            400: OpenApiResponse(ErrorSerializer, description=POLL_ERRORS),
        },
        summary="Poll for the token of an approved gpulab login",
    )
    def post(self, request: Request) -> Response:
        data = DeviceTokenIn(data=request.data)
        data.is_valid(raise_exception=True)
        no_store = {"Cache-Control": "no-store"}
        try:
            issued = tokens.redeem_device_code(data.validated_data["device_code"])
        except tokens.DeviceGrantError as exc:
            return Response(body(exc.code, exc.detail), status=400, headers=no_store)
        token = issued.token
        lives = (
            int((token.expires_at - token.created_at).total_seconds())
            if token.expires_at
            else None
        )
        out = {
            "access_token": issued.secret,
            "token_type": "Bearer",
            "expires_in": lives,
            "token_name": token.name,
            "username": token.user.get_username(),
        }
        return Response(DeviceTokenOut(out).data, headers=no_store)
