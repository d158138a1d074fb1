"""Settings of interactive jobs (JupyterLab and terminals, docs/interactive.md).

- ``GPULAB_INTERACTIVE_MAX_PER_USER``: how many unfinished (waiting or running)
  interactive jobs one user may have; a submission over it is refused, naming
  the job the user already has.
- ``GPULAB_INTERACTIVE_PROXY_MAX``: how many requests and websockets the
  portal's proxy carries at once for one interactive job; beyond it the proxy
  answers 503, so one JupyterLab cannot take the web process from the others.
- ``GPULAB_INTERACTIVE_CONNECT_TIMEOUT``: seconds the proxy waits to connect to
  a job's server on its node before it answers that the server is not reachable.
"""

from __future__ import annotations

from portal.settings_env import envfloat, envint

GPULAB_INTERACTIVE_MAX_PER_USER = envint(
    "GPULAB_INTERACTIVE_MAX_PER_USER", 1, minimum=0
)
GPULAB_INTERACTIVE_PROXY_MAX = envint("GPULAB_INTERACTIVE_PROXY_MAX", 32, minimum=1)
GPULAB_INTERACTIVE_CONNECT_TIMEOUT = envfloat(
    "GPULAB_INTERACTIVE_CONNECT_TIMEOUT", 5.0, minimum=0.1
)
