"""The event log (``kvledger.core.log``): the one part of the core that does file I/O.

The read side (sans-I/O where it can be):

    format.py     the byte layout (header, records, hash chain, sync stamps)
    scan.py       verify records, tell a torn tail from corruption
    segments.py   a directory of segments: naming, listing, scanning, linking, a lost tail
    reader.py     open_view / LogView: verified read-only access to a log's records
    fold.py       the one loop that folds a log into a state (reopen, replay, audit)
    files.py      the real file layer (atomic create, locks, no links, replace-not-truncate, stamps)

The write side, one object per seam:

    writer.py     EventLog: the appender's face (append, checkpoint, rotate, sync, close)
    batch.py      Batch: the open batch of event objects and the records queued behind it
    durability.py Inline / Background: one hand_off interface; durable_seq, failure, the writer thread
    live.py       LiveSegment: the file appends go to (seal, write, sync, stamp, successor)
    directory.py  LogDirectory: a directory's lock, roll to the next segment, retention
    opening.py    creating and reopening (verify, repair a torn tail, stamp): what EventLog continues from
    policy.py     the fsync policies, the batch bound, LogStatistics
"""

from .files import OsFileLayer
from .fold import check_first_event, fold_records, rebuild_state, start_state, state_from_checkpoint
from .format import DEFAULT_MAX_PAGES, Checkpoint, LogHeader, RecordInfo, SyncStamp
from .policy import DEFAULT_MAX_LAG_BYTES, FSYNC_POLICIES, LogStatistics
from .reader import LogView, open_view
from .scan import Scan, scan
from .segments import list_segments, segment_name
from .writer import EventLog

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
    "list_segments",
    "open_view",
    "rebuild_state",
    "scan",
    "segment_name",
    "start_state",
    "state_from_checkpoint",
]
