"""R7, heavy profile: coverage-guided fuzzing of the wire's frame decoder with atheris.

    python tests/fuzz/fuzz_wire.py [libFuzzer flags, e.g. -runs=1000000 -seed=7 CORPUS_DIR]

The oracle (``one_input``) is the one the quick profile's mutation loop applies
(tests/wire/test_wire_codec.py): bytes fed to ``FrameDecoder`` in chunks may raise only
``FrameError`` (with an int code and a detail); the decoder never buffers more than
the header, the body cap and one chunk; every frame it yields re-encodes to exactly
the bytes it came from. Anything else is a crash, which libFuzzer reports and saves.

The first input byte steers the harness rather than the decoder: its low bit asks
for the first frame's CRC to be recomputed (so the fuzzer explores what lies behind
the checksum check), its other bits pick the chunk size. ``seed_corpus`` writes the
golden frames of every kind as the starting corpus. tests/fuzz/test_fuzz_harnesses.py
runs ``one_input`` on that corpus in the quick profile, so the harness cannot rot.
"""

from __future__ import annotations

import pathlib
import sys
import zlib

MAX_BODY = 4096


def _fix_crc(frame: bytes) -> bytes:
    if len(frame) < 24:
        return frame
    crc = zlib.crc32(frame[24:], zlib.crc32(frame[:20]))
    return frame[:20] + crc.to_bytes(4, "little") + frame[24:]


def one_input(data: bytes) -> None:
    """One execution: decode ``data[1:]`` and check the decoder's promises (AssertionError if broken)."""
    from kvledger.core.errors import FrameError
    from kvledger.wire.codec import HEADER_SIZE, encode
    from kvledger.wire.decoder import FrameDecoder

    if not data:
        return
    steer, body = data[0], bytes(data[1:])
    if steer & 1:
        body = _fix_crc(body)
    chunk = 1 + (steer >> 1) % 97
    decoder = FrameDecoder(max_body=MAX_BODY)
    offset = 0

    def took(frame) -> None:
        nonlocal offset
        size = HEADER_SIZE + int.from_bytes(body[offset + 8: offset + 12], "little")
        assert encode(frame) == body[offset: offset + size], "a decoded frame does not re-encode to its bytes"
        offset += size

    try:
        for start in range(0, len(body), chunk):
            decoder.feed(body[start: start + chunk])
            while (frame := decoder.next_frame()) is not None:
                took(frame)
            assert decoder.buffered <= HEADER_SIZE + MAX_BODY + chunk, "the decoder buffered past its cap"
        decoder.feed_eof()
        while (frame := decoder.next_frame()) is not None:
            took(frame)
    except FrameError as exc:
        assert isinstance(exc.code, int) and exc.detail, "a FrameError without a code or a detail"


def seed_corpus() -> list[bytes]:
    """A frame of every kind (both steering bits), as the fuzzer's starting corpus."""
    from kvledger.core.events import Geometry
    from kvledger.wire.codec import (
        Abort, Complete, Hello, Launch, Ready, Reject, RejectCode, Sanitize, encode, encode_prepare,
        geometry_digest)

    digest = geometry_digest(Geometry(num_pages=1024, page_tokens=16))
    frames = [
        encode(Hello(step=0, rank=1, world_size=2, geometry_digest=digest)),
        encode_prepare(3, [5, 9, 1023], b"payload"),
        encode_prepare(4, [1, 2], b"", sanitize=Sanitize(poison_pages=[7], committed_pages=[1])),
        encode(Ready(step=3, rank=1, prepare_checksum=0xDEADBEEF)),
        encode(Reject(step=3, rank=1, code=RejectCode.PAGE_OUT_OF_RANGE, detail="page 4096")),
        encode(Abort(step=3, code=RejectCode.TIMEOUT, rank=1)),
        encode(Launch(step=3, prepare_checksum=0xDEADBEEF)),
        encode(Complete(step=3, rank=1, prepare_checksum=0xDEADBEEF, ok=False, detail="RuntimeError")),
    ]
    return [bytes([steer]) + f for f in frames for steer in (0, 1 + 2 * 23)]


def main(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["kvledger.wire", "kvledger.core.checks"]):
        import kvledger.wire.codec  # noqa: F401
        import kvledger.wire.decoder  # noqa: F401
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
