"""Fixtures of the KV-event tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def ctx():
    """A ZMQ context of the test's own, terminated afterwards (the KV-event tests' sockets)."""
    zmq = pytest.importorskip("zmq")
    c = zmq.Context()
    yield c
    c.term()
