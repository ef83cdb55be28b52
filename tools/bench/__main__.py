"""`python -m hsx_tools.bench` (the children of modes (a) and (b) run `--worker CONFIG`)."""

import sys

from hsx import lifeline
from hsx_tools.bench.cli import main

lifeline.hold()  # a worker dies with the hsx bench that started it (hsx/lifeline.py)

sys.exit(main(sys.argv[1:]))
