"""The heavy profile's atheris harnesses (tests/fuzz/) run here on their seed corpus.

The harnesses (fuzz_wire.py: the frame decoder; fuzz_log.py: the log reader) only run for real
on the heavy host (``scripts/heavy``), where atheris guides them by coverage for millions of
executions. These quick tests keep them from rotting: every seed input (and its truncations)
passes the harness's oracle, and a broken oracle fails.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

FUZZ = pathlib.Path(__file__).parent


def _harness(name: str):
    spec = importlib.util.spec_from_file_location(name, FUZZ / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wire_harness_accepts_its_seed_corpus_and_every_truncation():
    harness = _harness("fuzz_wire")
    corpus = harness.seed_corpus()
    assert len(corpus) == 16
    for data in corpus:
        for end in range(0, len(data) + 1, 7):
            harness.one_input(data[:end])


def test_the_wire_harness_oracle_fails_when_a_frame_does_not_round_trip(monkeypatch):
    harness = _harness("fuzz_wire")
    prepare = harness.seed_corpus()[2]
    import kvledger.wire.codec as codec

    monkeypatch.setattr(codec, "encode", lambda frame: b"not the frame")
    with pytest.raises(AssertionError, match="re-encode"):
        harness.one_input(prepare)


def test_the_log_harness_accepts_its_seed_corpus_and_every_truncation():
    harness = _harness("fuzz_log")
    corpus = harness.seed_corpus()
    assert len(corpus) == 8 and all(harness.reseal(data[1:]) == data[1:] for data in corpus[:6:2])
    for data in corpus:
        for end in range(0, len(data) + 1, 97):
            harness.one_input(data[:end])


def test_the_log_harness_reseals_what_it_is_asked_to():
    from kvledger.core.log.scan import scan

    harness = _harness("fuzz_log")
    log = bytearray(harness.seed_corpus()[0][1:])
    rec = scan(bytes(log)).records[1]
    log[rec.offset + 28 + 5 + 2] ^= 0x40  # inside the second record's first event (past its array header)
    assert scan(bytes(log)).error is not None  # as written: its CRC fails, and a closed log says so
    assert scan(harness.reseal(bytes(log))).error is None  # resealed: checksums and chain hold again


def test_the_log_harness_oracle_fails_when_the_folds_disagree_or_a_foreign_error_escapes(monkeypatch):
    harness = _harness("fuzz_log")
    valid = harness.seed_corpus()[0]
    import kvledger.core.log.fold as fold

    real = fold.rebuild_state
    monkeypatch.setattr(fold, "rebuild_state", lambda view, **kw: (None, None, 0) if kw.get("trusted") else
                        real(view, **kw))
    with pytest.raises(AssertionError, match="disagree"):
        harness.one_input(valid)

    def broken(view, **kw):
        raise ValueError("not a library error")

    monkeypatch.setattr(fold, "rebuild_state", broken)
    with pytest.raises(ValueError):
        harness.one_input(valid)


def test_the_wire_auth_harness_accepts_its_seed_corpus_and_every_truncation():
    harness = _harness("fuzz_wire_auth")
    corpus = harness.seed_corpus()
    assert len(corpus) == 14
    for data in corpus:
        for end in range(0, len(data) + 1, 5):
            harness.one_input(data[:end])


def test_the_wire_auth_harness_oracle_fails_when_a_link_takes_a_bad_proof(monkeypatch):
    harness = _harness("fuzz_wire_auth")
    import kvledger.wire.leader as leader

    monkeypatch.setattr(leader, "proofs_match", lambda expected, got: True)  # the leader takes any AUTH
    with pytest.raises(AssertionError, match="never proved the key"):
        harness.one_input(harness.seed_corpus()[2])  # the recorded AUTH with a flipped byte
