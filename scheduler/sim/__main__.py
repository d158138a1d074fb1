"""``python -m scheduler.sim``: see ``scheduler.sim.cli``."""

from __future__ import annotations

import sys

from scheduler.sim.cli import main

sys.exit(main())
