"""What the server may refuse of schema-valid data: rules no schema can state.

Shared by the suite's in-process fuzz run (``test_schema_fuzz.py``) and the
live-stack run (``bench/schema_fuzz_stack.py``, through ``bench/fuzz_hooks.py``):
schema-valid data that breaks a rule depending on the database, the cluster or
another field is refused with a 400 naming that field and saying why; any other
400 for schema-valid data fails either run."""

from __future__ import annotations

import re
from typing import Any

# Field -> what the server may say of schema-valid data there.
BEYOND_SCHEMA: dict[str, re.Pattern[str]] = {
    name: re.compile(pattern)
    for name, pattern in {
        "gpus": r"The cluster has \d+ GPU|No GPU node has registered",
        "gpu_memory_mib": r"No GPU has that much memory",
        "gpu_model": r"No GPU matches",
        "group": r"not a member of group",
        "env": r"is not a valid environment variable name|is set by gpulab",
        "time_limit_s": r"class allows at most",
        "slowdown_cap": r"only applies to a job that may share|class already caps",
        # the dependency grammar and the jobs it names
        "after": r".",
        # the order, repeats and count of an array's indexes, its limit's range
        "array": r"ends before it starts|given twice|at most \d+ tasks|indexes go"
        r" up to|the step is at least|the limit after %|too many",
        # a range that ends before it starts (usage; the job list)
        "range": r"starts .* after it ends",
        "until": r"It is before since",
        # logs: follow (offset) or tail, not both
        "tail": r"Give offset \(follow\) or tail, not both",
        # usage: the longest range a request may span (GPULAB_USAGE_MAX_DAYS)
        "to": r"spans \d+ days; at most \d+ days",
        # the directories a job may run in (GPULAB_WORKDIR_ALLOWED)
        "workdir": r"is outside the directories jobs may run in",
        # checkpoint settings of a job that is not checkpointable
        "checkpoint_signal": r"only applies to a checkpointable job",
        "checkpoint_grace_s": r"only applies to a checkpointable job",
        # gpulab login: a machine name must be printable (str.isprintable)
        "client_name": r"Name the machine|printable characters",
        # each user's unfinished interactive jobs (GPULAB_INTERACTIVE_MAX_PER_USER)
        "interactive": r"interactive job\(s\) at a time per user",
    }.items()
}

# device/token/ answers the state of a device authorization as a 400 with one of
# these codes (RFC 8628 3.5): an unknown or unapproved code is not a bad request.
DEVICE_GRANT_ERRORS = frozenset(
    {"authorization_pending", "slow_down", "access_denied", "expired_token"}
    | {"invalid_grant"}
)


def beyond_schema(response: Any) -> bool:
    """A 400 whose every field and message is a rule the schema cannot state, or
    a device authorization's state."""
    if response.status_code != 400:
        return False
    body = response.json()
    if not isinstance(body, dict):
        return False
    if body.get("error") in DEVICE_GRANT_ERRORS:
        return True
    fields = body.get("fields") or {}
    return bool(fields) and all(
        (rule := BEYOND_SCHEMA.get(name.split(".")[0])) is not None
        and all(rule.search(m) for m in messages)
        for name, messages in fields.items()
    )
