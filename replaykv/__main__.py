"""`python -m replaykv` runs the command line."""

from replaykv.cli import main

if __name__ == "__main__":  # spawned worker processes import this module without running it
    raise SystemExit(main())
