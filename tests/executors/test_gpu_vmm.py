"""Real CUDA VMM aliases and the seed's CUDA test (RELIABILITY R15), on every backend.

    planes (cuMemCreate chunks)      K fp8 16 KiB/page, V fp8 8 KiB/page, scales bf16 32 KiB/page
    snapshot 1 rows -> pages [256, 512)   written with 0x7F (FP8 NaN), then released and unmapped
    snapshot 2 rows -> pages [512, 768)   a live row: must stay byte-identical
    request 7 reserves (LIFO: released pages first), commits 150 released + 20 fresh pages at step 0
    the ledger's clear list for step 0 -> backend.clear -> exactly those pages zero, nothing else moved

Needs a CUDA device and cuda-python; skips cleanly without them. With
``KVLEDGER_GPU_REPORT=path`` each R15 run appends its figures as a JSON line.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from support.gpu import as_bytes, gpu_backend  # noqa: E402

from kvledger import CudaDriverError, Geometry, InvalidArgumentError, KVLedgerError, Ledger  # noqa: E402

BACKENDS = ["torch", "cuda", "cuda-per-page", "triton", "triton-graph"]
PAGE_BYTES = (16384, 8192, 32768)
DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
MiB = 1 << 20


def decode(plane, idx):
    """The listed pages of ``plane`` decoded as its dtype, in float32 (indexing done on bytes)."""
    return as_bytes(plane)[idx].view(plane.dtype).float()


def report(record: dict) -> None:
    path = os.environ.get("KVLEDGER_GPU_REPORT")
    print("R15 " + json.dumps(record, sort_keys=True))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


@pytest.fixture
def vmm():
    pytest.importorskip("cuda.bindings")
    from kvledger.executors.vmm import VmmCachePlanes

    cache = VmmCachePlanes(1024, PAGE_BYTES, dtypes=DTYPES)
    try:
        yield cache
    finally:
        cache.close()


def fill_finite(planes, gen):
    """Random bytes 0x01..0x7E: finite in fp8 e4m3 and, as high bytes, in bf16 (never NaN)."""
    for p in planes:
        b = as_bytes(p)
        b.copy_(torch.randint(1, 0x7F, b.shape, dtype=torch.uint8, device=b.device, generator=gen))


def test_rows_alias_the_plane_pages_both_ways(vmm):
    rp = vmm.row_pages
    assert vmm.granularity % (2 * MiB) == 0 or (2 * MiB) % vmm.granularity == 0
    gen = torch.Generator(device="cuda").manual_seed(1)
    fill_finite(vmm.planes, gen)
    before = [as_bytes(p).clone() for p in vmm.planes]
    rows = vmm.map_rows(rp, rp)
    assert all(ptr != p.data_ptr() for ptr, p in zip(rows.ptrs, vmm.planes, strict=True))
    for k, (row, plane) in enumerate(zip(rows.tensors, vmm.planes, strict=True)):
        # the row reads the plane's bytes ...
        assert torch.equal(as_bytes(row), as_bytes(plane)[rp:2 * rp])
        # ... and a write through the row shows up in the plane, only inside its pages
        pattern = torch.randint(0, 256, as_bytes(row).shape, dtype=torch.uint8, device="cuda", generator=gen)
        as_bytes(row).copy_(pattern)
        torch.cuda.synchronize()
        assert torch.equal(as_bytes(plane)[rp:2 * rp], pattern)
        outside = torch.ones(vmm.num_pages, dtype=torch.bool, device="cuda")
        outside[rp:2 * rp] = False
        assert torch.equal(as_bytes(plane)[outside], before[k][outside])
        # and a write through the plane shows up in the row
        as_bytes(plane)[rp + 3].fill_(0x5A)
        torch.cuda.synchronize()
        assert bool((as_bytes(row)[3] == 0x5A).all())
    vmm.unmap_rows(rows)
    vmm.unmap_rows(rows)  # idempotent
    assert not rows.live
    assert torch.equal(as_bytes(vmm.planes[0])[rp + 3], torch.full_like(before[0][0], 0x5A))


def test_rows_must_cover_whole_chunks(vmm):
    rp = vmm.row_pages
    if vmm.granularity == 2 * MiB:
        assert rp == 256  # 2 MiB chunks / (16, 8, 32 KiB pages) -> lcm(128, 256, 64)
    for first, count in ((1, rp), (0, rp - 1), (rp, rp + 3), (vmm.num_pages - rp, 2 * rp), (-rp, rp), (0, 0)):
        with pytest.raises(InvalidArgumentError):
            vmm.map_rows(first, count)


def test_close_gives_the_memory_back():
    pytest.importorskip("cuda.bindings")
    from kvledger.executors.vmm import VmmCachePlanes

    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    cache = VmmCachePlanes(4096, PAGE_BYTES, dtypes=DTYPES)  # 224 MiB of chunks
    rows = cache.map_rows(0, 1024)
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 >= cache.nbytes >= 4096 * sum(PAGE_BYTES)
    cache.close()
    cache.close()  # idempotent
    assert cache.closed and not rows.live
    free2, _ = torch.cuda.mem_get_info()
    assert free2 >= free0 - 4 * MiB
    with pytest.raises(InvalidArgumentError):
        cache.map_rows(0, 256)


def test_driver_errors_name_the_call():
    pytest.importorskip("cuda.bindings")
    from kvledger.executors import cuda_driver

    dev = torch.cuda.current_device()
    torch.cuda.current_stream()
    g = cuda_driver.allocation_granularity(dev)
    with pytest.raises(CudaDriverError) as info:
        cuda_driver.mem_create(g + 1, dev)
    err = info.value
    assert isinstance(err, KVLedgerError)
    assert err.call == "cuMemCreate" and err.code and err.name.startswith("CUDA_ERROR_")
    assert "cuMemCreate" in str(err) and f"size={g + 1}" in str(err)
    with pytest.raises(CudaDriverError) as info:
        cuda_driver.address_free(0x1000, g)
    assert info.value.call == "cuMemAddressFree"
    # the context is still healthy: a normal allocation works
    assert int(torch.ones(4, device="cuda").sum().item()) == 4


def _write_through_rows(planes, rows_1, rows_2, released, live, gen):
    """Snapshot 1 writes FP8 NaN bytes through its rows, snapshot 2 random bytes through its.

    Returns snapshot 2's bytes per plane and the bytes that landed outside the rows'
    pages (compared through the planes' own addresses; must be 0).
    """
    before_rows = [as_bytes(p).clone() for p in planes]
    live_bytes = []
    for t in rows_1.tensors:
        as_bytes(t).fill_(0x7F)  # FP8 e4m3 NaN
    for t in rows_2.tensors:
        b = torch.randint(0, 256, as_bytes(t).shape, dtype=torch.uint8, device="cuda", generator=gen)
        as_bytes(t).copy_(b)
        live_bytes.append(b)
    torch.cuda.synchronize()
    # the row bytes land in the KV pages (plane addresses) and stay inside the rows' ranges
    rel = torch.tensor(released, device="cuda")
    liv = torch.tensor(live, device="cuda")
    alias_stray = 0
    for k, p in enumerate(planes):
        want = before_rows[k].clone()
        want[rel] = 0x7F
        want[liv] = live_bytes[k]
        alias_stray += int((as_bytes(p) != want).sum().item())
    return live_bytes, alias_stray


def _commit_under_pressure(ledger, rp):
    """Request 7 reserves 300 pages (LIFO: the released ones first) and commits 150 released
    and 20 fresh ones at step 0; returns step 0's clear list and the committed pages."""
    got = ledger.reserve(7, 300)
    stale = [p for p in got if ledger.is_marked(p)]
    fresh = [p for p in got if not ledger.is_marked(p)]
    assert len(stale) == rp and len(fresh) == 300 - rp  # LIFO hands the released pages out first
    commit = stale[:150] + fresh[:20]
    listed_now = ledger.commit(7, 0, pages=commit)
    ledger.return_reservation(7)
    clear_list = ledger.seal_step(0).clear_list
    assert tuple(listed_now) == tuple(stale[:150]) and sorted(clear_list) == sorted(stale[:150])
    return clear_list, commit


def _after_clear(planes, before, clear_list, rows_2, live_bytes, ledger, released):
    """What the clear did, counted on the device: bytes left in listed pages, bytes changed
    elsewhere, live-row bytes changed, NaN in request 7's pages; and the marked pages left
    unlisted, with whether they still hold the NaN bytes."""
    num_pages = planes[0].shape[0]
    idx = torch.tensor(clear_list, device="cuda")
    others = torch.ones(num_pages, dtype=torch.bool, device="cuda")
    others[idx] = False
    kv = torch.tensor(ledger.kv_pages(7), device="cuda")
    still_marked = [p for p in released if ledger.is_marked(p)]
    return {
        "listed_nonzero_bytes": sum(int(as_bytes(p)[idx].count_nonzero().item()) for p in planes),
        "stray_bytes": sum(int((as_bytes(p)[others] != before[k][others]).sum().item())
                           for k, p in enumerate(planes)),
        "live_row_diff_bytes": sum(int((as_bytes(t) != live_bytes[k]).sum().item())
                                   for k, t in enumerate(rows_2.tensors)),
        "nan_in_request_pages_after": sum(int(decode(p, kv).isnan().sum().item()) for p in planes),
    }, still_marked, bool((as_bytes(planes[0])[torch.tensor(still_marked, device="cuda")] == 0x7F).all())


@pytest.mark.parametrize("name", BACKENDS)
def test_r15_released_row_nan_bytes_are_cleared_exactly(vmm, name):
    num_pages = vmm.num_pages
    rp = vmm.row_pages
    planes = vmm.planes
    gen = torch.Generator(device="cuda").manual_seed(15)
    fill_finite(planes, gen)  # KV data of earlier requests: finite everywhere
    ledger = Ledger(Geometry(num_pages=num_pages, page_tokens=16), check=True)
    released = tuple(range(rp, 2 * rp))
    live = tuple(range(2 * rp, 3 * rp))
    ledger.alias_snapshot(1, pages=released)
    ledger.alias_snapshot(2, pages=live)
    rows_1 = vmm.map_rows(rp, rp)
    rows_2 = vmm.map_rows(2 * rp, rp)
    live_bytes, alias_stray = _write_through_rows(planes, rows_1, rows_2, released, live, gen)
    assert alias_stray == 0
    rel = torch.tensor(released, device="cuda")
    assert bool(decode(planes[0], rel).isnan().all())

    # release snapshot 1: its pages are free and marked; the row goes, the bytes stay
    ledger.release_snapshot(1)
    vmm.unmap_rows(rows_1)
    assert all(ledger.is_marked(p) for p in released)
    assert bool((as_bytes(planes[1])[rel] == 0x7F).all())

    clear_list, commit = _commit_under_pressure(ledger, rp)
    nan_before = int(decode(planes[0], torch.tensor(commit, device="cuda")).isnan().sum().item())
    assert nan_before > 0  # without the clear the request's pages decode as NaN

    before = [as_bytes(p).clone() for p in planes]
    backend = gpu_backend(name, planes)
    backend.clear(clear_list)
    torch.cuda.synchronize()
    counts, still_marked, unlisted_nan = _after_clear(planes, before, clear_list, rows_2, live_bytes, ledger,
                                                      released)
    vmm.unmap_rows(rows_2)
    report({
        "test": "R15", "backend": name, "granularity": vmm.granularity, "planes": len(planes),
        "pages_listed": len(clear_list), "page_planes_zero_checked": len(clear_list) * len(planes),
        "other_page_planes_checked": (num_pages - len(clear_list)) * len(planes),
        "live_row_bytes_checked": sum(t.numel() * t.element_size() for t in rows_2.tensors),
        "nan_in_request_pages_before": nan_before, "alias_stray_bytes": alias_stray, **counts,
    })
    assert counts["listed_nonzero_bytes"] == 0
    assert counts["stray_bytes"] == 0
    assert counts["live_row_diff_bytes"] == 0
    assert counts["nan_in_request_pages_after"] == 0
    assert len(still_marked) == rp - 150 and unlisted_nan  # unlisted marked pages keep their bytes
