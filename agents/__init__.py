"""gpulab node agent: a standalone package (never imports Django).

Run it with ``python -m agents --server ws://HOST:PORT --token-file FILE`` (or the
``gpulab-agent`` script); ``--simulate 4xA100-80GB`` runs a simulated node on a machine
without GPUs. The server and the agent share only ``agents/protocol.py``.

Accounts: a job runs as its ``run_as`` account, which needs the agent to run as root.
An agent running as root refuses jobs without ``run_as`` unless started with
``--allow-root-jobs``. The demo runs the agent as the current user, so jobs without
``run_as`` simply run as that user.

Timeouts, side by side: the agent reconnects forever with exponential backoff and full
jitter (``--backoff-base`` 1 s, ``--backoff-cap`` 60 s, reset after 30 s of link); the
server's ``node_lost_after`` decides when a silent node's jobs count as lost, so it
should exceed the backoff cap plus a few heartbeats (``--heartbeat`` 5 s).
"""
