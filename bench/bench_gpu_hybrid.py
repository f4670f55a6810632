"""A hybrid model's clear on the card (issue 28): kvledger's ``KVCacheZeroer`` over an attention group
and a Mamba group overlaid on one cache, beside vLLM's own ``KVBlockZeroer`` on the same blocks.

The layout is vLLM 0.33's for a hybrid model with a uniform page
(``tests/vllm/test_vllm_zeroing.hybrid_views``): each of ``LAYERS`` cache
tensors is shared by one attention layer (``[B, H, N, C]`` bfloat16) and one Mamba
layer (a conv state and an SSM state packed from the start of the page, the rest
padding); ``NUM_BLOCKS`` blocks of ``PAGE_BYTES``. kvledger's zeroer is given both
groups' caches (the Mamba tuples included: vLLM's zeroer skips them) and finds one
whole-page plane per tensor. vLLM's zeroer is built by its own ``__init__`` over
the same planes (``bench_gpu_vllm.VllmZeroer``), so both zero exactly the same bytes
of the same block ids: lists of 16, 128 and 1024 random blocks.

Figures, all from this run on this card (``bench_gpu.Timer``: CUDA events around one
call on the model stream behind a sleep kernel, median of ``reps``):

    device us     kvledger triton, kvledger cuda, vLLM's KVBlockZeroer, one memset of
                  the same byte count (cuMemsetD8Async)
    vllm / ours   vLLM's device time over kvledger's triton backend (> 1: ours is faster)
    ours / memset the memset's time over ours (1.0: as fast as one contiguous memset)

Every backend's result is checked once per list (listed pages zero, nothing else
changed). ``python bench/bench_gpu_hybrid.py [--quick] [--json PATH]``; without CUDA it
prints that it skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS = 16
NUM_BLOCKS = 2048
HEADS, TOKENS, WIDTH = 8, 16, 256  # bfloat16 attention page: 64 KiB
PAGE_BYTES = HEADS * TOKENS * WIDTH * 2
LIST_SIZES = (16, 128, 1024)


def hybrid_cache(torch) -> tuple[Any, Any, dict[str, Any]]:
    """The backing buffer, its pages ``[L, B, PAGE_BYTES]`` and both groups' caches by layer name."""
    buf = torch.zeros(LAYERS * NUM_BLOCKS * PAGE_BYTES, dtype=torch.uint8, device="cuda")
    pages = buf.view(LAYERS, NUM_BLOCKS, PAGE_BYTES)
    caches: dict[str, Any] = {}
    conv_shape, ssm_shape = (4, 1024), (8, 64, 16)  # 8 KiB bfloat16 + 32 KiB float32 < the 64 KiB page
    conv_bytes = 4 * 1024 * 2
    ssm_bytes = 8 * 64 * 16 * 4
    assert conv_bytes + ssm_bytes < PAGE_BYTES
    for layer in range(LAYERS):
        page = pages[layer]
        caches[f"model.layers.{2 * layer}.self_attn"] = page.view(torch.bfloat16).view(NUM_BLOCKS, HEADS, TOKENS,
                                                                                      WIDTH)
        conv = page[:, :conv_bytes].view(torch.bfloat16).view(NUM_BLOCKS, *conv_shape)
        ssm = page[:, conv_bytes : conv_bytes + ssm_bytes].view(torch.float32).view(NUM_BLOCKS, *ssm_shape)
        caches[f"model.layers.{2 * layer + 1}.mixer"] = (conv, ssm)
    return buf, pages, caches


def _check(torch, pages, clear, ids, stream) -> int:
    """Fill the cache with 0xA5, clear ``ids`` once on ``stream``; bytes wrong (listed non-zero or
    unlisted changed)."""
    pages.fill_(0xA5)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        clear(ids)
    torch.cuda.synchronize()
    listed = torch.zeros(NUM_BLOCKS, dtype=torch.bool, device="cuda")
    listed[torch.tensor(ids, device="cuda")] = True
    per_block = pages.transpose(0, 1).reshape(NUM_BLOCKS, -1)
    return int(per_block[listed].count_nonzero()) + int((per_block[~listed] != 0xA5).sum())


def run(quick: bool = False) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from bench_gpu import Timer
    from bench_gpu_vllm import VllmZeroer

    from kvledger.executors import cuda_driver
    from kvledger.integrations.vllm.zeroing import KVCacheZeroer

    reps = 30 if quick else 100
    stream = torch.cuda.Stream()
    timer = Timer(torch, stream)
    buf, pages, caches = hybrid_cache(torch)
    ours = {name: KVCacheZeroer(caches, NUM_BLOCKS, backend=name, stream=stream) for name in ("triton", "cuda")}
    planes = ours["triton"].planes
    assert len(planes) == LAYERS, f"{len(planes)} planes for {LAYERS} shared tensors"
    vllm = VllmZeroer.over(planes)
    vllm.zeroer.warmup(len(planes))
    memset_buf = torch.empty(LAYERS * NUM_BLOCKS * PAGE_BYTES, dtype=torch.uint8, device="cuda")
    cu = cuda_driver.as_custream(stream.cuda_stream)
    ptr = int(memset_buf.data_ptr())
    clears = {"kvledger triton": ours["triton"].zero_block_ids, "kvledger cuda": ours["cuda"].zero_block_ids,
              "vLLM KVBlockZeroer": vllm.clear}
    res: dict = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": LAYERS,
                 "blocks": NUM_BLOCKS, "page_bytes": PAGE_BYTES, "reps": reps,
                 "vllm_files": ", ".join(vllm.paths.values())}
    rng = random.Random(28)
    rows = []
    wrong = 0
    for n in LIST_SIZES:
        ids = rng.sample(range(NUM_BLOCKS), n)
        nbytes = n * LAYERS * PAGE_BYTES
        for name, clear in clears.items():
            bad = _check(torch, pages, clear, ids, stream)
            res[f"{n}_{name}_wrong_bytes"] = bad
            wrong += bad
        dev = {name: timer(lambda clear=clear, ids=ids: clear(ids), reps)[0] for name, clear in clears.items()}
        dev["memset"] = timer(lambda nbytes=nbytes: cuda_driver.memset_d8_async(ptr, 0, nbytes, cu), reps)[0]
        for name, t in dev.items():
            res[f"{n}_{name.replace(' ', '_')}_device_us"] = t * 1e6
        ratio_vllm = dev["vLLM KVBlockZeroer"] / dev["kvledger triton"]
        ratio_memset = dev["memset"] / dev["kvledger triton"]
        res[f"{n}_vllm_over_ours"] = ratio_vllm
        res[f"{n}_memset_over_ours"] = ratio_memset
        rows.append((n, nbytes, dev, ratio_vllm, ratio_memset))
    res["wrong_bytes"] = wrong
    print(f"Hybrid clear on {res['card']}: {LAYERS} shared tensors (attention + Mamba states), {NUM_BLOCKS} blocks "
          f"of {PAGE_BYTES // 1024} KiB; device us, median of {reps}")
    print(f"{'ids':>5} {'MB':>7} {'ours triton':>12} {'ours cuda':>10} {'vLLM':>9} {'memset':>9} {'vLLM/ours':>10} "
          f"{'memset/ours':>12}")
    for n, nbytes, dev, rv, rm in rows:
        print(f"{n:>5} {nbytes / 1e6:>7.1f} {dev['kvledger triton'] * 1e6:>12.1f} {dev['kvledger cuda'] * 1e6:>10.1f} "
              f"{dev['vLLM KVBlockZeroer'] * 1e6:>9.1f} {dev['memset'] * 1e6:>9.1f} {rv:>10.2f} {rm:>12.2f}")
    print(f"bytes wrong after a clear (every backend, every list): {wrong}")
    del buf, memset_buf
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the figures here")
    opts = ap.parse_args(argv)
    res = run(opts.quick)
    if "skipped" in res:
        print(f"bench_gpu_hybrid: skipped: {res['skipped']}")
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 1 if res.get("wrong_bytes") else 0


if __name__ == "__main__":
    sys.exit(main())
