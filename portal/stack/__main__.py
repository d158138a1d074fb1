"""``python -m portal.stack`` is ``python -m portal.stack.up``."""

from __future__ import annotations

from portal.stack.up import main

main()
