"""Quotas: GPU-hours per period and concurrent-GPU caps per group and per
user, their alerts, and the admin console's audit log. The pass enforces them
through ``scheduler.policy.quota``; see docs/architecture.md, "Quotas"."""
