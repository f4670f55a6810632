"""Where kvledger's log lines go: the standard ``logging`` module, under the ``kvledger`` logger.

    get_logger("kvledger.engine").warning("step_aborted", step=3, reason="cancelled")
        ─► logging.getLogger("kvledger.engine").isEnabledFor(WARNING)?  no ─► nothing is built
        ─► a LogRecord whose msg is the event dict ─► the handlers the application configured

The library never configures logging. An application that configures nothing
sees nothing below WARNING: debug and info lines (``log_created``,
``step_sealed``, ...) are dropped before they are built, and warnings reach
stderr through Python's last-resort handler. An application configures the
``kvledger`` logger (or the root logger) as it does for any library:

* plain ``logging`` (``logging.basicConfig(level=logging.INFO)``): the message
  reads ``step_aborted step=3 reason='cancelled'``;
* structlog's ``ProcessorFormatter`` on a handler: it receives the event dict
  itself (the record is shaped as ``ProcessorFormatter.wrap_for_formatter``
  shapes it), so JSON or console rendering keeps every field. ``kvledger``'s
  CLI does this (``kvledger.tools.cli.configure_logging``).

``core/`` never logs; the runtime (engine, durable ledger, remote ranks) and
the tools call ``get_logger``. Code that takes a ``logger=`` argument accepts
any structlog bound logger instead (tests pass quiet or capturing ones): what
it calls on one is ``Logger``, a protocol.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import structlog

__all__ = ["Logger", "get_logger"]


class _EventDict(dict):
    """An event dict that prints as ``event key=value ...`` for plain ``logging`` formatters.

    ``ProcessorFormatter`` copies it (``dict.copy``: a plain dict) and never sees the difference.
    """

    def __str__(self) -> str:
        fields = " ".join(f"{k}={v!r}" for k, v in self.items() if k != "event")
        event = str(self.get("event", ""))
        return f"{event} {fields}" if fields else event


# Frames between the caller and ``logging.Logger.<level>``: BoundLogger.<level>, its _proxy_to_logger,
# BoundLoggerBase._proxy_to_logger. The record then names the caller's file and line, not structlog's.
_STACKLEVEL = 4


def _to_record(logger: logging.Logger, method_name: str, event_dict: dict) -> tuple:
    """The last processor: the arguments of the stdlib call, as ``wrap_for_formatter`` makes them."""
    return (_EventDict(event_dict),), {"extra": {"_logger": logger, "_name": method_name},
                                       "stacklevel": _STACKLEVEL}


_PROCESSORS: list[Any] = [structlog.stdlib.filter_by_level, _to_record]


class Logger(Protocol):
    """What kvledger calls on a ``logger=`` it is given (a structlog bound logger is one):
    an event name and its fields, at one of four levels."""

    def debug(self, event: str, **fields: object) -> object: ...

    def info(self, event: str, **fields: object) -> object: ...

    def warning(self, event: str, **fields: object) -> object: ...

    def error(self, event: str, **fields: object) -> object: ...


def get_logger(name: str = "kvledger") -> structlog.stdlib.BoundLogger:
    """A structlog bound logger writing to ``logging.getLogger(name)`` (a name under ``kvledger``).

    Independent of structlog's global configuration: ``structlog.configure`` in
    the application changes nothing here; the stdlib logger's level and handlers
    decide. ``bind`` works as usual.
    """
    return structlog.stdlib.BoundLogger(logging.getLogger(name), _PROCESSORS, {})
