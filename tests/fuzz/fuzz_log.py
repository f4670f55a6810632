"""R7, heavy profile: coverage-guided fuzzing of the event log's reader with atheris.

    python tests/fuzz/fuzz_log.py [libFuzzer flags, e.g. -runs=1000000 -seed=7 CORPUS_DIR]

The oracle (``one_input``) extends the quick profile's (tests/log/test_log_fuzz.py, ``_consume``):
the bytes, read as a log file, go through everything a reader does with an untrusted log:
``scan``, every record decoded (``LogView.events`` / ``LogView.checkpoint``), and the fold
(``rebuild_state``) from the last checkpoint and from the start, trusted and checked. Only
the library's own ``KVLedgerError`` may escape any of them. And the two folds from the start
must agree: when the checked fold (every event validated) accepts the log, the trusted fold
(bounds-checked, invariants at the end) accepts it too, with the same state digest, or refuses
it at a checkpoint record (it alone decodes checkpoints and compares their digests).
Anything else is a crash, which libFuzzer reports and saves.

The first input byte steers the harness rather than the reader: its low bit asks for the
file to be resealed (the header's CRC, then every record's chain and CRC recomputed along
the record lengths, as whoever writes a file can), so the fuzzer explores what lies behind
the checksums: payload decoding, checkpoints and the fold. ``seed_corpus`` writes small
valid logs (three clear policies, with checkpoints, closed and torn) as the starting corpus.
tests/fuzz/test_fuzz_harnesses.py runs ``one_input`` on that corpus in the quick profile, so the
harness cannot rot. ``scripts/heavy`` runs it for 10^7 executions over many processes.
"""

from __future__ import annotations

from kvledger.options import LogOptions
import contextlib
import hashlib
import os
import pathlib
import struct
import sys
import zlib

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # run as a script: the tests directory on the path, as pytest puts it
    sys.path.insert(0, _TESTS)

_HEADER, _PREFIX, _TRAILER = 64, 28, 12


def reseal(log: bytes) -> bytes:
    """``log`` with the header CRC and every record's chain and CRC made right for its bytes, records
    found by their length fields (a length past the end leaves the rest as it is)."""
    if len(log) < _HEADER:
        return log
    out = bytearray(log[:60]) + struct.pack("<I", zlib.crc32(log[:60]))
    log_id = bytes(out[12:28])
    off = _HEADER
    while off + _PREFIX + _TRAILER <= len(log):
        n = int.from_bytes(log[off + 4: off + 8], "little")
        end = off + _PREFIX + n + _TRAILER
        if end > len(log):
            break
        body = log[off: end - _TRAILER]
        chain = hashlib.blake2b(bytes(out) + body, digest_size=8, key=log_id, person=b"kvledger-log-v1").digest()
        out += body + chain + struct.pack("<I", zlib.crc32(body + chain))
        off = end
    return bytes(out + log[off:])


def one_input(data: bytes) -> None:
    """One execution: read ``data[1:]`` as a log and check the reader's promises (AssertionError if broken)."""
    from kvledger.core.errors import KVLedgerError
    from kvledger.core.log import LogView
    from kvledger.core.log.fold import rebuild_state
    from kvledger.core.log.format import KIND_CHECKPOINT, KIND_EVENTS
    from kvledger.core.log.scan import scan

    if not data:
        return
    steer, body = data[0], bytes(data[1:])
    if steer & 1:
        body = reseal(body)
    try:
        res = scan(body, "fuzz")
    except KVLedgerError:
        return
    view = LogView(body, res, "fuzz")
    for rec in res.records:
        with contextlib.suppress(KVLedgerError):
            if rec.kind == KIND_EVENTS:
                view.events(rec)
            elif rec.kind == KIND_CHECKPOINT:
                view.checkpoint(rec)
    if any(r.kind == KIND_CHECKPOINT for r in res.records):  # (without one it is the trusted fold below)
        with contextlib.suppress(KVLedgerError):
            rebuild_state(view, from_checkpoint=True)
    try:
        checked = rebuild_state(view, from_checkpoint=False, trusted=False)[0]
    except KVLedgerError:
        checked = None
    try:
        trusted = rebuild_state(view, from_checkpoint=False, trusted=True)[0]
    except KVLedgerError as exc:
        # (the trusted fold also decodes checkpoints and compares their digests: a refusal there is its own)
        at_checkpoint = getattr(exc, "offset", None) in {r.offset for r in res.records if r.kind == KIND_CHECKPOINT}
        assert checked is None or at_checkpoint, f"the trusted fold refused a log the checked fold accepts: {exc}"
        return
    if checked is not None:
        assert trusted is not None and trusted.digest() == checked.digest(), "trusted and checked folds disagree"


def seed_corpus() -> list[bytes]:
    """Small valid logs (a steering byte each, both values): three policies, checkpoints, closed or not,
    and one cut in its last record (a torn tail)."""
    from kvledger import CLEAR_POLICIES, Geometry
    from kvledger.durable import open_ledger
    from support import QUIET
    from support.simdisk import SimulatedDisk
    from support.workload import drive

    logs = []
    for i, policy in enumerate(CLEAR_POLICIES):
        disk = SimulatedDisk()
        led = open_ledger("f", Geometry(num_pages=24, page_tokens=16), policy=policy, logger=QUIET,
                          log_options=LogOptions(layer=disk, checkpoint_every=8))
        drive(led, f"fuzz-log-{i}", 1 + i % 2, ranks=1 + i % 2)
        if i == 1:
            led.sync()
            led.log.abandon()  # synced, not closed
        else:
            led.close()
        logs.append(disk.read("f"))
    logs.append(logs[0][: len(logs[0]) - 7])  # a torn tail
    return [bytes([steer]) + log for log in logs for steer in (0, 1)]


def main(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["kvledger.core"]):
        import kvledger.core.log  # noqa: F401
        import kvledger.core.log.fold  # noqa: F401
        import kvledger.core.log.scan  # noqa: F401
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    for folder in corpus[:1]:
        path = pathlib.Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        if not any(path.iterdir()):
            for i, data in enumerate(seed_corpus()):
                (path / f"seed-{i:03d}").write_bytes(data)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
