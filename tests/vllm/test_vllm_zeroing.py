"""Zeroing vLLM block ids in tensors laid out like vLLM 0.33's per-layer KV caches.

vLLM allocates one zeroed backing buffer and views it per layer as ``[B, H, N, C]``
in one of six physical orders (``vllm/v1/kv_cache_layout.py``: logical
``[L, B, H, N, C]``, the value names the logical axis at each physical position).
These tests build such views by hand (no vLLM needed), fill every byte with a
nonzero pattern (FP8 NaN bytes among them), zero some block ids with each clear
backend through ``KVCacheZeroer``, and check byte for byte that exactly the
listed blocks' bytes, in every layer and head, are zero and nothing else moved.
The GPU tests do the same with CUDA tensors and the torch / cuda / triton backends, for
vLLM's attention layouts and for a hybrid model's Mamba state tuples overlaid on attention pages.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvledger import ConfigurationError, DuplicatePageError, PageOutOfRangeError  # noqa: E402
from kvledger.integrations.vllm.zeroing import KVCacheZeroer, kv_cache_planes  # noqa: E402

# vLLM 0.33's KVCacheLayout members: physical position -> logical axis of [L, B, H, N, C]
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_views(layout: str, *, layers=3, blocks=12, heads=2, tokens=4, width=8, dtype=torch.bfloat16,
               device="cpu", split=1):
    """One backing buffer and its per-layer ``[B * split, H, N / split, C]`` views, as vLLM lays them out
    (``split`` > 1: kernel blocks smaller than the manager's, vLLM's virtual block splitting)."""
    order = LAYOUTS[layout]
    logical = (layers, blocks, heads, tokens, width)
    el = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(layers * blocks * heads * tokens * width * el, dtype=torch.uint8, device=device)
    phys = buf.view(dtype).view(*[logical[a] for a in order])
    inverse = [order.index(a) for a in range(5)]
    cache = phys.permute(*inverse)  # logical [L, B, H, N, C]
    views = []
    for layer in range(layers):
        v = cache[layer]
        if split > 1:
            assert v.stride(0) == v.shape[2] * v.stride(2), "N must sit right inside B to split it"
            # kernel blocks of tokens / split: [B, H, N, C] -> [B * split, H, N / split, C] over the same memory
            b, h, n, c = v.shape
            sb, sh, sn, sc = v.stride()
            v = v.as_strided((b * split, h, n // split, c), (sb // split, sh, sn, sc))
        views.append(v)
    return buf, cache, views


def fill(buf):
    pattern = torch.arange(buf.numel(), dtype=torch.int64, device=buf.device) % 251 + 1
    pattern[::7] = 0x7F  # FP8 e4m3fn NaN bytes among them
    buf.copy_(pattern.to(torch.uint8))


def check_zeroed(cache, before, ids, blocks):
    """Block b's bytes are zero in every layer and head iff b was listed; the rest unchanged."""
    for b in range(blocks):
        got = cache[:, b].reshape(-1).view(torch.uint8) if cache[:, b].is_contiguous() else \
            cache[:, b].contiguous().reshape(-1).view(torch.uint8)
        want = before[:, b].contiguous().reshape(-1).view(torch.uint8)
        if b in ids:
            assert int(got.count_nonzero()) == 0, f"block {b} not zeroed"
        else:
            assert torch.equal(got, want), f"block {b} changed"


# virtual block splitting halves N, which vLLM does where N sits right inside B physically
CASES = [(layout, 1) for layout in sorted(LAYOUTS)] + [("LBNHC", 2), ("LHBNC", 2)]


@pytest.mark.parametrize("layout,split", CASES)
def test_zero_block_ids_in_every_vllm_layout(layout, split):
    buf, cache, views = vllm_views(layout, split=split)
    fill(buf)
    before = cache.clone()
    zeroer = KVCacheZeroer({f"layer.{i}": v for i, v in enumerate(views)}, 12)
    ids = [7, 0, 11, 3]
    zeroer.zero_block_ids(ids)
    check_zeroed(cache, before, set(ids), 12)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_planes_alias_the_cache_and_cover_it_once(layout):
    buf, _, views = vllm_views(layout, dtype=torch.float8_e4m3fn)
    planes = kv_cache_planes(views, 12)
    assert sum(p.numel() for p in planes) == buf.numel()  # every byte once, no copy
    for p in planes:
        assert p.is_contiguous() and p.dtype == torch.uint8 and p.shape[0] == 12
        assert buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel()
    # overlapping views (layers of two groups over the same bytes) give no second plane
    assert len(kv_cache_planes(views + views[:1], 12)) == len(planes)


def test_a_block_owns_its_whole_tile_when_only_some_layers_are_given():
    """Block-outermost layouts: one block's tile holds every layer; given some layers' views, the
    listed blocks' whole tiles are zeroed (vLLM's rule: a new block owns its whole tile)."""
    buf, cache, views = vllm_views("BLHNC")
    fill(buf)
    before = cache.clone()
    KVCacheZeroer(views[1:], 12).zero_block_ids([4, 9])
    check_zeroed(cache, before, {4, 9}, 12)


def hybrid_views(*, layers=2, blocks=10, heads=2, tokens=4, width=16, dtype=torch.float16, device="cpu",
                 states=(((3, 6), torch.float32), ((2, 4, 4), torch.float32))):
    """An attention group and a Mamba group overlaid on one buffer as vLLM 0.33 lays out a hybrid
    model with a uniform page (``get_kv_cache_config_from_groups``, layer-compact ``LBHNC``: both
    groups' layer ``l`` alias the same region; ``MambaBase.bind_kv_cache``: a Mamba layer's states
    packed from the start of its page, the rest of the page padding). Returns the buffer, each
    layer's pages ``[B, page]`` (uint8), the attention views and the Mamba layers' state tuples."""
    el = torch.empty((), dtype=dtype).element_size()
    page = heads * tokens * width * el
    state_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in states)
    assert state_bytes < page, "the Mamba states fit in the (padded) page"
    buf = torch.zeros(layers * blocks * page, dtype=torch.uint8, device=device)
    pages = buf.view(layers, blocks, page)
    attention = [pages[layer].view(dtype).view(blocks, heads, tokens, width) for layer in range(layers)]
    mamba = []
    for layer in range(layers):
        out, offset = [], 0
        for shape, dt in states:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            out.append(pages[layer][:, offset : offset + n].view(dt).view(-1, *shape))
            offset += n
        mamba.append(tuple(out))
    return buf, pages, attention, mamba


def check_pages(pages, before, ids):
    for b in range(pages.shape[1]):
        if b in ids:
            assert int(pages[:, b].count_nonzero()) == 0, f"block {b} not zeroed"
        else:
            assert torch.equal(pages[:, b], before[:, b]), f"block {b} changed"


@pytest.mark.parametrize("given", ["mamba", "attention", "both"])
def test_a_hybrid_models_overlaid_groups_zero_the_same_blocks_through_any_group(given):
    """Kills: Mamba state tuples refused or skipped (vLLM's KVBlockZeroer skips them), and a state's
    padding left holding another group's bytes (the next attention holder reads it under a mask)."""
    buf, pages, attention, mamba = hybrid_views()
    fill(buf)
    before = pages.clone()
    caches = {"attention": {f"attn.{i}": v for i, v in enumerate(attention)},
              "mamba": {f"mamba.{i}": v for i, v in enumerate(mamba)}}
    chosen = caches["attention"] | caches["mamba"] if given == "both" else caches[given]
    zeroer = KVCacheZeroer(chosen, 10)
    assert len(zeroer.planes) == 2  # one per layer: the groups share their tiles
    zeroer.zero_block_ids([7, 2, 9])
    check_pages(pages, before, {7, 2, 9})


def test_views_that_overlap_with_another_block_numbering_are_refused():
    """An overlay kvledger cannot map: a view whose block 0 is another view's block 1."""
    buf, pages, attention, _ = hybrid_views(blocks=10)
    shifted = buf[pages.shape[2]:].view(-1)[: 9 * pages.shape[2]].view(9, pages.shape[2])
    shifted = torch.cat([shifted, shifted[:1]])  # (a copy: another storage, fine)
    assert KVCacheZeroer([attention[0], shifted], 10)  # another storage: no overlap
    sneaky = pages[0][1:].as_strided((10, pages.shape[2]), (pages.shape[2], 1))
    with pytest.raises(ConfigurationError, match="overlay"):
        kv_cache_planes([attention[0], attention[1], sneaky], 10)


def test_a_view_whose_block_leaves_its_tile_is_refused():
    buf, pages, _, _ = hybrid_views(blocks=10)
    page = pages.shape[2]
    straddle = buf[page // 2 :].as_strided((10, page), (page, 1))  # each row crosses into the next tile
    with pytest.raises(ConfigurationError, match="past the tile"):
        kv_cache_planes([straddle], 10)


def test_bad_input_is_refused_before_any_byte_moves():
    buf, cache, views = vllm_views("LBHNC")
    fill(buf)
    before = buf.clone()
    zeroer = KVCacheZeroer(views, 12)
    with pytest.raises(PageOutOfRangeError):
        zeroer.zero_block_ids([1, 12])
    with pytest.raises(DuplicatePageError):
        zeroer.zero_block_ids([2, 2])
    assert torch.equal(buf, before)
    with pytest.raises(ConfigurationError, match="multiple of 5 blocks"):
        KVCacheZeroer(views, 5)
    with pytest.raises(ConfigurationError, match="positive"):
        kv_cache_planes(views, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cuda", "triton"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpu_zero_block_ids_on_the_model_stream(backend, layout):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if backend == "cuda":
        pytest.importorskip("cuda.bindings")
    if backend == "triton":
        pytest.importorskip("triton")
    blocks = 4096
    buf, cache, views = vllm_views(layout, layers=4, blocks=blocks, heads=8, tokens=16, width=128,
                                   dtype=torch.float8_e4m3fn, device="cuda", split=2 if layout == "LHBNC" else 1)
    fill(buf)
    before = cache.clone()
    stream = torch.cuda.Stream()
    # the model stream orders after the cache's writes, as vLLM's own stream does after the model's
    # (without it the clears raced fill and clone on the default stream: the H200 run of 2026-12-02
    # found the first-cleared blocks refilled with the torch and cuda backends)
    stream.wait_stream(torch.cuda.current_stream())
    zeroer = KVCacheZeroer(views, blocks, backend=backend, stream=stream)
    g = torch.Generator().manual_seed(23)
    ids = torch.randperm(blocks, generator=g)[:300].tolist()
    zeroer.zero_block_ids(ids)
    stream.synchronize()
    listed = torch.zeros(blocks, dtype=torch.bool, device="cuda")
    listed[torch.tensor(ids, device="cuda")] = True
    per_block = cache.transpose(0, 1).reshape(blocks, -1).view(torch.uint8)  # [B, every byte of the block]
    was = before.transpose(0, 1).reshape(blocks, -1).view(torch.uint8)
    assert int(per_block[listed].count_nonzero()) == 0
    assert torch.equal(per_block[~listed], was[~listed])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cuda", "triton"])
@pytest.mark.parametrize("given", ["mamba", "both"])
def test_gpu_zero_a_hybrid_models_mamba_states_on_the_model_stream(backend, given):
    """Issue 28 on the card: vLLM's Mamba state tuples (conv and SSM states, packed from the
    start of their page, the rest padding) overlaid on the attention group's pages are zeroed
    through the Mamba caches alone or both groups, with every backend, on the model stream;
    exactly the listed blocks' whole pages, in every layer, and nothing else."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if backend == "cuda":
        pytest.importorskip("cuda.bindings")
    if backend == "triton":
        pytest.importorskip("triton")
    blocks = 2048
    buf, pages, attention, mamba = hybrid_views(layers=4, blocks=blocks, heads=8, tokens=16, width=128,
                                                dtype=torch.bfloat16, device="cuda",
                                                states=(((3, 512), torch.bfloat16), ((8, 32, 16), torch.float32)))
    fill(buf)
    before = pages.clone()
    caches = {f"mamba.{i}": v for i, v in enumerate(mamba)}
    if given == "both":
        caches |= {f"attn.{i}": v for i, v in enumerate(attention)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the model stream after the cache's writes
    zeroer = KVCacheZeroer(caches, blocks, backend=backend, stream=stream)
    assert len(zeroer.planes) == 4  # one whole page per layer, however many groups name it
    g = torch.Generator().manual_seed(28)
    ids = torch.randperm(blocks, generator=g)[:200].tolist()
    zeroer.zero_block_ids(ids)
    stream.synchronize()
    listed = torch.zeros(blocks, dtype=torch.bool, device="cuda")
    listed[torch.tensor(ids, device="cuda")] = True
    per_block = pages.transpose(0, 1).reshape(blocks, -1)  # [B, every byte of the block's pages]
    was = before.transpose(0, 1).reshape(blocks, -1)
    assert int(per_block[listed].count_nonzero()) == 0
    assert torch.equal(per_block[~listed], was[~listed])
