"""`python -m replaykv` runs the command line."""

from replaykv.cli import main

raise SystemExit(main())
