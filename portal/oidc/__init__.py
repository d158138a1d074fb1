"""Sign-in through an OpenID Connect provider (mozilla-django-oidc underneath).

``discovery`` reads the provider's endpoints, ``claims`` turns its claims into a
``portal.directory.DirectoryIdentity``, ``backend`` is the authentication backend
that applies it (the same mapping as LDAP), ``views`` the sign-in, callback and
sign-out glue. Settings: ``portal/settings_oidc.py``.
"""
