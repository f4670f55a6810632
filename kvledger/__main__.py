"""``python -m kvledger``: the ``kvledger`` console script without the script."""

import sys

from kvledger.tools.cli import main

sys.exit(main())
