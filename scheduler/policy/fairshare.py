"""Fair share, 2^(-U/S) as in Slurm's classic multifactor plugin.

- Group: U = the group's decayed usage / the cluster's total decayed usage, S = the
  group's shares / all groups' shares; both in [0, 1].
- User within its group: U = the user's decayed usage / the group's (sum of its
  users'), S = the user's shares / the group's members' shares.
- Combined (our choice, documented): ``F = F_group * (1 - w * (1 - F_user) / 2)``,
  ``w`` the user part's weight (``PolicyConfig.fairshare_user``, 0..1). At ``w`` 1
  that is ``F_group * (1 + F_user) / 2``: a user can move their job only within
  [F_group / 2, F_group], so a light user in a heavy group never jumps a whole
  heavy/light group gap by being light, yet heavy users in a group queue behind
  their light colleagues. At ``w`` 0 only groups compete (``F = F_group``), and
  within a group the order is age, size and run time alone. The group factor is
  primary either way (as in Slurm's fair tree, groups compete first).
- Quotas: a job over a soft quota gets ``F * quota_soft_factor``
  (``scale``, from ``policy.quota.Quotas.fairshare_scale``).
- No usage: factor 1. Shares missing from the map default to 1 (an equal share);
  zero shares: factor 1 with no usage, 0 with any usage (2^-inf).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler.policy.state import Usage

DEFAULT_SHARES = 1.0


def factor(u: float, s: float) -> float:
    """2^(-U/S) with the guards above."""
    if u <= 0.0:
        return 1.0
    if s <= 0.0:
        return 0.0
    return float(2.0 ** (-u / s))


class FairShare:
    """Per-pass cache of the factors (one per group, one per user)."""

    def __init__(
        self,
        usage: Usage,
        groups: set[str],
        users: set[tuple[str, str]],
        scale: Callable[[str, str], float] | None = None,
        user_weight: float = 1.0,
    ):
        self.usage = usage
        self.scale = scale
        self.user_weight = 0.0 if user_weight < 0 else min(1.0, user_weight)
        # Sums with math.fsum (exactly rounded): a plain sum over a set of strings
        # depends on the set's order, i.e. on the process's hash seed, and its
        # last-bit differences could flip a tie between two runs of one trace.
        all_groups = set(usage.group_usage) | set(usage.group_shares) | groups
        self.total_usage = math.fsum(max(0.0, u) for u in usage.group_usage.values())
        self.total_shares = math.fsum(
            max(0.0, usage.group_shares.get(g, DEFAULT_SHARES)) for g in all_groups
        )
        members = set(usage.user_usage) | set(usage.user_shares) | users
        used: dict[str, list[float]] = {}
        shares: dict[str, list[float]] = {}
        for g, u in members:
            used.setdefault(g, []).append(max(0.0, usage.user_usage.get((g, u), 0.0)))
            shares.setdefault(g, []).append(
                max(0.0, usage.user_shares.get((g, u), DEFAULT_SHARES))
            )
        self.group_user_usage = {g: math.fsum(v) for g, v in used.items()}
        self.group_user_shares = {g: math.fsum(v) for g, v in shares.items()}
        self._group: dict[str, float] = {}
        self._user: dict[tuple[str, str], float] = {}

    def group_norm(self, group: str) -> tuple[float, float]:
        """(U, S) of a group, each in [0, 1]."""
        used = max(0.0, self.usage.group_usage.get(group, 0.0))
        u = used / self.total_usage if self.total_usage > 0 else 0.0
        shares = max(0.0, self.usage.group_shares.get(group, DEFAULT_SHARES))
        s = shares / self.total_shares if self.total_shares > 0 else 0.0
        return u, s

    def over_share(self, group: str) -> bool:
        u, s = self.group_norm(group)
        return u > s

    def group_factor(self, group: str) -> float:
        got = self._group.get(group)
        if got is None:
            got = self._group[group] = factor(*self.group_norm(group))
        return got

    def user_factor(self, group: str, user: str) -> float:
        key = (group, user)
        got = self._user.get(key)
        if got is None:
            total = self.group_user_usage.get(group, 0.0)
            used = max(0.0, self.usage.user_usage.get(key, 0.0))
            u = used / total if total > 0 else 0.0
            all_shares = self.group_user_shares.get(group, 0.0)
            shares = max(0.0, self.usage.user_shares.get(key, DEFAULT_SHARES))
            s = shares / all_shares if all_shares > 0 else 0.0
            got = self._user[key] = factor(u, s)
        return got

    def of(self, group: str, user: str) -> float:
        f = self.group_factor(group)
        w = self.user_weight
        if w > 0.0:
            f *= 1.0 - w * (1.0 - self.user_factor(group, user)) / 2.0
        return f if self.scale is None else f * self.scale(group, user)
