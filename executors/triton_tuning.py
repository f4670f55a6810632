"""Per card: the Triton clear's kernel shapes by clear size, and where its page ids live by list length.

    tuning_for(card name)  ─► CardTuning
        shapes   ((up to bytes, FillConfig), ...)   the fill kernel's knobs for a clear of that
                                                   many bytes (all planes), smallest class first
        ids      IdsPlan(param_max, longer)         lists of up to ``param_max`` ids travel in the
                                                   kernel's parameters; longer ones in a device
                                                   row, copied ``longer``: "side" (a copy stream;
                                                   the model stream waits for it on the device),
                                                   "stream" (on the model stream) or "mapped"
                                                   (no copy: the kernel reads the pinned host row
                                                   over PCIe; measured, never chosen)

Why ids never live in host memory for the kernel: on an H100 at ``e388c64`` a clear of 16
pages over 128 planes took 26.6 us with the list read from the pinned host row, against
14.7 us with it in device memory: every one of ~2,000 programs reads the count and its id
over PCIe. Parameters cost nothing on the device (the constant bank, filled at the launch)
and nothing on the host (the driver copies them at the launch call: no copy, no event, no
ring slot); a list too long for them (the kernel picks its id with ``k - 1`` selects) is
copied to the device first, on a side stream so the copy overlaps the work ahead of it.

The figures behind each row are in ``bench/README.md`` (issue 31), measured with
``bench/bench_gpu_tune.py`` (shapes) and ``bench/bench_gpu.py`` (placements) on that card;
run them again to re-measure (``scripts/gpu-check`` prints both tables). A card not in
the table gets ``DEFAULT``. Pure data: no torch, no device.
"""

from __future__ import annotations

import dataclasses

from .triton_kernels import PARAM_SLOTS, FillConfig

__all__ = ["DEFAULT", "TABLE", "CardTuning", "IdsPlan", "tuning_for"]

COPY_MODES = ("side", "stream", "mapped")


@dataclasses.dataclass(frozen=True)
class IdsPlan:
    """Where an eager clear's ids live: ``param_max`` (0, or at most ``max(PARAM_SLOTS)``) and
    ``longer`` (one of ``COPY_MODES``) for the lists past it."""

    param_max: int = 16
    longer: str = "side"

    def __post_init__(self) -> None:
        if type(self.param_max) is not int or not 0 <= self.param_max <= max(PARAM_SLOTS):
            raise ValueError(f"param_max must be an int in [0, {max(PARAM_SLOTS)}], got {self.param_max!r}")
        if self.longer not in COPY_MODES:
            raise ValueError(f"longer must be one of {COPY_MODES}, got {self.longer!r}")

    def slots_for(self, n: int) -> int:
        """The kernel's id slots for a list of ``n`` ids (0: the list is too long for parameters)."""
        if n > self.param_max:
            return 0
        for k in PARAM_SLOTS:
            if k >= n:
                return k
        return 0


@dataclasses.dataclass(frozen=True)
class CardTuning:
    """One card's row: kernel shapes by clear size (``shapes``, ascending, the last one open-ended)
    and the ids plan; ``source`` names the run the choice comes from."""

    shapes: tuple[tuple[float, FillConfig], ...]
    ids: IdsPlan
    source: str

    def config_for(self, nbytes: float) -> FillConfig:
        """The kernel shape for a clear of ``nbytes`` bytes (all planes together)."""
        for up_to, cfg in self.shapes:
            if nbytes <= up_to:
                return cfg
        return self.shapes[-1][1]


INF = float("inf")
SMALL = 32e6  # bytes: the shapes' classes meet here (bench_gpu_tune.SMALL_CLASS)

_H100 = "bench_gpu_tune.py --quick on an H100 80GB HBM3, 2026-12-07 (bench/README.md, issue 31)"

TABLE: dict[str, CardTuning] = {
    "NVIDIA H200": CardTuning(shapes=((SMALL, FillConfig(block_bytes=8192)), (INF, FillConfig(programs_per_sm=32))),
                              ids=IdsPlan(16, "side"), source="the H100's row until the H200's sweep"),
    "NVIDIA H100 80GB HBM3": CardTuning(shapes=((SMALL, FillConfig(block_bytes=8192)),
                                               (INF, FillConfig(programs_per_sm=32))),
                                        ids=IdsPlan(16, "side"), source=_H100),
}

DEFAULT = dataclasses.replace(TABLE["NVIDIA H100 80GB HBM3"], source="not measured on this card: the H100's row")


def tuning_for(card: str) -> CardTuning:
    """The card's row: its exact name, else the first row whose name is a prefix of it
    (``NVIDIA H100 PCIe`` -> no row; ``NVIDIA H200 NVL`` -> ``NVIDIA H200``), else ``DEFAULT``."""
    row = TABLE.get(card)
    if row is not None:
        return row
    for name, row in TABLE.items():
        if card.startswith(name):
            return row
    return DEFAULT
