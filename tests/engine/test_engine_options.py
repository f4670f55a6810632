"""The openers' option groups (kvledger/options.py, kvledger/engine/options.py).

Pins: ``open_engine`` and ``open_ledger`` take their options in frozen groups (``LogOptions``,
``StepOptions``, ``ExtraOptions``) that check their fields when made; the flat keywords of
earlier releases still work, each call warning once (``DeprecationWarning`` naming the group
to use, attributed to the caller's line) and doing what the group does; a flat keyword beside
its group is refused, an unknown one is a ``TypeError`` as Python's own, and ``log_options`` as
a mapping is deprecated the same way.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from kvledger import ConfigurationError, Geometry, InvalidArgumentError
from kvledger.durable import open_ledger
from kvledger.engine import ExtraOptions, LogOptions, RemoteOptions, StepOptions, open_engine

G = Geometry(num_pages=16, page_tokens=4)


def _deprecations(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.asyncio
async def test_flat_engine_keywords_still_work_with_one_warning_at_the_callers_line(tmp_path):
    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opening = open_engine(G, log=tmp_path / "f.kvlog", fsync="per_step", depth=2, yield_every_s=0,
                              observers=[lambda seq, event, effects: seen.append(seq)])
    (w,) = _deprecations(caught)
    assert w.filename == __file__  # the caller's line, not the library's
    text = str(w.message)
    assert "log_options=LogOptions(fsync=...)" in text and "steps=StepOptions(depth=, yield_every_s=...)" in text
    assert "extras=ExtraOptions(observers=...)" in text
    async with opening as engine:
        assert engine.depth == 2 and engine.ledger.log.fsync == "per_step"
        await engine.reserve(1, 2)
    assert seen  # the observer was wired in


@pytest.mark.asyncio
async def test_each_group_alone_does_what_its_flat_keywords_did(tmp_path):
    seen: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the groups warn about nothing
        async with open_engine(G, log=tmp_path / "g.kvlog", log_options=LogOptions(fsync="per_step"),
                               steps=StepOptions(depth=2, yield_every_s=0),
                               extras=ExtraOptions(observers=[lambda seq, event, effects: seen.append(seq)])) as engine:
            assert engine.depth == 2 and engine.ledger.log.fsync == "per_step"
            await engine.reserve(1, 2)
    assert seen


def test_a_flat_keyword_beside_its_group_is_refused_and_an_unknown_one_is_a_type_error():
    with pytest.raises(InvalidArgumentError, match="depth= given both"):
        open_engine(G, depth=2, steps=StepOptions())
    with pytest.raises(InvalidArgumentError, match="sanitize= given both"):
        open_engine(G, sanitize=True, extras=ExtraOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument 'sanitise'"):
        open_engine(G, sanitise=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        open_ledger("never.kvlog", G, depth=2)


@pytest.mark.asyncio
async def test_log_options_as_a_mapping_is_deprecated_and_checked(tmp_path):
    with pytest.warns(DeprecationWarning, match="log_options=LogOptions"):
        opening = open_engine(G, log=tmp_path / "m.kvlog", log_options={"segment_bytes": 4096})
    async with opening:
        assert (tmp_path / "m.kvlog").is_dir()  # a log directory of segments
    with pytest.raises(InvalidArgumentError, match="no log options"):
        open_engine(G, log=tmp_path / "x.kvlog", log_options={"policy": "all_reused"})


def test_flat_open_ledger_keywords_still_work_with_a_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match="log_options=LogOptions") as record:
        led = open_ledger(tmp_path / "l.kvlog", G, fsync="per_step", segment_bytes=4096)
    try:
        assert led.log.fsync == "per_step" and (tmp_path / "l.kvlog").is_dir()
        assert record[0].filename == __file__
    finally:
        led.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with open_ledger(tmp_path / "l.kvlog", log_options=LogOptions(fsync="per_step")) as again:
            assert again.log.fsync == "per_step"


@pytest.mark.parametrize("bad", [
    {"depth": 0}, {"depth": 99}, {"depth": 1.0}, {"queue_size": 0}, {"drain_timeout_s": -1},
    {"timings": 1}, {"yield_every_s": 2}, {"yield_every_s": "0"},
])
def test_step_options_check_their_fields(bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        StepOptions(**bad)


@pytest.mark.parametrize("bad", [{"sanitize": 1}, {"metrics": object()}, {"kv_events": 42}, {"observers": "f"}])
def test_extra_options_check_their_fields(bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        ExtraOptions(**bad)


def test_groups_are_frozen_and_observers_a_tuple():
    ex = ExtraOptions(observers=[print])
    assert ex.observers == (print,)
    for group in (ex, StepOptions(), LogOptions()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            group.__setattr__("sanitize", True)


@pytest.mark.asyncio
async def test_depth_with_remote_ranks_is_still_refused():
    with pytest.raises(ConfigurationError, match="local ranks only"):
        async with open_engine(G, remote=RemoteOptions(world_size=2, listen=None), steps=StepOptions(depth=2)):
            pass


def test_remote_ranks_is_remote_options_under_its_old_name_with_a_warning():
    import kvledger.engine as engine_pkg
    from kvledger.engine import remote

    for where in (engine_pkg, remote):
        with pytest.warns(DeprecationWarning, match="RemoteOptions") as record:
            old = where.RemoteRanks
        assert old is RemoteOptions and record[0].filename == __file__
