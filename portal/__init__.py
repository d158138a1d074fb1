"""The gpulab Django project: settings, ASGI/Celery apps, web UI, accounts.

The Celery app (``portal.celery``) is loaded by ``PortalConfig.ready`` (every
Django process) and by ``celery -A portal`` itself, not here: importing
``portal`` must stay free of Django and Celery, because the ``gpulab`` command
line (``portal.cli``) lives in this package and never imports Django.
"""
