"""Events, geometry and plan types (``kvledger.core.events``); the durable log lives here too."""

from .events import *  # noqa: F401,F403
from .events import __all__ as _events_all

__all__ = list(_events_all)
