"""`python -m bench.scheduling` (and its moto server child, `python -m bench.scheduling --serve`)."""

from __future__ import annotations

import sys

from bench.scheduling.report import main

if __name__ == "__main__":
    sys.exit(main())
