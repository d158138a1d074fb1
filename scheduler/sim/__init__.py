"""The trace-driven simulator: replays a job trace through ``scheduler.policy.decide``
with a virtual clock. Pure Python: no Django (``python -m scheduler.sim``)."""
