"""Which account a provider's sign-in is (``portal.oidc.accounts.sign_in``, with the
claims a verified ID token and userinfo gave): found by issuer and ``sub``; a first
sign-in whose username claim names an existing account takes it only when the
account is the provider's to give. The refresh token is kept encrypted."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from portal.oidc import secrets
from portal.oidc.accounts import SignInRefused, sign_in
from portal.oidc.claims import ClaimError
from portal.oidc.models import OidcIdentity
from scheduler.models import Profile

if TYPE_CHECKING:
    from pytest_django.fixtures import SettingsWrapper

pytestmark = pytest.mark.django_db

ISSUER = "https://sso.example.org/realms/lab"


def claims(username: str, sub: str, **more: Any) -> dict[str, Any]:
    return {"sub": sub, "preferred_username": username, "groups": [], **more}


def test_the_account_is_found_by_subject_not_by_the_username_claim() -> None:
    ada = sign_in(claims("ada", "s-1"), ISSUER, "refresh-1")
    link = OidcIdentity.objects.get(user=ada)
    assert (link.issuer, link.sub) == (ISSUER, "s-1")
    assert ada.gpulab.directory == Profile.Directory.OIDC
    assert not ada.has_usable_password()

    # Renamed at the provider: the same account (it keeps its name).
    again = sign_in(claims("ada.lovelace", "s-1"), ISSUER, "refresh-2")
    assert again.pk == ada.pk
    assert again.username == "ada"
    assert not User.objects.filter(username="ada.lovelace").exists()
    # The same sub at another issuer is someone else.
    other = sign_in(claims("ada2", "s-1"), "https://other.example.org", "")
    assert other.pk != ada.pk


def test_another_subject_with_a_taken_username_is_refused() -> None:
    ada = sign_in(claims("ada", "s-1"), ISSUER)
    # The provider gave the name to someone new (a new subject).
    with pytest.raises(SignInRefused, match="belongs to another identity"):
        sign_in(claims("ada", "s-2", email="mallory@example.org"), ISSUER)
    ada.refresh_from_db()
    assert ada.email == ""
    assert OidcIdentity.objects.get(user=ada).sub == "s-1"
    assert not OidcIdentity.objects.filter(sub="s-2").exists()


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ("local", "gpulab has a local account named 'dennis'"),
        ("ldap", "comes from the LDAP directory"),
        ("hand-made", "that the identity provider did not make"),
    ],
)
def test_an_account_the_provider_did_not_make_is_not_taken(
    setup: str, says: str
) -> None:
    if setup == "local":
        dennis = User.objects.create_user("dennis", password="local-password")
    else:
        dennis = User.objects.create_user("dennis")  # no usable password
        if setup == "ldap":
            Profile.objects.create(user=dennis, directory=Profile.Directory.LDAP)
    with pytest.raises(SignInRefused, match=says):
        sign_in(claims("dennis", "s-9", groups=[]), ISSUER, "refresh")
    assert not OidcIdentity.objects.exists()
    dennis.refresh_from_db()
    assert dennis.has_usable_password() is (setup == "local")

    # An admin hands it over: the provider's dennis takes it, password gone.
    out = io.StringIO()
    call_command("oidc_handover", "dennis", stdout=out)
    assert "takes the account at their next sign-in" in out.getvalue()
    taken = sign_in(claims("dennis", "s-9"), ISSUER, "refresh")
    assert taken.pk == dennis.pk
    assert not taken.has_usable_password()
    assert OidcIdentity.objects.get(user=dennis).sub == "s-9"


def test_an_account_made_by_an_earlier_oidc_sign_in_is_linked_at_the_next() -> None:
    # Signed in before subjects were stored: an OIDC account with no identity.
    grace = User.objects.create_user("grace")
    Profile.objects.create(user=grace, directory=Profile.Directory.OIDC)
    assert sign_in(claims("grace", "s-g"), ISSUER).pk == grace.pk
    assert OidcIdentity.objects.get(user=grace).sub == "s-g"


def test_a_missing_or_odd_subject_is_refused_naming_the_claim() -> None:
    for sub in (None, "", 5, "x" * 256):
        with pytest.raises(ClaimError, match="'sub'"):
            sign_in(claims("ada", sub), ISSUER)  # type: ignore[arg-type]
    assert not User.objects.filter(username="ada").exists()


def test_the_refresh_token_is_stored_encrypted_and_replaced_at_each_sign_in() -> None:
    ada = sign_in(claims("ada", "s-1"), ISSUER, "rt-first-0123")
    stored = OidcIdentity.objects.get(user=ada).refresh_token
    assert "rt-first-0123" not in stored
    assert secrets.decrypt(stored) == "rt-first-0123"
    sign_in(claims("ada", "s-1"), ISSUER, "rt-second-4567")
    assert secrets.decrypt(OidcIdentity.objects.get(user=ada).refresh_token) == (
        "rt-second-4567"
    )


def test_a_rotated_key_still_opens_tokens_stored_under_the_old_one(
    settings: SettingsWrapper,
) -> None:
    settings.GPULAB_OIDC_TOKEN_KEY = ["the-old-passphrase-0123"]
    stored = secrets.encrypt("refresh-me")
    settings.GPULAB_OIDC_TOKEN_KEY = [
        "the-new-passphrase-4567",
        "the-old-passphrase-0123",
    ]
    assert secrets.decrypt(stored) == "refresh-me"
    assert secrets.decrypt(secrets.encrypt("x")) == "x"
    settings.GPULAB_OIDC_TOKEN_KEY = ["the-new-passphrase-4567"]
    with pytest.raises(secrets.UnreadableToken, match="GPULAB_OIDC_TOKEN_KEY"):
        secrets.decrypt(stored)
    # The default key is the secret key's, not the secret key itself.
    settings.GPULAB_OIDC_TOKEN_KEY = []
    assert secrets.decrypt(secrets.encrypt("y")) == "y"
