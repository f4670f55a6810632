"""Events, geometry and plan types (``kvledger.core.events``): the values every layer shares."""

from .events import *  # noqa: F403
from .events import __all__ as _events_all

__all__ = list(_events_all)
