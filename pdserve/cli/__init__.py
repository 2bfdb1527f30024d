"""The old path of the `pdserve` CLI, kept so that `from pdserve.cli import main` and
`python -m pdserve.cli` go on working.

The CLI is the composition root (it builds the router and the workers) and lives in
`launcher.cli`, above both; this alias belongs to that layer, and nothing imports it.
(A package rather than a module, so that git sees launcher/cli.py as the file that moved.)
"""

from launcher.cli import *  # noqa: F403
from launcher.cli import main

__all__ = ["main"]
