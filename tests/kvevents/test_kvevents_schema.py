"""KV events in vLLM's msgpack format (kvledger.kvevents.schema / batcher), without sockets.

Pins: golden bytes of BlockStored, BlockRemoved, AllBlocksCleared and the batch in
both layouts (each byte written by hand from the msgpack spec, not produced by
msgspec); decoding our bytes with structs declared the way vLLM declares them and
decoding vLLM-encoded bytes with ours, in both eras; the seq frames; the effect ->
event conversion; one batch per sealed step, never an empty one; decode errors.

The ``vllm_*`` struct families below are written in this test from our reading of
vLLM's ``vllm/distributed/kv_events.py`` (the commits named in kvledger.kvevents'
docstring): same class names (the tags), options, field names, order and types.
They are built inside functions, and this module does not use ``from __future__
import annotations``, so that their annotations name their own classes (string
annotations would resolve to kvledger's classes of the same names imported here).
"""

import contextlib
import random
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvledger import Geometry, InvalidArgumentError, Ledger
from kvledger.core.events.events import BlocksRemoved, BlocksStored, ClearPages, StepPlan
from kvledger.core.hashing import block_hashes, to_u64, to_u64_all
from kvledger.kvevents import (
    SEQ_END,
    AllBlocksCleared,
    AllBlocksClearedMap,
    BlockRemoved,
    BlockRemovedMap,
    BlockStored,
    BlockStoredMap,
    KVEventBatch,
    KVEventBatcher,
    KVEventBatchMap,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_from_bytes,
    to_kv_events,
)

# ---------------------------------------------------------------------- golden bytes, by hand

TAG_STORED = "ab" + b"BlockStored".hex()  # fixstr, 11 bytes
TAG_REMOVED = "ac" + b"BlockRemoved".hex()  # fixstr, 12 bytes
TAG_CLEARED = "b0" + b"AllBlocksCleared".hex()  # fixstr, 16 bytes
GPU = "a3" + b"GPU".hex()

STORED = BlockStored((1, b"\xab\xcd"), -2, (7, 8, 9, 300), 2, None, "GPU", "ad")
STORED_HEX = (
    "98" + TAG_STORED  # array of 8: the tag, then the 7 fields in order
    + "92" + "01" + "c402abcd"  # block_hashes [1, bin8 ab cd]
    + "fe"  # parent_block_hash -2 (negative fixint)
    + "94" + "07" "08" "09" + "cd012c"  # token_ids [7, 8, 9, uint16 300]
    + "02"  # block_size
    + "c0"  # lora_id nil
    + GPU  # medium
    + "a2" + b"ad".hex()  # lora_name
)
REMOVED = BlockRemoved((5,), "GPU")
REMOVED_HEX = "93" + TAG_REMOVED + "91" + "05" + GPU
CLEARED_HEX = "91" + TAG_CLEARED
BATCH = KVEventBatch(1.5, (AllBlocksCleared(), REMOVED), 0)
BATCH_HEX = "93" + "cb3ff8000000000000" + "92" + CLEARED_HEX + REMOVED_HEX + "00"  # ts float64, events, rank


def key(name: str) -> str:
    return f"{0xa0 | len(name):02x}" + name.encode().hex()


STORED_MAP_HEX = (
    "88" + key("type") + TAG_STORED  # map of 8: "type" first, then the fields in order
    + key("block_hashes") + "92" + "01" + "c402abcd"
    + key("parent_block_hash") + "fe"
    + key("token_ids") + "94" + "07" "08" "09" + "cd012c"
    + key("block_size") + "02"
    + key("lora_id") + "c0"
    + key("medium") + GPU
    + key("lora_name") + "a2" + b"ad".hex()
)
REMOVED_MAP_HEX = "83" + key("type") + TAG_REMOVED + key("block_hashes") + "91" + "05" + key("medium") + GPU
CLEARED_MAP_HEX = "81" + key("type") + TAG_CLEARED


def test_golden_bytes_array_layout():
    enc = msgspec.msgpack.encode
    assert enc(STORED).hex() == STORED_HEX
    assert enc(REMOVED).hex() == REMOVED_HEX
    assert enc(AllBlocksCleared()).hex() == CLEARED_HEX
    assert encode_batch(BATCH).hex() == BATCH_HEX
    # omit_defaults leaves array-like structs whole (msgspec, as for vLLM): None is nil
    assert encode_batch(KVEventBatch(1.5, (), None)).hex() == "93" + "cb3ff8000000000000" + "90" + "c0"


def test_golden_bytes_map_layout():
    enc = msgspec.msgpack.encode
    assert enc(BlockStoredMap(*msgspec.structs.astuple(STORED))).hex() == STORED_MAP_HEX
    assert enc(BlockRemovedMap((5,), "GPU")).hex() == REMOVED_MAP_HEX
    assert enc(AllBlocksClearedMap()).hex() == CLEARED_MAP_HEX
    batch = KVEventBatchMap(1.5, (AllBlocksClearedMap(), BlockRemovedMap((5,), "GPU")), 0)
    assert encode_batch(batch).hex() == "93" + "cb3ff8000000000000" + "92" + CLEARED_MAP_HEX + REMOVED_MAP_HEX + "00"


def test_round_trip_both_layouts():
    assert decode_batch(bytes.fromhex(BATCH_HEX), "array") == BATCH
    m = KVEventBatchMap(2.0, (BlockStoredMap(*msgspec.structs.astuple(STORED)),), 3)
    assert decode_batch(encode_batch(m), "map") == m


# ---------------------------------------------------------------------- structs as vLLM declares them


def vllm_array_era() -> SimpleNamespace:
    """vLLM between #27577 (lora_name) and #33304 (extra_keys): everything array_like."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(stored=BlockStored, removed=BlockRemoved, cleared=AllBlocksCleared, batch=KVEventBatch)


def vllm_map_era() -> SimpleNamespace:
    """vLLM after #42892: events are tagged maps with more (defaulted) fields; the batch positional."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(stored=BlockStored, removed=BlockRemoved, cleared=AllBlocksCleared, batch=KVEventBatch)


def our_batch(layout: str):
    """A batch from a real ledger run: published pages (bytes and int hashes), an eviction."""
    out: list = []
    b = KVEventBatcher(out.append, layout=layout, clock=lambda: 42.25, data_parallel_rank=1)
    led = Ledger(Geometry(num_pages=4, page_tokens=2), observer=b.observe)
    led.reserve(1, 2)
    led.commit(1, 0, 2)
    led.seal_step(0)
    led.complete_step(0, 0)
    led.publish(1, block_hashes([1, 2, 3, 4], 2), [1, 2, 3, 4], lora_id=7, lora_name="adapter")
    led.finish(1)
    led.reserve(2, 1)
    led.commit(2, 1, 1)
    led.reserve(3, 2)  # one free page left: evicts the least recently used cached page
    led.commit(3, 1, 2)
    led.seal_step(1)
    led.complete_step(1, 0)
    led.publish(3, [-5, (1 << 63) - 1], [9, 9, 9, 9], parent_hash=None)
    b.flush()
    events = [e for batch in out for e in batch.events]
    return out, events


@pytest.mark.parametrize("layout, era", [("array", vllm_array_era), ("map", vllm_map_era)])
def test_vllm_structs_decode_our_bytes(layout, era):
    v = era()
    batches, events = our_batch(layout)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("BlockStoredMap" if layout == "map" else "BlockStored") == 2
    assert any("Removed" in k for k in kinds) and any("Cleared" in k for k in kinds)
    dec = msgspec.msgpack.Decoder(v.batch)
    for ours in batches:
        theirs = dec.decode(encode_batch(ours))
        assert theirs.ts == 42.25 and theirs.data_parallel_rank == 1
        assert len(theirs.events) == len(ours.events)
        for t, o in zip(theirs.events, ours.events, strict=True):
            assert type(t) in (v.stored, v.removed, v.cleared)
            assert type(t).__name__ == type(o).__struct_config__.tag
            for name in o.__struct_fields__:
                got = getattr(t, name)
                assert (tuple(got) if isinstance(got, list) else got) == getattr(o, name), name


def test_the_two_layouts_are_not_interchangeable():
    array_bytes = encode_batch(our_batch("array")[0][1])
    map_bytes = encode_batch(our_batch("map")[0][1])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(vllm_map_era().batch).decode(array_bytes)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(vllm_array_era().batch).decode(map_bytes)


def test_our_structs_decode_vllm_bytes_array_era():
    v = vllm_array_era()
    big = 15760518052499183552  # vLLM's int hashes are unsigned 64-bit
    theirs = v.batch(ts=3.0, events=[
        v.stored(block_hashes=[big, b"\x01\x02"], parent_block_hash=big, token_ids=[1, 2], block_size=2,
                 lora_id=None, medium="GPU", lora_name=None),
        v.removed(block_hashes=[big], medium="GPU"),
        v.cleared(),
    ], data_parallel_rank=0)
    got = decode_batch(msgspec.msgpack.encode(theirs), "array")
    assert got == KVEventBatch(3.0, (BlockStored((big, b"\x01\x02"), big, (1, 2), 2, None, "GPU", None),
                                     BlockRemoved((big,), "GPU"), AllBlocksCleared()), 0)


def test_our_structs_decode_vllm_bytes_map_era_with_newer_fields():
    v = vllm_map_era()
    theirs = v.batch(ts=3.0, events=[
        v.stored(block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                 medium="GPU", lora_name=None, extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"),
        v.removed(block_hashes=[5], medium="GPU", group_idx=0),
    ], data_parallel_rank=2)
    got = decode_batch(msgspec.msgpack.encode(theirs), "map")
    assert got == KVEventBatchMap(3.0, (BlockStoredMap((5,), None, (1, 2), 2, None, "GPU", None, (None,), 0,
                                                       "full_attention"),
                                        BlockRemovedMap((5,), "GPU")), 2)  # the group read, the rest skipped


# ---------------------------------------------------------------------- framing and decode errors


def test_seq_frames():
    assert seq_bytes(0) == bytes(8)
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert SEQ_END == b"\xff" * 8
    assert seq_from_bytes(SEQ_END) == -1
    assert seq_from_bytes(seq_bytes(1 << 40)) == 1 << 40
    with pytest.raises(InvalidArgumentError):
        seq_from_bytes(b"\x00" * 7)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\xa1x\x90\x00", bytes.fromhex(BATCH_HEX)[:-3],
                                     bytes.fromhex("9391" + TAG_STORED + "90")])
def test_decode_rejects_bad_payloads(payload):
    with pytest.raises(InvalidArgumentError):
        decode_batch(payload)


def test_decode_mutations_raise_only_our_error():
    good = bytes.fromhex(BATCH_HEX)
    rng = random.Random(7)
    for _ in range(2000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        with contextlib.suppress(InvalidArgumentError):  # anything else escapes and fails the test
            decode_batch(bytes(b), rng.choice(["array", "map"]))


def test_layout_and_encode_errors():
    with pytest.raises(InvalidArgumentError):
        decode_batch(b"\x90", "yaml")
    with pytest.raises(InvalidArgumentError):
        encode_batch({"ts": 1})
    with pytest.raises(InvalidArgumentError):
        encode_batch(KVEventBatch(1.0, (BlockRemoved((1 << 70,), None),), 0))


# ---------------------------------------------------------------------- effects -> events -> batches


def test_to_kv_events_maps_effects_and_skips_the_rest():
    effects = (ClearPages(step=1, page_ids=(3,)),
               BlocksStored(hashes=(1, 2), parent_hash=0, token_ids=(1, 2, 3, 4), page_tokens=2, lora_id=3,
                            lora_name="x"),
               StepPlan(step=1),
               BlocksRemoved(hashes=(2,)))
    assert to_kv_events(effects, layout="array") == [BlockStored((1, 2), 0, (1, 2, 3, 4), 2, 3, "GPU", "x"),
                                                     BlockRemoved((2,), "GPU")]
    # the default, vLLM 0.33's: map events, the LoRA name in every block's extra keys
    assert to_kv_events(effects, medium=None) == [
        BlockStoredMap((1, 2), 0, (1, 2, 3, 4), 2, 3, None, "x", (("x",), ("x",))), BlockRemovedMap((2,), None)]
    wide = (BlocksStored(hashes=(b"\x01" * 16, -1), parent_hash=b"\xff" * 9, token_ids=(1, 2, 3, 4), page_tokens=2),
            BlocksRemoved(hashes=(b"ab",)))
    assert to_kv_events(wide) == [  # vLLM's fold: the last 8 bytes, big-endian; an int modulo 2**64
        BlockStoredMap((0x0101010101010101, 2**64 - 1), 2**64 - 1, (1, 2, 3, 4), 2, None, "GPU", None),
        BlockRemovedMap((0x6162,), "GPU")]
    assert to_kv_events(wide, hashes="raw")[1] == BlockRemovedMap((b"ab",), "GPU")
    with pytest.raises(InvalidArgumentError):
        to_kv_events(effects, hashes="u32")
    with pytest.raises(InvalidArgumentError):
        to_kv_events(effects, medium=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        to_kv_events(effects, layout="tuple")


_R = random.Random(19)
FOLD_CASES = [tuple(_R.randbytes(16) for _ in range(k)) for k in (1, 2, 3, 4, 5, 16, 17)] + [
    (b"a" * 8, b"b" * 24), (b"a" * 8, b"b" * 24, b"c" * 16), (b"a" * 16, b"b" * 8, b"c" * 24),
    (b"a" * 16, b"b" * 24, b"c" * 8, b"d" * 16), (b"a" * 16, b"a" * 16, b"b" * 8, b"c" * 24),  # 16 x k bytes
    (b"ab",), (b"x" * 20,), (b"y" * 64, b"z"), (1, 2), (-5,), (5, -7, 9), (2**63 - 1,), (b"a" * 16, 3), (3, b"a" * 16)]


@pytest.mark.parametrize("hashes", FOLD_CASES, ids=range(len(FOLD_CASES)))
def test_the_u64_fold_of_every_hash_shape(hashes):
    """The batcher's inlined fold (16-byte hashes in one call, lengths that only add up to 16 x k,
    ints, negative ints, mixes) equals vLLM's rule, core.hashing.to_u64, hash by hash."""
    want = tuple(int.from_bytes(h, "big") % 2**64 if type(h) is bytes else h % 2**64 for h in hashes)
    assert want == tuple(map(to_u64, hashes)) == to_u64_all(hashes)
    got = to_kv_events([BlocksRemoved(hashes=hashes),
                        BlocksStored(hashes=hashes, parent_hash=hashes[0], token_ids=(1,) * len(hashes),
                                     page_tokens=1)])
    assert got[0].block_hashes == got[1].block_hashes == want and got[1].parent_block_hash == want[0]


def _mixed_effects(rng: random.Random, n: int) -> list:
    """A stream whose shape changes from effect to effect: 16-byte publishes chained to the last
    block (the same bytes object, as the fold hands it on), evictions of 1-17 blocks, LoRA and
    int-hash publishes, odd hash lengths, empty events."""
    out: list = []
    last = None
    for _ in range(n):
        kind = rng.choice(("plain", "plain", "plain", "remove", "lora", "ints", "odd", "wide", "empty"))
        k = rng.randint(1, 4) if kind != "wide" else rng.choice((16, 17, 20))
        if kind == "ints":
            hs = tuple(rng.randint(-2**63, 2**63 - 1) for _ in range(k))
        elif kind == "odd":
            hs = tuple(rng.randbytes(rng.choice((8, 16, 24))) for _ in range(k))
        elif kind == "empty":
            hs = ()
        else:
            hs = tuple(rng.randbytes(16) for _ in range(k))
        if kind == "remove":
            out.append(BlocksRemoved(hashes=hs))
            continue
        out.append(BlocksStored(hashes=hs, parent_hash=last if rng.random() < 0.8 else rng.randbytes(16),
                                token_ids=(1,) * len(hs), page_tokens=1,
                                lora_name="adapter" if kind == "lora" else None))
        if hs:
            last = hs[-1]
    return out


def test_a_batch_of_changing_shapes_converts_as_each_effect_alone():
    """The batcher converts the common shape (16-byte hashes, no extra keys) in a lean loop and hands
    the first other effect, with the rest and the last publish's folded hash, to a loop that takes
    every shape: a whole batch must equal each of its effects converted alone, whichever loop
    takes which effect and wherever the hand-over falls."""
    rng = random.Random(24)
    for trial in range(200):
        effects = _mixed_effects(rng, rng.randint(1, 30))
        for layout in ("map", "array"):
            whole = to_kv_events(effects, layout=layout)
            alone = [e for eff in effects for e in to_kv_events([eff], layout=layout)]
            assert whole == alone, (trial, layout)


def test_one_batch_per_sealed_step_never_empty():
    out: list = []
    ticks = iter(range(100))
    b = KVEventBatcher(out.append, clock=lambda: float(next(ticks)))
    led = Ledger(Geometry(num_pages=8, page_tokens=2), observer=b.observe)
    assert b.pending == 1 and out == []  # AllBlocksCleared waits for the first seal
    led.seal_step(0)
    led.seal_step(1)  # nothing pending: no batch
    assert [x.events for x in out] == [(AllBlocksClearedMap(),)] and out[0].ts == 0.0
    led.reserve(1, 2)
    led.commit(1, 2, 2)
    led.seal_step(2)
    led.complete_step(2, 0)
    led.publish(1, [10, 11], [1, 2, 3, 4])
    assert len(out) == 1 and b.pending == 1
    assert b.flush() is out[1] and b.flush() is None
    assert out[1].events == (BlockStoredMap((10, 11), None, (1, 2, 3, 4), 2, None, "GPU", None),)
    assert (b.batches, b.events) == (2, 2)


def test_tenants_and_cache_salts_travel_in_extra_keys():
    """Equal prefixes of two tenants stay apart: each block carries its writer's tenant (from the
    ledger's events) and the cache salt the caller set for that request; a finished request's
    keys are forgotten, and a publish without any has no extra_keys at all."""
    out: list = []
    b = KVEventBatcher(out.append, clock=lambda: 0.0)
    led = Ledger(Geometry(num_pages=16, page_tokens=2), observer=b.observe)
    for r, tenant in ((1, "acme"), (2, "globex"), (3, None)):
        led.reserve(r, 2, tenant=tenant)
        led.commit(r, 0, 2)
    b.set_cache_salt(2, "s3cret")
    led.seal_step(0)
    led.complete_step(0, 0)
    for r in (1, 2, 3):
        led.publish(r, [10 * r, 10 * r + 1], [1, 2, 3, 4])  # the same tokens in every request
    b.flush()
    stored = [e for e in out[-1].events if type(e) is BlockStoredMap]
    assert [e.extra_keys for e in stored] == [(("acme",), ("acme",)), (("globex", "s3cret"),) * 2, None]
    led.finish(2)
    led.reserve(2, 1)  # the id again, a new request without a tenant: no keys carried over
    led.commit(2, 1, 1)
    led.seal_step(1)
    led.complete_step(1, 0)
    led.publish(2, [99], [5, 6])
    b.flush()
    assert [e.extra_keys for e in out[-1].events if type(e) is BlockStoredMap] == [None]
    with pytest.raises(InvalidArgumentError):
        b.set_cache_salt(1, b"salt")  # type: ignore[arg-type]


def test_auto_flush_off_and_bad_arguments():
    out: list = []
    b = KVEventBatcher(out.append, auto_flush=False)
    led = Ledger(Geometry(num_pages=8, page_tokens=2), observer=b.observe)
    led.seal_step(0)
    assert out == [] and b.pending == 1
    for kw in ({"layout": "json"}, {"medium": b"GPU"}, {"data_parallel_rank": -1}, {"data_parallel_rank": "0"}):
        with pytest.raises(InvalidArgumentError):
            KVEventBatcher(out.append, **kw)


def test_bench_workload_encodes_to_the_plain_lists_bytes():
    """bench/bench_kvevents.py's baseline is the same bytes (the bench checks it too, at full size)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    import bench_kvevents

    steps = bench_kvevents.make_steps(20)
    ours = bench_kvevents._kvledger(steps, True)
    assert ours == [msgspec.msgpack.encode(x) for x in bench_kvevents.as_lists(steps)]
    assert len(ours) == 20 and all(len(decode_batch(p).events) == bench_kvevents.EVENTS_PER_STEP for p in ours)
