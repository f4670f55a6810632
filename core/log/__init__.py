"""The event log (``kvledger.core.log``): the one part of the core that does file I/O.

    format.py   the byte layout (header, records, hash chain) and the scan: sans-I/O
    files.py    the file layer (real files; a simulated disk and a fault injector for tests)
    writer.py   EventLog: appends, group commit, fsync policies, checkpoints, close
    reader.py   open_view / LogView: verified read-only access to a log's records
    fold.py     the one loop that folds a log into a state (reopen, replay, audit)
"""

from .files import FaultInjector, OsFileLayer, SimulatedDisk
from .fold import check_first_event, fold_records, rebuild_state, start_state, state_from_checkpoint
from .format import Checkpoint, LogHeader, RecordInfo, Scan, scan
from .reader import LogView, open_view
from .writer import FSYNC_POLICIES, EventLog, LogStatistics

__all__ = [
    "FSYNC_POLICIES",
    "Checkpoint",
    "EventLog",
    "FaultInjector",
    "LogHeader",
    "LogStatistics",
    "LogView",
    "OsFileLayer",
    "RecordInfo",
    "Scan",
    "SimulatedDisk",
    "check_first_event",
    "fold_records",
    "open_view",
    "rebuild_state",
    "scan",
    "start_state",
    "state_from_checkpoint",
]
