"""Settings of ``gpulab login`` through the browser (the OAuth 2.0 device
authorization grant, RFC 8628; ``portal/api/device.py``)."""

from __future__ import annotations

from portal.settings_env import envint

# Seconds a device code and its user code stay valid (RFC 8628 expires_in).
GPULAB_DEVICE_CODE_TTL = envint("GPULAB_DEVICE_CODE_TTL", 600, minimum=60, maximum=3600)
# Seconds the CLI waits between polls at first (RFC 8628 interval); each poll
# made sooner is answered slow_down and adds 5 s to it.
GPULAB_DEVICE_POLL_INTERVAL = envint(
    "GPULAB_DEVICE_POLL_INTERVAL", 5, minimum=1, maximum=60
)
# Device codes one client address may ask for per window (seconds), Redis-backed
# like the API's rate limit: over it, 429 with Retry-After.
GPULAB_DEVICE_CODE_RATE = envint("GPULAB_DEVICE_CODE_RATE", 10, minimum=1)
GPULAB_DEVICE_CODE_WINDOW = envint("GPULAB_DEVICE_CODE_WINDOW", 600, minimum=1)
# User codes one signed-in user may look up on the approval page per window
# (seconds): a brute-force limit (a code is 8 letters of 20: 20^8 values).
GPULAB_DEVICE_VERIFY_RATE = envint("GPULAB_DEVICE_VERIFY_RATE", 20, minimum=1)
GPULAB_DEVICE_VERIFY_WINDOW = envint("GPULAB_DEVICE_VERIFY_WINDOW", 600, minimum=1)
