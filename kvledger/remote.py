"""Moved to ``kvledger.engine.remote`` (``RemoteRanks``, ``serve_remote_rank`` are also in
``kvledger.engine``); this name stays for old imports (remove once none is left)."""

from kvledger.engine.remote import RemoteRanks, serve_remote_rank

__all__ = ["RemoteRanks", "serve_remote_rank"]
