"""Moved to ``kvledger.tools.replay``; this name stays for old imports (remove once none is left)."""

from kvledger.tools.replay import *  # noqa: F403
from kvledger.tools.replay import __all__  # noqa: F401
