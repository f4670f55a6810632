"""``python -m kvledger.demo``: the demo without the ``kvledger`` CLI."""

import sys

from .cli import main

sys.exit(main(prog="python -m kvledger.demo"))
