from __future__ import annotations

import sys

from agents.main import main

sys.exit(main())
