"""The Triton kernels themselves, run by Triton's interpreter on CPU tensors, against torch references.

No GPU needed, only the triton package (skips without it): this checks the kernels' index
arithmetic (task decomposition, chunking, plane order, masks, the byte and word paths of the
check) for every knob of ``FillConfig``, on random data and random lists. The GPU tests run
the same kernels compiled; these catch a wrong index before a device is involved.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_the_kernels_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when kernels are defined: run this file's checks in a child with it set."""
    if INTERPRETED:
        pytest.skip("this is the child")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


from kvledger.executors import triton_kernels as K  # noqa: E402
from kvledger.executors.sanitize import TorchVerifier, decode_triples  # noqa: E402

child_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")
if INTERPRETED:
    from triton.runtime import interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _index_of_one_element(tensor, scope):
        """The interpreter's scalars are 1-element arrays, which numpy >= 2.4 no longer turns into ints."""
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _index_of_one_element
FILL = K.fill_pages_kernel
VERIFY = K.verify_pages_kernel

LAYOUTS: dict[str, tuple[int, list[tuple[Any, tuple[int, ...]]], int]] = {
    "16k": (12, [(torch.uint8, (16384,)), (torch.float8_e4m3fn, (16384,)), (torch.uint8, (16384,))], 0),
    "fp8-kv-scales": (16, [(torch.float8_e4m3fn, (16, 128)), (torch.float8_e4m3fn, (8, 128)),
                           (torch.bfloat16, (16, 128))], 0),
    "small-odd": (20, [(torch.uint8, (100,)), (torch.float32, (9,))], 0),
    "misaligned": (14, [(torch.uint8, (7,)), (torch.uint8, (13,))], 3),
}
CONFIGS = [K.FillConfig(), K.FillConfig(block_bytes=4096, chunked=True),
           K.FillConfig(block_bytes=2048, chunked=True, plane_major=True, streaming=True),
           K.FillConfig(block_bytes=16384, plane_major=True)]


def planes_for(layout, seed):
    num_pages, specs, offset = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype, shape in specs:
        per_page = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(1, 255, (num_pages * per_page + offset + 16,), generator=g, dtype=torch.int32)
        base = raw.to(torch.uint8)
        # 16-byte aligned start (plus the layout's offset), like a device allocation
        skip = (-base.data_ptr()) % 16 + offset
        out.append(base[skip:skip + num_pages * per_page].view(dtype).view(num_pages, *shape))
    return num_pages, out


def as_bytes(p):
    return p.reshape(p.shape[0], -1).view(torch.uint8)


def run_fill(planes, ids, config, fill, grid):
    anchor = planes[0].reshape(-1).view(torch.uint8)
    ptrs = [p.data_ptr() for p in planes]
    pb = [as_bytes(p).shape[1] for p in planes]
    t = K.plane_tables(anchor.data_ptr(), ptrs, pb, pb, config)
    meta = torch.tensor([len(ids), *ids], dtype=torch.int32)
    tabs = [torch.tensor(v, dtype=torch.int64) for v in (t.deltas, t.strides, t.lengths)]
    FILL[(grid,)](anchor, meta, *tabs, len(planes), t.chunks, **K.fill_constants(t, config, fill))
    return t


@child_only
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.tag().replace(" ", "-"))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fill_kernel_matches_torch_indexing(layout, config):
    rng = random.Random(f"{layout}/{config.tag()}")
    num_pages, planes = planes_for(layout, rng.randrange(1 << 20))
    for fill, value in ((0, 0), (-1, 255)):
        ids = rng.sample(range(num_pages), rng.randrange(1, num_pages))
        expected = [as_bytes(p).clone() for p in planes]
        for e in expected:
            e[torch.tensor(ids)] = value
        t = run_fill(planes, ids, config, fill, grid=rng.choice([1, 3, 7]))
        for k, (p, e) in enumerate(zip(planes, expected, strict=True)):
            assert torch.equal(as_bytes(p), e), f"plane {k} (unit {t.unit}, block {t.block}, chunks {t.chunks})"


def run_fill_by_value(planes, ids, config, fill, grid, k):
    """``param_fill_kernel(k)``: the list in the parameters, stale ids in the slots past it."""
    anchor = planes[0].reshape(-1).view(torch.uint8)
    ptrs = [p.data_ptr() for p in planes]
    pb = [as_bytes(p).shape[1] for p in planes]
    t = K.plane_tables(anchor.data_ptr(), ptrs, pb, pb, config)
    tabs = [torch.tensor(v, dtype=torch.int64) for v in (t.deltas, t.strides, t.lengths)]
    slots = [*ids, *random.Random(len(ids)).choices(range(planes[0].shape[0]), k=k - len(ids))]
    K.param_fill_kernel(k)[(grid,)](anchor, *tabs, len(planes), t.chunks, len(ids), *slots,
                                    **K.fill_constants(t, config, fill))
    return t


@child_only
@pytest.mark.parametrize("k", K.PARAM_SLOTS[:2])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.tag().replace(" ", "-"))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fill_by_value_matches_torch_indexing(layout, config, k):
    """The by-value kernel picks each slot's id from its parameters: the same bytes as the list
    kernel's reference, whatever the slots after ``count`` hold."""
    rng = random.Random(f"value/{layout}/{config.tag()}/{k}")
    num_pages, planes = planes_for(layout, rng.randrange(1 << 20))
    for fill, value in ((0, 0), (-1, 255)):
        ids = rng.sample(range(num_pages), rng.randrange(1, min(k, num_pages) + 1))
        expected = [as_bytes(p).clone() for p in planes]
        for e in expected:
            e[torch.tensor(ids)] = value
        t = run_fill_by_value(planes, ids, config, fill, rng.choice([1, 3, 7]), k)
        for j, (p, e) in enumerate(zip(planes, expected, strict=True)):
            assert torch.equal(as_bytes(p), e), f"plane {j} (unit {t.unit}, block {t.block}, chunks {t.chunks})"


def test_by_value_kernels_exist_only_for_the_listed_slot_counts():
    with pytest.raises(ValueError):
        K.param_fill_kernel(17)
    assert K.param_fill_kernel(16) is K.param_fill_kernel(16)  # one kernel per slot count


@child_only
def test_fill_of_an_empty_list_touches_nothing():
    num_pages, planes = planes_for("small-odd", 1)
    before = [as_bytes(p).clone() for p in planes]
    run_fill(planes, [], K.FillConfig(chunked=True, plane_major=True), 0, grid=4)
    assert all(torch.equal(as_bytes(p), b) for p, b in zip(planes, before, strict=True))


def run_verify(planes, cleared, committed, grid, max_out=64):
    anchor = planes[0].reshape(-1).view(torch.uint8)
    base = anchor.data_ptr()
    pb = [as_bytes(p).shape[1] for p in planes]
    wide = all(v % 8 == 0 for v in (base, *[p.data_ptr() for p in planes], *pb))
    tabs = [torch.tensor(v, dtype=torch.int64) for v in ([p.data_ptr() - base for p in planes], pb, pb)]
    lists = torch.tensor([len(cleared), len(committed), *cleared, *committed], dtype=torch.int32)
    out = torch.zeros(1 + 3 * max_out, dtype=torch.int32)
    VERIFY[(grid,)](anchor, lists, *tabs, len(planes), out, max_out, WIDE=wide, BLOCK=32)
    return decode_triples(out.tolist(), max_out)


@child_only
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_check_kernel_matches_the_torch_check(layout, seed):
    rng = random.Random(f"{layout}/{seed}")
    num_pages, planes = planes_for(layout, seed)
    for p in planes:  # damage: zeroed pages, poisoned groups, near misses
        b = as_bytes(p)
        for page in rng.sample(range(num_pages), num_pages // 2):
            width = b.shape[1]
            at = rng.randrange(0, width, 8) if width >= 8 else 0
            what = rng.randrange(3)
            if what == 0:
                b[page].zero_()
            elif what == 1:
                b[page, at:at + 8] = 255
            else:
                b[page, at:min(width, at + 8) - 1] = 255
    cleared = rng.sample(range(num_pages), rng.randrange(num_pages))
    committed = rng.sample(range(num_pages), rng.randrange(num_pages))
    want = TorchVerifier(planes).start(cleared, committed).result()
    total, got = run_verify(planes, cleared, committed, grid=rng.choice([1, 5]))
    assert total == len(want)
    assert tuple(sorted(got)) == want
