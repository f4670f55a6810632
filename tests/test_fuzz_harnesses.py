"""The heavy profile's atheris harnesses (tests/fuzz/) run here on their seed corpus.

The harnesses only run for real on the heavy host (``scripts/heavy``), where atheris
guides them by coverage for millions of executions. This quick test keeps them from
rotting: every seed input passes the harness's oracle, and a broken oracle fails.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

FUZZ = pathlib.Path(__file__).parent / "fuzz"


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
