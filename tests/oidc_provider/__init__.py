"""A real OpenID Connect provider for the tests (django-oidc-provider), run as its
own process on its own PostgreSQL database: ``tests/oidc/conftest.py`` migrates it,
seeds a client and users (``manage.py seed_lab``) and serves it with uvicorn.

Its users' lab claims (groups, Unix account, active) live in ``lab.Claims`` as
JSON, so a test can give a claim the wrong type or leave it out.
"""
