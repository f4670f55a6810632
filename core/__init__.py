"""The core (``kvledger.core``): errors, checks, events, the fold, the command side, the log.

    errors.py   every KVLedgerError subclass
    checks.py   the one check of ids, page lists and geometry
    events/     events, geometry and plan types
    state/      the page table and the fold (pure: no I/O, no logging, no clock)
    ledger.py   the command side: decide -> the journal (a sink, the log) -> the fold's appliers
    journal.py  where a ledger's events go: its mode, one object chosen when it is made
    log/        the durable event log: the only part of the core that does file I/O
"""
