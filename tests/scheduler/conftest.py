"""The service tests' side effects are read back from the real Redis: agent frames
with the ``sent`` fixture, browser messages with ``channels``, queued passes with
``passes`` (tests/conftest.py, tests/capture.py)."""
