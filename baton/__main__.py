"""`python -m baton ...` is `baton ...`."""

import sys

from baton.cli import main

sys.exit(main())
