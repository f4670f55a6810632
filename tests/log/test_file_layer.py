"""Every file layer the log runs on offers the whole ``FileLayer`` protocol (core/log/files.py):
the log asks for each member by name and never looks one up (``getattr``) to see whether a
layer has it, so a layer missing one would fail only when that path runs."""

from __future__ import annotations

import pytest
from support.simdisk import FaultInjector, SimulatedDisk

from kvledger.core.log.files import FileLayer, OsFileLayer, default_layer
from kvledger.metrics.layer import TimedFileLayer


class _Seconds:
    def observe(self, amount: float) -> None:
        pass


@pytest.mark.parametrize("layer", [
    default_layer, OsFileLayer(), SimulatedDisk(), FaultInjector(SimulatedDisk()),
    TimedFileLayer(_Seconds(), _Seconds()), TimedFileLayer(_Seconds(), _Seconds(), SimulatedDisk()),
], ids=["default", "os", "simulated", "faults", "timed", "timed-simulated"])
def test_every_layer_is_a_whole_file_layer(layer):
    assert isinstance(layer, FileLayer)


def test_a_layer_missing_a_member_is_not_one():
    class NoStamps:
        def exists(self, path): ...
        def create(self, path, data): ...
        def open(self, path): ...
        def read(self, path): ...

    assert not isinstance(NoStamps(), FileLayer)


def test_the_timed_layer_passes_directories_and_stamps_through():
    disk = SimulatedDisk()
    layer = TimedFileLayer(_Seconds(), _Seconds(), disk)
    layer.makedir("d")
    assert layer.isdir("d") and layer.listdir("d") == []
    layer.write_stamp("d/x", b"stamp")
    assert layer.read_stamp("d/x") == b"stamp" == disk.read_stamp("d/x")
    layer.remove_stamp("d/x")
    assert layer.read_stamp("d/x") is None
