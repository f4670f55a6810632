"""The event log (``kvledger.core.log``): the one part of the core that does file I/O.

    format.py   the byte layout (header, records, hash chain, sync stamps): sans-I/O
    scan.py     the scan: verify records, tell a torn tail from corruption: sans-I/O
    segments.py a log as a directory of segments: rotation, retention, linking
    files.py    the real file layer (atomic create, locks, no links, replace-not-truncate, stamps)
    writer.py   EventLog: appends, group commit, fsync policies, checkpoints, close
    syncer.py   the background writer thread (group commit, back-pressure)
    opening.py  creating and reopening a log (verify, repair a torn tail, stamp)
    reader.py   open_view / LogView: verified read-only access to a log's records
    fold.py     the one loop that folds a log into a state (reopen, replay, audit)
"""

from .files import OsFileLayer
from .fold import check_first_event, fold_records, rebuild_state, start_state, state_from_checkpoint
from .format import DEFAULT_MAX_PAGES, Checkpoint, LogHeader, RecordInfo, SyncStamp
from .reader import LogView, open_view
from .scan import Scan, scan
from .writer import DEFAULT_MAX_LAG_BYTES, FSYNC_POLICIES, EventLog, LogStatistics

__all__ = [
    "DEFAULT_MAX_LAG_BYTES",
    "DEFAULT_MAX_PAGES",
    "FSYNC_POLICIES",
    "Checkpoint",
    "EventLog",
    "LogHeader",
    "LogStatistics",
    "LogView",
    "OsFileLayer",
    "RecordInfo",
    "Scan",
    "SyncStamp",
    "check_first_event",
    "fold_records",
    "open_view",
    "rebuild_state",
    "scan",
    "start_state",
    "state_from_checkpoint",
]
