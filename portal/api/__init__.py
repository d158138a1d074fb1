"""The REST API (``/api/v1/``): personal tokens, throttling, error bodies,
and views that call ``scheduler.services`` with the web UI's permission rules."""
