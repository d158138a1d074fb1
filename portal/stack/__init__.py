"""Developer stack: embedded PostgreSQL/Redis and the ``make up`` / ``make test``
entry points. Nothing here imports Django at module level (settings need the URLs
these modules produce)."""
