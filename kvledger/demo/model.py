"""The demo's model: a tiny hybrid decoder (attention + a gated linear recurrence).

Random-initialised weights (seeded), a few layers, FP8 (``float8_e4m3fn``) paged KV.
Per layer, on each rank (heads are sharded across ranks, tensor-parallel style):

    x ─► rmsnorm ─┬─► q k v ─► write k, v into the request's pages (FP8)
                  │          └► attention: prefill  causal SDPA over the prompt (--prefix-cache:
                  │                                 over the block table's pages, shared ones
                  │                                 included, gathered and masked causally)
                  │                        decode   gather the request's whole pages by
                  │                                 block table (the partially filled tail
                  │                                 page included), cast to float32, SDPA
                  │                                 with a boolean mask over valid tokens
                  └─► rq rk rv ─► recurrence  S_t = a S_{t-1} + (1 - a) k_t^T v_t,
                                              y_t = q_t S_t   (one decay a per head)
    partial = attn @ Wo + y @ Wro   (row-parallel: summed across ranks, in rank order)
    x = x + allreduce(partial);  x = x + mlp(rmsnorm(x))            (replicated)
    logits = rmsnorm(x_last) @ embedding^T

Attention is torch's own ``scaled_dot_product_attention``, unmodified. The recurrent
state ``S`` (``[layers, heads, head_dim, head_dim]`` float32 per request and rank) is
what a hybrid model snapshots: ``snapshot_rows`` are float32 views of the very bytes
of KV pages (``plane.view(uint8)[page]`` reinterpreted), so writing a snapshot writes
the KV planes, as a CUDA VMM alias does on the GPU. Float32 bit patterns contain
bytes 0x7F and 0xFF: NaN when read back as e4m3fn.

Every per-request operation has the same shapes whatever physical pages the
request holds, and the gather follows the block table, so two runs of the same
requests give bit-identical logits on the CPU whichever pages they were given, as
long as the masked slots hold finite bytes (a masked slot adds exactly 0).
``prefill_span`` (``--prefix-cache``) keeps that property for prefixes: a span's
arithmetic depends on its tokens, its bounds and the bytes of the pages it reads,
so a prefix shared from another request's pages gives the logits of one computed
by the request itself. ``read_snapshot`` is the inverse of ``write_snapshot``.

Imports torch: import this module only where torch is wanted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvledger.core.errors import ConfigurationError

__all__ = ["FP8", "ModelConfig", "HybridDecoder", "RankModel", "fp8_nan_bytes"]

FP8 = torch.float8_e4m3fn
NAN_BYTES = (0x7F, 0xFF)  # the two e4m3fn NaN encodings (S.1111.111)
QUERY_CHUNK = 1024  # paged prefill attends in chunks of this many queries


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny decoder. ``heads`` must divide by the number of ranks."""

    vocab: int = 256
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    d_model: int = 64
    ffn: int = 128
    chunk: int = 128  # prefill recurrence chunk (tokens)

    def validate(self, ranks: int, page_tokens: int) -> None:
        """Raises ``ConfigurationError`` for sizes the model cannot use."""
        for name in ("vocab", "layers", "heads", "head_dim", "d_model", "ffn", "chunk"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ConfigurationError(f"model {name} must be a positive int, got {v!r}")
        if self.heads % ranks:
            raise ConfigurationError(f"model heads ({self.heads}) must divide by ranks ({ranks})")
        if (page_tokens * (self.heads // ranks) * self.head_dim) % 4:
            raise ConfigurationError("a page of one plane must hold whole float32 snapshot words")

    def plane_page_bytes(self, page_tokens: int, ranks: int) -> int:
        """Bytes of one page in one plane (K or V of one layer) on one rank."""
        return page_tokens * (self.heads // ranks) * self.head_dim

    def state_bytes(self, ranks: int) -> int:
        """Bytes of one request's recurrent state on one rank."""
        return 4 * self.layers * (self.heads // ranks) * self.head_dim * self.head_dim

    def snapshot_pages(self, page_tokens: int, ranks: int) -> int:
        """Pages a snapshot of the recurrent state needs (its rows span every plane)."""
        per_page = 2 * self.layers * self.plane_page_bytes(page_tokens, ranks)
        return -(-self.state_bytes(ranks) // per_page)


def fp8_nan_bytes(u8: torch.Tensor) -> int:
    """How many bytes of a uint8 tensor decode as NaN in float8_e4m3fn."""
    return int(((u8 == NAN_BYTES[0]) | (u8 == NAN_BYTES[1])).sum())


def _rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=1e-6)


class HybridDecoder:
    """The full model's weights, drawn from ``torch.Generator().manual_seed(seed)`` on the
    CPU (so every device gets the same numbers). ``shard(rank, world, device)`` gives a
    rank its slice."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        c = config
        g = torch.Generator().manual_seed(seed)
        hd = c.heads * c.head_dim

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        self.config = c
        self.embedding = torch.randn(c.vocab, c.d_model, generator=g)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(
                {
                    # q k v (attention) and rq rk rv (recurrence), per head
                    "w_in": w(c.d_model, 6, c.heads, c.head_dim, fan_in=c.d_model),
                    "w_o": w(c.heads, c.head_dim, c.d_model, fan_in=hd),
                    "w_ro": w(c.heads, c.head_dim, c.d_model, fan_in=hd),
                    "w_1": w(c.d_model, c.ffn, fan_in=c.d_model),
                    "w_2": w(c.ffn, c.d_model, fan_in=c.ffn),
                }
            )
        # one decay per head, from fast (0.875) to slow, as retention-style models do
        self.decay = torch.tensor([1.0 - 2.0 ** (-3 - (h % 5)) for h in range(c.heads)])

    def shard(self, rank: int, world: int, device: torch.device) -> RankModel:
        return RankModel(self, rank, world, device)


class RankModel:
    """One rank's slice of the model: heads ``[rank*H/world, (rank+1)*H/world)`` of the
    attention and of the recurrence; embedding and MLP replicated."""

    def __init__(self, model: HybridDecoder, rank: int, world: int, device: torch.device) -> None:
        c = model.config
        n = c.heads // world
        lo, hi = rank * n, (rank + 1) * n
        self.config = c
        self.rank = rank
        self.world = world
        self.heads = n
        self.device = device
        self.embedding = model.embedding.to(device)
        self.layers = []
        for lw in model.layers:
            self.layers.append(
                (
                    lw["w_in"][:, :, lo:hi].reshape(c.d_model, 6 * n * c.head_dim).contiguous().to(device),
                    lw["w_o"][lo:hi].reshape(n * c.head_dim, c.d_model).contiguous().to(device),
                    lw["w_ro"][lo:hi].reshape(n * c.head_dim, c.d_model).contiguous().to(device),
                    lw["w_1"].to(device),
                    lw["w_2"].to(device),
                )
            )
        a = model.decay[lo:hi].to(device)
        self.decay = a  # [heads]
        ch = torch.arange(c.chunk, device=device)
        diff = (ch[:, None] - ch[None, :]).to(torch.float32)
        # intra-chunk decay matrix D[h, i, j] = a_h^(i-j) for i >= j, else 0
        self._chunk_decay = torch.where(diff >= 0, a[:, None, None] ** diff.clamp(min=0),
                                        torch.zeros((), device=device))
        self._pow = a[:, None] ** torch.arange(c.chunk + 1, device=device, dtype=torch.float32)  # [heads, C+1]
        self._scale = 1.0 / math.sqrt(c.head_dim)

    # ------------------------------------------------------------------ helpers

    def new_state(self) -> torch.Tensor:
        """A fresh recurrent state ``[layers, heads, head_dim, head_dim]`` (zeros)."""
        c = self.config
        return torch.zeros(c.layers, self.heads, c.head_dim, c.head_dim, device=self.device)

    def _mlp(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(_rms(x) @ w1) @ w2

    def _split(self, h: torch.Tensor, w_in: torch.Tensor):
        """[T, d] -> six [heads, T, head_dim] tensors (q k v rq rk rv)."""
        t = h.shape[0]
        proj = (h @ w_in).view(t, 6, self.heads, self.config.head_dim).permute(1, 2, 0, 3)
        return proj.unbind(0)

    def _slots_for(self, positions: torch.Tensor, block_table: torch.Tensor, page_tokens: int) -> torch.Tensor:
        return block_table[positions // page_tokens] * page_tokens + positions % page_tokens

    # ------------------------------------------------------------------ prefill

    def prefill(
        self,
        tokens: torch.Tensor,
        planes: Sequence[torch.Tensor],
        block_table: torch.Tensor,
        state: torch.Tensor,
        allreduce: Callable[[torch.Tensor], torch.Tensor],
        checkpoints: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the prompt ``tokens`` ([P] int64): write its K/V into the request's pages
        (``block_table``, [pages] int64 on the device), fill ``state`` with the recurrent
        state after the prompt. Returns the logits of the last position ([vocab]) and the
        recurrent state after each of ``checkpoints`` (token counts in ``1..P``, ascending),
        what a hybrid model snapshots for prefix caching."""
        pt = planes[0].shape[1]
        p = tokens.shape[0]
        slots = self._slots_for(torch.arange(p, device=self.device), block_table, pt)
        x = self.embedding[tokens]
        at = [torch.empty_like(state) for _ in checkpoints]
        for li, (w_in, w_o, w_ro, w_1, w_2) in enumerate(self.layers):
            q, k, v, rq, rk, rv = self._split(_rms(x), w_in)
            k8, v8 = k.to(FP8), v.to(FP8)
            self._write(planes[2 * li], slots, k8)
            self._write(planes[2 * li + 1], slots, v8)
            att = F.scaled_dot_product_attention(
                q[None], k8.to(torch.float32)[None], v8.to(torch.float32)[None], is_causal=True
            )[0]
            y = self._recurrence_prefill(rq * self._scale, rk, rv, state[li], checkpoints, [a[li] for a in at])
            partial = att.transpose(0, 1).reshape(p, -1) @ w_o + y.transpose(0, 1).reshape(p, -1) @ w_ro
            x = self._mlp(x + allreduce(partial), w_1, w_2)
        return _rms(x[-1]) @ self.embedding.T, at

    def prefill_span(
        self,
        tokens: torch.Tensor,
        start: int,
        end: int,
        planes: Sequence[torch.Tensor],
        block_table: torch.Tensor,
        state: torch.Tensor,
        allreduce: Callable[[torch.Tensor], torch.Tensor],
        checkpoints: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill positions ``start..end-1`` of the prompt ``tokens`` ([P] int64) with paged
        attention (``--prefix-cache``): the K/V of positions before ``start`` are already in
        the pages of ``block_table`` (this request's, or shared ones another request wrote)
        and ``state`` is the recurrent state after them. Writes the span's K/V into its
        pages, then every query attends over the pages ``0..ceil(end / page_tokens)`` of the
        block table, gathered from the planes (the pages it did not write included), masked
        causally. Advances ``state`` over the span. Returns the logits of position ``end-1``
        and the states after ``checkpoints`` (absolute token counts in ``start+1..end``).

        The arithmetic of a span depends only on its tokens, its bounds and the bytes of
        the pages it reads, never on which physical pages they are, so a prefix computed
        by the request itself and one shared from another request give bit-identical results
        when the shared pages hold what the request would have written."""
        pt = planes[0].shape[1]
        pages = -(-end // pt)
        table = block_table[:pages]
        positions = torch.arange(start, end, device=self.device)
        slots = self._slots_for(positions, block_table, pt)
        x = self.embedding[tokens[start:end]]
        at = [torch.empty_like(state) for _ in checkpoints]
        local = [c - start for c in checkpoints]
        for li, (w_in, w_o, w_ro, w_1, w_2) in enumerate(self.layers):
            q, k, v, rq, rk, rv = self._split(_rms(x), w_in)
            kp, vp = planes[2 * li], planes[2 * li + 1]
            self._write(kp, slots, k.to(FP8))
            self._write(vp, slots, v.to(FP8))
            att = self._paged_attention(q, self._gather(kp, table, pages * pt), self._gather(vp, table, pages * pt),
                                        positions)
            y = self._recurrence_prefill(rq * self._scale, rk, rv, state[li], local, [a[li] for a in at])
            n = end - start
            partial = att.transpose(0, 1).reshape(n, -1) @ w_o + y.transpose(0, 1).reshape(n, -1) @ w_ro
            x = self._mlp(x + allreduce(partial), w_1, w_2)
        return _rms(x[-1]) @ self.embedding.T, at

    @staticmethod
    def _paged_attention(q: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """SDPA of ``q`` ([heads, n, dim], the queries at ``positions``) over gathered pages
        ([1, heads, keys, dim]), each query seeing the keys at or before its position, in
        chunks of ``QUERY_CHUNK`` queries (the mask and the scores of a 32k-token prompt
        never exist whole). Returns [heads, n, dim]."""
        n = q.shape[1]
        keys = torch.arange(kg.shape[2], device=q.device)
        out = []
        for c0 in range(0, n, QUERY_CHUNK):
            c1 = min(n, c0 + QUERY_CHUNK)
            mask = (keys[None, :] <= positions[c0:c1, None]).view(1, 1, c1 - c0, -1)
            out.append(F.scaled_dot_product_attention(q[None, :, c0:c1], kg, vg, attn_mask=mask)[0])
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    @staticmethod
    def _write(plane: torch.Tensor, slots: torch.Tensor, kv8: torch.Tensor) -> None:
        """Write ``kv8`` ([heads, T, head_dim] FP8) into token ``slots`` of ``plane``."""
        n, pt, h, d = plane.shape
        plane.view(torch.uint8).view(n * pt, h, d).index_copy_(0, slots, kv8.transpose(0, 1).view(torch.uint8))

    def _recurrence_prefill(self, q, k, v, s: torch.Tensor, checkpoints=(), into=()) -> torch.Tensor:
        """Chunked gated linear recurrence over [heads, T, dim]; ``s`` ([heads, dim, dim],
        the state) is updated in place, and copied into ``into[i]`` once ``checkpoints[i]``
        tokens are in (chunks end at every checkpoint). Returns y [heads, T, dim]."""
        c = self.config.chunk
        t = q.shape[1]
        a = self.decay[:, None, None]
        k = k * (1.0 - a)
        out = []
        cuts = sorted(set(range(c, t, c)).union(p for p in checkpoints if 0 < p < t)) + [t]
        want = dict(zip(checkpoints, into, strict=False))
        c0 = 0
        for c1 in cuts:
            qc, kc, vc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1]
            n = c1 - c0
            pw = self._pow
            y = ((qc @ kc.transpose(1, 2)) * self._chunk_decay[:, :n, :n]) @ vc
            y = y + (qc @ s) * pw[:, 1 : n + 1, None]
            kd = kc * pw[:, :n].flip(1)[:, :, None]  # a^(n-1-j)
            s.mul_(pw[:, n, None, None]).add_(kd.transpose(1, 2) @ vc)
            out.append(y)
            if c1 in want:
                want[c1].copy_(s)
            c0 = c1
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]

    # ------------------------------------------------------------------ decode

    def decode(
        self,
        token: int,
        position: int,
        planes: Sequence[torch.Tensor],
        pages: Sequence[int],
        block_table: torch.Tensor,
        state: torch.Tensor,
        allreduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One decode step: write the token's K/V at ``position`` in its page, attend over
        the request's whole pages (gathered by ``block_table``, tail page included) with a
        mask over positions ``0..position``, advance ``state``. ``pages`` is the block table
        as host ints, ``block_table`` the same on the device. Returns logits [vocab]."""
        c = self.config
        n_pages = block_table.shape[0]
        pt = planes[0].shape[1]
        span = n_pages * pt
        slot = pages[position // pt] * pt + position % pt
        valid = (torch.arange(span, device=self.device) <= position).view(1, 1, 1, span)
        x = self.embedding[token].view(1, -1)
        a = self.decay[:, None, None]
        for li, (w_in, w_o, w_ro, w_1, w_2) in enumerate(self.layers):
            q, k, v, rq, rk, rv = self._split(_rms(x), w_in)
            kp, vp = planes[2 * li], planes[2 * li + 1]
            h = kp.shape[2]
            kp.view(torch.uint8).view(-1, h, c.head_dim)[slot] = k[:, 0].to(FP8).view(torch.uint8)
            vp.view(torch.uint8).view(-1, h, c.head_dim)[slot] = v[:, 0].to(FP8).view(torch.uint8)
            kg = self._gather(kp, block_table, span)
            vg = self._gather(vp, block_table, span)
            att = F.scaled_dot_product_attention(q[None], kg, vg, attn_mask=valid)[0]  # [heads, 1, dim]
            s = state[li]
            s.mul_(a).add_((rk * (1.0 - a)).transpose(1, 2) @ rv)
            y = (rq * self._scale) @ s
            partial = att.reshape(1, -1) @ w_o + y.reshape(1, -1) @ w_ro
            x = self._mlp(x + allreduce(partial), w_1, w_2)
        return _rms(x[0]) @ self.embedding.T

    @staticmethod
    def _gather(plane: torch.Tensor, block_table: torch.Tensor, span: int) -> torch.Tensor:
        """The request's whole pages, in block-table order, as float32 [1, heads, span, dim]."""
        _, pt, h, d = plane.shape
        pages = torch.index_select(plane.view(torch.uint8), 0, block_table)
        return pages.view(FP8).to(torch.float32).view(span, h, d).transpose(0, 1)[None]

    # ------------------------------------------------------------------ snapshots

    @staticmethod
    def snapshot_rows(planes: Sequence[torch.Tensor], page_ids: Sequence[int]) -> list[torch.Tensor]:
        """The snapshot rows over ``page_ids``: for each page, for each plane, that page's
        bytes viewed as float32. Views, not copies: they alias the KV planes."""
        rows = []
        for p in page_ids:
            for plane in planes:
                rows.append(plane.view(torch.uint8)[p].view(-1).view(torch.float32))
        return rows

    @staticmethod
    def write_snapshot(state: torch.Tensor, rows: Sequence[torch.Tensor]) -> int:
        """Write ``state`` (flattened) through the rows; return the FP8 NaN bytes written."""
        flat = state.reshape(-1)
        at = 0
        nan = 0
        for row in rows:
            if at >= flat.numel():
                break
            n = min(row.numel(), flat.numel() - at)
            row[:n].copy_(flat[at : at + n])
            nan += fp8_nan_bytes(row[:n].view(torch.uint8))
            at += n
        return nan

    @staticmethod
    def read_snapshot(rows: Sequence[torch.Tensor], state: torch.Tensor) -> None:
        """Fill ``state`` from the rows (the inverse of ``write_snapshot``): a prefix hit
        restores the recurrent state after the shared prefix from the prefix's snapshot."""
        flat = state.view(-1)
        at = 0
        for row in rows:
            if at >= flat.numel():
                break
            n = min(row.numel(), flat.numel() - at)
            flat[at : at + n].copy_(row[:n])
            at += n

    @staticmethod
    def snapshot_matches(state: torch.Tensor, rows: Sequence[torch.Tensor]) -> bool:
        """Do the rows still hold ``state`` bit for bit (nothing overwrote a live row)?"""
        flat = state.reshape(-1)
        at = 0
        for row in rows:
            if at >= flat.numel():
                break
            n = min(row.numel(), flat.numel() - at)
            if not torch.equal(row[:n].view(torch.int32), flat[at : at + n].view(torch.int32)):
                return False
            at += n
        return True
