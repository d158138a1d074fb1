"""Live dashboards: who sends what to the browsers' groups, and how often.

Three paths, each bounded whatever the cluster's size (docs/architecture.md,
"Live dashboards"):

1. **Node and job updates** (``NodeFeed``, one per agent connection, in the web
   process the agent is connected to): each metrics frame is offered to a
   per-node ``Throttle``: at most one update per second (``GPULAB_LIVE_INTERVAL``)
   of the node's samples, never two within half a second. It goes to
   ``node.<id>`` and to ``job.<id>`` of each job on the node's GPUs, each only while
   some browser watches that group: nobody watching costs no Channels traffic.
2. **The cluster** (``Hub.publish_once``): one aggregated message a second for the
   whole cluster, whatever its size and however many web processes run. Every web
   process with browsers connected runs the ticker; a Redis key set with ``NX PX``
   (``live:claim``) picks the one that builds the state this round (four queries,
   ``scheduler.livestate``), a second one (``live:gate``, ``PX`` = the interval,
   Redis's clock) lets a message out at most once per interval, and a compare-and-set
   on the stored state's ``seq`` keeps two rounds from both publishing. Readings
   come from the node feeds (a Redis hash each feed writes with its updates while
   the cluster is watched), structure and holders from PostgreSQL. The message
   is a delta from the previous state (stored in Redis, so the next round may run in
   another process); a browser that missed one asks for the whole state.
   The same round sends ``node.state`` to watched node groups whose status or
   holders changed, and ``queue.changed`` when services marked the queue changed.
3. **Job state and output**: services broadcast ``job.status`` on commit (and
   mark the queue changed; a batch of jobs, only to the watched pages:
   ``broadcast_job_statuses``); the agent consumer sends stored log chunks to a
   watched ``job.<id>``.

The modules: ``feed`` (``NodeFeed`` and its ``Throttle``: path 1 and the log
chunks), ``hub`` (``Hub``: the watch set and the cluster ticker of path 2, and
``mark_queue_changed``), ``deltas`` (the cluster message as a delta of two states,
built by ``scheduler.livestate``), ``timing`` (the interval, the clock and the
limits). Every public name is re-exported here.

Which groups are watched: each browser subscription adds its group to a Redis
sorted set (score = expiry, refreshed every ``WATCH_REFRESH_S``); each process reads
the set at most once per interval and keeps it in memory.

When Redis restarts (it keeps no data on disk), the browsers' group memberships,
the watch set and the stored cluster state are gone while their websockets stay
open. The hub's ticker has its members (the browser consumers of this process)
join their groups again every ``REJOIN_S``, and notices the loss itself at once:
an epoch key it sets (``NX``) and reads back each round is gone or another one.
Then it marks its groups watched again and has its members rejoin and say
``subscribed`` again, so the pages re-sync as after a reconnect; the next round
finds no stored state and sends the whole state (``base`` 0).
"""

from scheduler.live.deltas import changed_nodes, diff, is_empty
from scheduler.live.feed import NodeFeed, Throttle, node_holders, readings_json
from scheduler.live.hub import (
    Hub,
    Member,
    broadcast_job_statuses,
    build_round,
    mark_queue_changed,
)
from scheduler.live.timing import (
    CLAIM_MS,
    HOLDERS_MAX_AGE_S,
    LIVE_MAX_AGE_S,
    READINGS_TTL_S,
    REJOIN_S,
    WATCH_REFRESH_S,
    WATCH_TTL_S,
    interval,
    monotonic,
)

__all__ = [
    "CLAIM_MS",
    "HOLDERS_MAX_AGE_S",
    "LIVE_MAX_AGE_S",
    "READINGS_TTL_S",
    "REJOIN_S",
    "WATCH_REFRESH_S",
    "WATCH_TTL_S",
    "Hub",
    "Member",
    "NodeFeed",
    "Throttle",
    "broadcast_job_statuses",
    "build_round",
    "changed_nodes",
    "diff",
    "interval",
    "is_empty",
    "mark_queue_changed",
    "monotonic",
    "node_holders",
    "readings_json",
]
