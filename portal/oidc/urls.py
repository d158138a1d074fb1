"""/oidc/: the login button, the provider's callback (the redirect URI to register:
https://<portal>/oidc/callback/) and the page after signing out."""

from __future__ import annotations

from django.urls import path

from portal.oidc import views

urlpatterns = [
    path(
        "authenticate/",
        views.Authenticate.as_view(),
        name="oidc_authentication_init",
    ),
    path("callback/", views.Callback.as_view(), name="oidc_authentication_callback"),
    path("signed-out/", views.signed_out, name="oidc-signed-out"),
]
