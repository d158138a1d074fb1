"""gpulab node agent: a standalone package (never imports Django).

Run it with ``python -m agents --server ws://HOST:PORT --token-file FILE`` (or the
``gpulab-agent`` script); ``--simulate 4xA100-80GB`` runs a simulated node on a machine
without GPUs. The server and the agent share only ``agents/protocol.py`` and
``agents/jobtext.py`` (the rules of a job's text).

Accounts: a job runs as its ``run_as`` account, which needs the agent to run as root.
An agent running as root runs jobs without ``run_as`` as ``--default-account USER``;
without one it refuses them, and it never runs a job as root (no ``run_as``, or a
``run_as`` with uid 0) unless started with ``--allow-root-jobs``. The demo runs the
agent as the current user, so jobs without ``run_as`` simply run as that user.

Limits: the agent stops a job at its ``time_limit_s`` (counted from the start it
reported; reason ``timeout``). With ``--kill-after-disconnect S`` it stops every job
once the portal has been unreachable for S seconds (reason ``killed``). While
disconnected it spools one metrics sample every ``--spool-metrics-interval`` (10 s)
into a spool capped at ``--spool-max-mb`` (64; the oldest samples go first, job
lifecycle and log frames never).

Timeouts, side by side: the agent reconnects forever with exponential backoff and full
jitter (``--backoff-base`` 1 s, ``--backoff-cap`` 20 s, reset after 30 s of link); the
server's ``GPULAB_NODE_LOST_AFTER`` (60 s) decides when a silent node's jobs count as
lost. Keep lost-after > backoff cap + 2 heartbeats (``--heartbeat`` 5 s): then a portal
restart shorter than ~30 s never gets healthy nodes declared lost and their jobs
requeued. ``--kill-after-disconnect``, if used, should exceed lost-after too.
"""
