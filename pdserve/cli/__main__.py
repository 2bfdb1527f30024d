"""`python -m pdserve.cli`: the same as `python -m launcher.cli`."""

import sys

from launcher.cli import main

sys.exit(main())
