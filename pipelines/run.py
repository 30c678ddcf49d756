"""`python -m pipelines.run`: the grid runner's entry point (`make repro`); the runner is the package
pipelines.runner, whose docstring (``python -m pipelines.run --help``) tells what it does."""

from __future__ import annotations

import sys

from pipelines.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
