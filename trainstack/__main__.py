"""`python -m trainstack`: the same entry point as the `trainstack` console script."""

from trainstack.cli import main

raise SystemExit(main())
