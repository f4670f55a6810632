"""The seed's bug, reproduced on the CPU with a real attention kernel nobody here wrote.

FP8 (e4m3fn) K/V planes. A snapshot row writes 0x7F bytes (an e4m3fn NaN) through
its pages and is released; a request reserves those pages and commits them as its
block table, the last page only partially filled. torch's
``scaled_dot_product_attention`` with a boolean mask over the request's valid tokens:

* without the clear: masked attention computes 0 x NaN = NaN -> non-finite output;
* through the engine (the executor's real clear runs before the graph): finite, and
  equal to attention over the valid tokens alone.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kvledger import Geometry
from kvledger.engine import RankSpec, StepInputs, open_engine

G = Geometry(num_pages=8, page_tokens=4)
HEADS, DIM = 2, 16  # per rank (heads are sharded across the two ranks)
TOKENS = 6  # 2 pages of 4 tokens: the second page is a tail with 2 of 4 slots filled
NAN_BYTE = 0x7F


def fp8_planes():
    k = torch.zeros((G.num_pages, G.page_tokens, HEADS, DIM), dtype=torch.float8_e4m3fn)
    return [k, torch.zeros_like(k)]


def attend(planes, block_table, q, kv, cast):
    """The step graph's attention: write the request's tokens into its pages, gather the
    pages, attend with a mask over the valid tokens. Returns [heads, 1, dim]."""
    k_plane, v_plane = planes
    t = G.page_tokens
    for i in range(TOKENS):
        page, slot = block_table[i // t], i % t
        k_plane[page, slot] = kv[0, i].to(torch.float8_e4m3fn)
        v_plane[page, slot] = kv[1, i].to(torch.float8_e4m3fn)
    idx = torch.tensor(block_table)
    k = k_plane[idx].reshape(-1, HEADS, DIM).to(cast).transpose(0, 1)  # [heads, slots, dim]
    v = v_plane[idx].reshape(-1, HEADS, DIM).to(cast).transpose(0, 1)
    mask = torch.zeros(1, len(block_table) * t, dtype=torch.bool)
    mask[0, :TOKENS] = True
    return F.scaled_dot_product_attention(q.to(cast), k, v, attn_mask=mask).float()


def attention_reference(kv, q, cast):
    """Attention over the valid tokens alone (no padding, no mask), same FP8 rounding."""
    k = kv[0].to(torch.float8_e4m3fn).to(cast).transpose(0, 1)
    v = kv[1].to(torch.float8_e4m3fn).to(cast).transpose(0, 1)
    return F.scaled_dot_product_attention(q.to(cast), k, v).float()


@pytest.mark.asyncio
@pytest.mark.parametrize("cast", [torch.float32, torch.bfloat16])
async def test_released_row_bytes_poison_masked_attention_unless_cleared(cast):
    gen = torch.Generator().manual_seed(181)
    ranks = [fp8_planes(), fp8_planes()]
    # per rank, host inputs (the step's new tokens' K/V and the query) and device buffers
    host = [(torch.randn(2, TOKENS, HEADS, DIM, generator=gen), torch.randn(HEADS, 1, DIM, generator=gen))
            for _ in ranks]
    dev = [(torch.zeros(2, TOKENS, HEADS, DIM), torch.zeros(HEADS, 1, DIM)) for _ in ranks]
    outputs = {}

    def graph(ctx, step, inputs):
        kv, q = dev[ctx.rank]
        outputs[ctx.rank] = attend(ctx.planes, inputs.data, q, kv, cast)

    specs = [RankSpec(planes=planes, graph=graph) for planes in ranks]
    async with open_engine(G, ranks=specs, record=True, check=True) as engine:
        rows = await engine.alias_snapshot(9, 2)
        for planes in ranks:
            for plane in planes:
                plane.view(torch.uint8)[list(rows)] = NAN_BYTE  # written through the row alias
        await engine.release_snapshot(9)
        block_table = await engine.reserve(1, 2)
        assert sorted(block_table) == sorted(rows)  # the released pages come straight back
        listed = await engine.commit(1, 0, 2)
        assert sorted(listed) == sorted(rows)  # the ledger lists them for step 0

        # Without the clear: the same graph on the same bytes (a copy) -> non-finite.
        for rank, planes in enumerate(ranks):
            kv, q = host[rank]
            poisoned = attend([p.clone() for p in planes], block_table, q, kv, cast)
            assert not torch.isfinite(poisoned).all(), "0x7F tail bytes must poison masked attention"

        # Through the engine: input copies -> the executor's clear -> the graph.
        inputs = [StepInputs(copies=list(zip(host[r], dev[r], strict=True)), data=block_table)
                  for r in range(len(ranks))]
        result = await engine.run_step(0, inputs)
        assert sorted(result.clear_list) == sorted(rows)
        for rank, planes in enumerate(ranks):
            out = outputs[rank]
            assert torch.isfinite(out).all()
            kv, q = host[rank]
            torch.testing.assert_close(out, attention_reference(kv, q, cast), atol=2e-2, rtol=2e-2)
            # the tail slots past the last token were zeroed, not left as row bytes
            tail = planes[0][block_table[-1], TOKENS % G.page_tokens:]
            assert int(tail.view(torch.uint8).count_nonzero()) == 0
