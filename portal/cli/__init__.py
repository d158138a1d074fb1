"""``gpulab``, the command line: the REST API (``/api/v1/``) from a
shell, with a personal token.

It runs on login nodes and laptops that have no database, no settings and no
secret key, so nothing here imports Django, Celery or any other part of the
portal but the pure ``portal.units`` (and the pure ``agents.jobtext``, how job
text is shown): it speaks HTTP (httpx), parses arguments (click) and draws the
live view (rich). ``tests/cli`` checks that running it
loads no Django.
"""
