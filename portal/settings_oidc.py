"""Sign-in through the lab's OpenID Connect provider (Keycloak, Dex, Authentik, ...);
pulled into ``portal.settings``. OpenID Connect is on only when
``GPULAB_OIDC_DISCOVERY_URL`` is set; docs/admin-guide.md "Signing in with OpenID
Connect" has a worked example.

The provider's endpoints are not settings: ``portal.oidc.discovery`` reads them from
the discovery document when someone signs in, so an unreachable provider at start
does not stop the portal (local break-glass sign-in keeps working) and the login
page names the server instead.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from portal import settings_directory as _directory
from portal.settings_env import envbool, envchoice, envfloat, envsecret, envstr

# The provider's discovery document, e.g.
# https://sso.example.org/realms/lab/.well-known/openid-configuration (the issuer's
# URL alone is accepted too: the well-known path is appended).
GPULAB_OIDC_DISCOVERY_URL = envstr("GPULAB_OIDC_DISCOVERY_URL", "").strip()
GPULAB_OIDC_ENABLED = bool(GPULAB_OIDC_DISCOVERY_URL)
if GPULAB_OIDC_ENABLED and not GPULAB_OIDC_DISCOVERY_URL.lower().startswith(
    ("https://", "http://")
):
    raise ImproperlyConfigured(
        f"GPULAB_OIDC_DISCOVERY_URL={GPULAB_OIDC_DISCOVERY_URL!r} is not an http(s)"
        " URL (e.g. https://sso.example.org/realms/lab/.well-known/"
        "openid-configuration)"
    )

# The client registered at the provider (confidential, authorization code flow,
# redirect URI https://<portal>/oidc/callback/). Required once OIDC is on; the
# secret may come from a file (GPULAB_OIDC_CLIENT_SECRET_FILE).
OIDC_RP_CLIENT_ID = envstr("GPULAB_OIDC_CLIENT_ID", None if GPULAB_OIDC_ENABLED else "")
OIDC_RP_CLIENT_SECRET = (
    envsecret("GPULAB_OIDC_CLIENT_SECRET") if GPULAB_OIDC_ENABLED else ""
)
# The login page's button.
GPULAB_OIDC_BUTTON_LABEL = envstr(
    "GPULAB_OIDC_BUTTON_LABEL", "Sign in with OpenID Connect"
)
# Scopes asked for: add the scope that carries the groups and Unix claims when the
# provider does not send them by default.
OIDC_RP_SCOPES = envstr("GPULAB_OIDC_SCOPES", "openid email profile")
if "openid" not in OIDC_RP_SCOPES.split():
    raise ImproperlyConfigured(
        f"GPULAB_OIDC_SCOPES={OIDC_RP_SCOPES!r} must include the scope openid"
    )
# Which claims say what (portal.oidc.claims). The username claim is required; the
# groups claim too unless set to "-" (then gpulab groups are left as an admin set
# them); the Unix account's claims are read only when named.
GPULAB_OIDC_USERNAME_CLAIM = envstr("GPULAB_OIDC_USERNAME_CLAIM", "preferred_username")
GPULAB_OIDC_GROUPS_CLAIM = envstr("GPULAB_OIDC_GROUPS_CLAIM", "groups")
GPULAB_OIDC_UNIX_NAME_CLAIM = envstr("GPULAB_OIDC_UNIX_NAME_CLAIM", "")
GPULAB_OIDC_UID_CLAIM = envstr("GPULAB_OIDC_UID_CLAIM", "")
GPULAB_OIDC_GID_CLAIM = envstr("GPULAB_OIDC_GID_CLAIM", "")
GPULAB_OIDC_GIDS_CLAIM = envstr("GPULAB_OIDC_GIDS_CLAIM", "")
if bool(GPULAB_OIDC_UID_CLAIM) != bool(GPULAB_OIDC_GID_CLAIM):
    raise ImproperlyConfigured(
        "GPULAB_OIDC_UID_CLAIM and GPULAB_OIDC_GID_CLAIM go together: jobs run under"
        " a uid and its primary gid (set both, or neither)"
    )
if GPULAB_OIDC_GIDS_CLAIM and not GPULAB_OIDC_UID_CLAIM:
    raise ImproperlyConfigured(
        "GPULAB_OIDC_GIDS_CLAIM needs GPULAB_OIDC_UID_CLAIM and GPULAB_OIDC_GID_CLAIM"
    )
# A boolean claim that is false for a user the provider disabled (or removed from
# the lab): they are deactivated in gpulab (sessions, tokens, waiting jobs) and
# refused. Empty: not read.
GPULAB_OIDC_ACTIVE_CLAIM = envstr("GPULAB_OIDC_ACTIVE_CLAIM", "")

# Every OpenID Connect user is refreshed at the provider this often (seconds):
# their refresh token, kept since their last sign-in, is used at the token
# endpoint; refused -> deactivated; the claims -> groups and Unix account
# (portal.oidc.refresh).
GPULAB_OIDC_REFRESH_INTERVAL = envfloat(
    "GPULAB_OIDC_REFRESH_INTERVAL", 900.0, minimum=10.0
)
# The refresh tokens are stored encrypted under a key derived from this passphrase
# (default: DJANGO_SECRET_KEY and its fallbacks). Comma-separated: the first
# encrypts, every one decrypts (rotation: put the new one first).
GPULAB_OIDC_TOKEN_KEY = [
    key.strip()
    for key in envsecret("GPULAB_OIDC_TOKEN_KEY", "").split(",")
    if key.strip()
]
for _key in GPULAB_OIDC_TOKEN_KEY:
    if len(_key) < 16:
        raise ImproperlyConfigured(
            "GPULAB_OIDC_TOKEN_KEY: each key must be at least 16 characters"
        )
OIDC_BEAT_SCHEDULE: dict[str, dict[str, object]] = {}
if GPULAB_OIDC_ENABLED:
    OIDC_BEAT_SCHEDULE["oidc-refresh"] = {
        "task": "portal.oidc.tasks.refresh",
        "schedule": GPULAB_OIDC_REFRESH_INTERVAL,
        "options": {"expires": GPULAB_OIDC_REFRESH_INTERVAL},
    }

# The ID token's signature: RS256 / ES256 with the provider's published keys
# (jwks_uri), or HS256 with the client secret.
OIDC_RP_SIGN_ALGO = envchoice(
    "GPULAB_OIDC_SIGN_ALGO", "RS256", ("RS256", "RS384", "RS512", "ES256", "HS256")
)
# Seconds to wait for the provider (discovery, token, userinfo, keys).
OIDC_TIMEOUT = envfloat("GPULAB_OIDC_TIMEOUT", 10.0, minimum=0.5, maximum=120.0)
# The discovery document is cached this long per web process.
GPULAB_OIDC_DISCOVERY_TTL = envfloat(
    "GPULAB_OIDC_DISCOVERY_TTL", 300.0, minimum=0.0, maximum=86400.0
)
# Only for a test provider on plain HTTP with a self-signed certificate: never in
# production.
OIDC_VERIFY_SSL = envbool("GPULAB_OIDC_VERIFY_TLS", default=True)

# mozilla-django-oidc's own settings, fixed.
OIDC_USE_PKCE = True
OIDC_STORE_ID_TOKEN = True
OIDC_AUTHENTICATE_CLASS = "portal.oidc.views.Authenticate"
OIDC_CALLBACK_CLASS = "portal.oidc.views.Callback"
LOGIN_REDIRECT_URL_FAILURE = "login"
# Signing out ends the portal session, then (when the provider publishes an
# end_session_endpoint) the provider's: portal.oidc.views.signed_out.
LOGOUT_REDIRECT_URL = "oidc-signed-out"

# The directory's backends (local passwords, LDAP: portal.settings_directory), then
# this one.
AUTHENTICATION_BACKENDS = [
    *getattr(
        _directory,
        "AUTHENTICATION_BACKENDS",
        ["django.contrib.auth.backends.ModelBackend"],
    ),
    # Answers only the provider's callback (a code and a state): harmless to a
    # password sign-in, and needed for the sessions it opens.
    "portal.oidc.backend.OIDCBackend",
]
