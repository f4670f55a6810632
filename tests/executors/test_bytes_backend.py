"""The bytes clear backend (no torch): exactly the listed pages become zero in every plane, for
pages of any width and runs past its write chunk; bad ids and bad planes raise before anything
is touched; its sanitizer side finds what the device check finds (held against the torch
reference where torch is installed); it is in the registry and is what buffer planes get."""

from __future__ import annotations

import array
import random
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st
from support.planes import page

from kvledger import ConfigurationError, DuplicatePageError, InvalidArgumentError, PageOutOfRangeError
from kvledger.executors import bytes_backend
from kvledger.executors.backend import BACKENDS, ClearBackend, default_backend, is_buffer, make_backend, plane_device
from kvledger.executors.bytes_backend import BytesClearBackend, byte_plane, copy_bytes, flat_bytes, holds_poison
from kvledger.executors.jobs import copy_pair
from kvledger.executors.sanitize import NOT_ZERO, POISON, Violation

NUM_PAGES = 32
WIDTHS = (64, 30, 7)  # bytes a page, per plane: a multiple of 8, an even width, an odd one


def random_byte_planes(seed: int = 0, num_pages: int = NUM_PAGES, widths=WIDTHS) -> list[memoryview]:
    """Planes of different page widths, every byte non-zero."""
    rng = random.Random(seed)
    out = []
    for w in widths:
        plane = byte_plane(num_pages, w)
        flat_bytes(plane)[:] = bytes(rng.randrange(1, 256) for _ in range(num_pages * w))
        out.append(plane)
    return out


def snapshot(planes) -> list[bytes]:
    return [flat_bytes(p).tobytes() for p in planes]


def assert_zeroed_exactly(planes, before: list[bytes], listed) -> None:
    listed = set(listed)
    for plane, old in zip(planes, before, strict=True):
        n = memoryview(plane).shape[0]
        pb = len(old) // n
        for p in range(n):
            got = page(plane, p)
            if p in listed:
                assert got == bytes(pb), f"page {p} not zeroed"
            else:
                assert got == old[p * pb:(p + 1) * pb], f"page {p} changed"


@pytest.mark.parametrize("kind", ["adjacent", "scattered", "single", "all"])
def test_clears_exactly_the_listed_pages(kind):
    planes = random_byte_planes()
    before = snapshot(planes)
    ids = {
        "adjacent": [5, 6, 7, 8, 20, 21],
        "scattered": random.Random(1).sample(range(NUM_PAGES), 11),
        "single": [NUM_PAGES - 1],
        "all": list(range(NUM_PAGES))[::-1],
    }[kind]
    backend = BytesClearBackend(planes)
    assert isinstance(backend, ClearBackend) and backend.num_pages == NUM_PAGES
    assert backend.plane_page_bytes == WIDTHS
    backend.clear(ids)
    assert_zeroed_exactly(planes, before, ids)
    assert backend.statistics() == {"calls": 1, "pages": len(ids), "bytes": len(ids) * sum(WIDTHS)}


@given(st.sets(st.integers(0, NUM_PAGES - 1), max_size=NUM_PAGES))
def test_clear_property(ids):
    planes = random_byte_planes(seed=len(ids))
    before = snapshot(planes)
    ids = list(ids)
    random.Random(len(ids)).shuffle(ids)
    BytesClearBackend(planes).clear(ids)
    assert_zeroed_exactly(planes, before, ids)


def test_runs_longer_than_the_chunk_clear_and_poison_exactly():
    # pages of 48 B, 160 KiB (two adjacent pass the chunk) and 300 KiB (one does)
    widths = (48, 160 * 1024, 300 * 1024)
    assert max(widths) > bytes_backend._CHUNK
    planes = random_byte_planes(seed=3, num_pages=8, widths=widths)
    backend = BytesClearBackend(planes)
    for ids in ([2, 3], [7], [0, 1, 2, 5]):
        backend.poison(ids)
        for plane, w in zip(planes, widths, strict=True):
            assert all(page(plane, p) == b"\xff" * w for p in ids)
        before = snapshot(planes)
        backend.clear_checked(tuple(ids))
        assert_zeroed_exactly(planes, before, ids)


def test_planes_of_other_buffer_kinds():
    # a 1-D array of int64 (one element a page), a bytearray cast to pages
    longs = array.array("q", range(1, NUM_PAGES + 1))
    raw = bytearray(b"\x5a" * (NUM_PAGES * 12))
    shaped = memoryview(raw).cast("B", (NUM_PAGES, 12))
    backend = BytesClearBackend([longs, shaped])
    assert backend.plane_page_bytes == (8, 12)
    backend.clear([3, 4])
    assert longs[3] == longs[4] == 0 and longs[2] == 3 and longs[5] == 6
    assert raw[3 * 12:5 * 12] == bytes(24) and raw[:3 * 12] == b"\x5a" * 36


@pytest.mark.parametrize("bad, error", [
    ([NUM_PAGES], PageOutOfRangeError),
    ([-1], PageOutOfRangeError),
    ([1, 2, 1], DuplicatePageError),
    (["3"], InvalidArgumentError),
    ([True], InvalidArgumentError),
])
def test_bad_ids_raise_before_touching_any_plane(bad, error):
    planes = random_byte_planes()
    before = snapshot(planes)
    backend = BytesClearBackend(planes)
    for call in (backend.clear, backend.poison):
        with pytest.raises(error):
            call([0, 5] + bad)
    with pytest.raises(error):
        backend.start_verify([0] + bad, ())
    with pytest.raises(error):
        backend.start_verify((), [0] + bad)
    assert snapshot(planes) == before
    assert backend.statistics()["calls"] == 0


@pytest.mark.parametrize("planes, words", [
    ([], "at least one plane"),
    ([b"\x01" * 8], "read-only"),
    ([memoryview(bytearray(64))[::2]], "not C-contiguous"),
    ([byte_plane(4, 8), byte_plane(5, 8)], "plane 1 has 5 pages, plane 0 has 4"),
    ([bytearray()], "no pages"),
    ([memoryview(bytearray(1)).cast("B", ())], "page dimension"),
    ([object()], "not a byte buffer"),
])
def test_bad_planes_are_refused(planes, words):
    with pytest.raises(ConfigurationError, match=words):
        BytesClearBackend(planes)


def test_a_stream_is_refused():
    with pytest.raises(ConfigurationError, match="no stream"):
        BytesClearBackend([byte_plane(4, 8)], stream=object())


@pytest.mark.parametrize("args", [(0, 8), (4, 0), (4, 8, 256), (4, 8, -1), (4.0, 8)])
def test_byte_plane_refuses_bad_sizes(args):
    with pytest.raises(ConfigurationError):
        byte_plane(*args)


def test_byte_plane_shape_and_fill():
    plane = byte_plane(3, 5, fill=0xAB)
    assert plane.shape == (3, 5) and not plane.readonly
    assert plane.tobytes() == b"\xab" * 15


# ---------------------------------------------------------------------- the sanitizer side


def test_poison_then_verify_names_each_violation():
    planes = random_byte_planes()
    backend = BytesClearBackend(planes)
    backend.poison([1, 2, 3])
    backend.clear([2])
    # 1 and 3 listed but not cleared: NOT_ZERO in every plane; 3 and 4 committed: 3 holds poison
    check = backend.start_verify([1, 2, 3], [3, 4])
    assert check.query()
    found = check.result()
    want = sorted([Violation(plane=k, page=p, kind=NOT_ZERO) for k in range(3) for p in (1, 3)]
                  + [Violation(plane=k, page=3, kind=POISON) for k in range(3)])
    assert list(found) == want and check.total == len(want)
    assert backend.verify([2], [2]) == ()


@pytest.mark.parametrize("data, poisoned", [
    (b"\xff" * 8, True),
    (b"\x00" + b"\xff" * 8 + b"\x00" * 7, False),  # eight 0xFF bytes across two groups
    (b"\x00" * 8 + b"\xff" * 8, True),  # the second group
    (b"\x00" * 8 + b"\xff" * 3, True),  # the last group, cut at the page's end
    (b"\x00" * 8 + b"\xfe\xff\xff", False),
    (b"\xff" * 5, True),  # a page shorter than a group is one group
    (b"\xff\xff\x7f", False),
    (b"\x01" * 3 + b"\xff" * 13, True),  # an unaligned run that covers an aligned group
    (b"", False),
])
def test_holds_poison_follows_the_group_rule(data, poisoned):
    assert holds_poison(data) is poisoned


def test_holds_poison_agrees_with_the_torch_reference():
    torch = pytest.importorskip("torch")  # (the reference itself is torch's)
    from kvledger.executors.sanitize import holds_poison_rows

    rng = random.Random(7)
    for width in (1, 5, 8, 13, 16, 24, 31):
        rows = []
        for _ in range(64):
            raw = bytearray(rng.choice((0x00, 0xFF)) if rng.random() < 0.8 else rng.randrange(256)
                            for _ in range(width))
            rows.append(bytes(raw))
        ref = holds_poison_rows(torch, torch.tensor([list(r) for r in rows], dtype=torch.uint8))
        assert [holds_poison(r) for r in rows] == ref.tolist(), width


def test_verify_agrees_with_the_torch_verifier():
    torch = pytest.importorskip("torch")  # (the reference itself is torch's)
    from kvledger.executors.sanitize import TorchVerifier

    planes = random_byte_planes(seed=11)
    tensors = [torch.frombuffer(bytearray(flat_bytes(p)), dtype=torch.uint8).reshape(NUM_PAGES, -1)
               for p in planes]
    backend = BytesClearBackend(planes)
    rng = random.Random(5)
    for _ in range(20):
        poisoned = rng.sample(range(NUM_PAGES), 6)
        cleared = rng.sample(range(NUM_PAGES), 5)
        backend.poison(poisoned)
        backend.clear(cleared[:3])
        for t, p in zip(tensors, planes, strict=True):
            t.view(-1).copy_(torch.frombuffer(bytearray(flat_bytes(p)), dtype=torch.uint8))
        committed = rng.sample(range(NUM_PAGES), 6)
        assert backend.verify(cleared, committed) == TorchVerifier(tensors).start(cleared, committed).result()


# ---------------------------------------------------------------------- registry and copies


def test_registered_and_chosen_for_buffer_planes():
    assert "bytes" in BACKENDS
    planes = [byte_plane(NUM_PAGES, 8)]
    backend = make_backend("bytes", planes)
    assert type(backend) is BytesClearBackend
    assert default_backend(planes) == "bytes" and default_backend([object()]) == "torch"
    assert is_buffer(bytearray(1)) and not is_buffer(object())
    assert plane_device(planes[0]) is None


def test_importing_and_using_it_imports_no_torch():
    code = ("import sys\n"
            "from kvledger.executors.backend import make_backend\n"
            "from kvledger.executors.bytes_backend import byte_plane\n"
            "make_backend('bytes', [byte_plane(4, 8)]).clear([1])\n"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_copies_between_buffers():
    dst = byte_plane(4, 8)
    copy_pair(b"\x07" * 8, flat_bytes(dst)[8:16])
    assert page(dst, 1) == b"\x07" * 8 and page(dst, 0) == bytes(8)
    out = bytearray(3)
    copy_bytes(array.array("B", [1, 2, 3]), out)
    assert out == b"\x01\x02\x03"
    with pytest.raises(ValueError):
        copy_pair(b"\x01" * 7, flat_bytes(dst)[:8])  # lengths differ: nothing written
    assert page(dst, 0) == bytes(8)
    with pytest.raises(ConfigurationError, match="read-only"):
        copy_bytes(b"x", b"y")
