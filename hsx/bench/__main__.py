"""`python -m hsx.bench` (the children of modes (a) and (b) run `--worker CONFIG`)."""

import sys

from hsx.bench.cli import main

sys.exit(main(sys.argv[1:]))
