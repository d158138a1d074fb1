"""Limits on what one request may ask for, so that every request has a bounded
cost (a wide range or a deep page is refused with a 400 naming the limit instead
of holding a worker and its memory for everyone else). Imported at the end of
``portal.settings``; each is an environment variable a lab may change."""

from __future__ import annotations

from portal.settings_env import envfloat, envint

# The Usage page, its CSV export and ``GET /api/v1/usage/``: UTC days one request
# may span, both ends included (a year and a day by default, so a whole leap year
# fits).
GPULAB_USAGE_MAX_DAYS = envint("GPULAB_USAGE_MAX_DAYS", 366, minimum=1, maximum=3660)
# Rows one page of an API list may hold (``limit`` of ``/api/v1/jobs/`` and
# ``/api/v1/queue/``; at least 1000, the page the command line asks for), and the
# deepest ``offset`` of a list: past it, narrow the list with its filters instead.
GPULAB_API_MAX_PAGE = envint("GPULAB_API_MAX_PAGE", 1000, minimum=1000, maximum=10_000)
GPULAB_API_MAX_OFFSET = envint(
    "GPULAB_API_MAX_OFFSET", 1_000_000, minimum=1000, maximum=10**9
)
# A job's history shown at most, the latest first kept (the job's page and
# ``/api/v1/jobs/<id>/events/``): holding and releasing a job over and over adds
# an event each time.
GPULAB_JOB_EVENTS_MAX = envint(
    "GPULAB_JOB_EVENTS_MAX", 1000, minimum=10, maximum=100_000
)
# The web process's gate (portal/gate.py): requests one client (token, else
# session, else address) runs at once, pages and API calls together; the rest of
# its requests wait, and a freed place goes first to the client running fewest
# (0: no cap).
GPULAB_WEB_RUNNING_PER_CLIENT = envint(
    "GPULAB_WEB_RUNNING_PER_CLIENT", 2, minimum=0, maximum=1000
)
# Heavy requests (a list page of more than 100 rows, the Usage CSV) running at
# once in a web process, both lanes together; the others wait (0: no cap). Each
# holds the GIL for long stretches, slowing every other request of the process.
GPULAB_WEB_HEAVY_CONCURRENCY = envint(
    "GPULAB_WEB_HEAVY_CONCURRENCY", 1, minimum=0, maximum=1000
)
# How often, in ms, the web process's interpreter hands the GIL from a running
# thread to a waiting one (Python's default: 5). A heavy render runs long
# stretches of Python code; a light request waits about this long at each step:
# 1 ms halved another user's p95 beside four heavy pages, the pages' own
# throughput unchanged (docs/benchmarks.md, "Bounded cost").
GPULAB_WEB_SWITCH_INTERVAL_MS = envfloat(
    "GPULAB_WEB_SWITCH_INTERVAL_MS", 1.0, minimum=0.1, maximum=100.0
)
