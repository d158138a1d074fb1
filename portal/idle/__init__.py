"""Idle-GPU detection: running jobs whose GPUs do nothing are flagged, their owners
told, and (per class) cancelled after a grace period. docs/architecture.md, "Idle
GPUs"."""
