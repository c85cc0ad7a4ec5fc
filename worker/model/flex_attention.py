"""The ``flex`` attention backend: attend the paged KV pool in place, no per-step gather copy.

The ``torch`` backend (``worker.model.attention``) copies every row's blocks into a contiguous
buffer each layer and step, then runs SDPA: on a GPU that copy moves the step's whole KV twice
more than the attention itself reads it. Here a layer's pool ``[KVH, num_blocks, bs, D]`` is
viewed, without a copy, as ONE long sequence per KV head (``[1, KVH, num_blocks * bs, D]``) and
``torch.nn.attention.flex_attention`` reads it through a ``BlockMask`` whose KV block is the KV
block: a query tile visits exactly the physical blocks listed in its row's block table.

The mask_mod then decides per slot, from three step-wide tensors: ``block_pos`` (the logical
index each physical block has in the step's tables: a block sits at one position in every table
that lists it, since prefix caching shares a block only at the position its keys were rotated
for), the row's table (the slot's block must be the row's block at that logical position: the
block mask alone would do on a kernel that honours sparsity, eager flex evaluates the whole
pool) and the query's position (causal, sliding window). Softcapping is a score_mod.

Decode rows are one flex call with the rows as the batch (queries ``[B, H, 1, D]`` against the
pool broadcast over the batch, the block table as ``kv_indices``); the step's prompt chunks are a
second call over their tokens flattened (``[1, H, T_chunks, D]``), each query tile visiting the
union of its chunks' blocks. GQA is flex's ``enable_gqa``. The plan (indices, block masks per
window) is built once per step, on the device, by the first layer that needs it.

On CUDA flex_attention runs ``torch.compile``'d (its Triton kernels, with the decoding kernel for
one-token queries); elsewhere eagerly, which materialises scores over the whole pool: correct,
and the reference-equality tests run it, but slow (docs/benchmarks.md, "Attention backends").
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

if TYPE_CHECKING:
    from worker.model.attention import StepMetadata

# Forward only: the q-side block index serves the backward pass. ``compute_q_blocks`` came in
# torch 2.9; a GPU host running this tree on its own older torch builds the index unasked
# (Any: keyword arguments of a signature that differs between torch versions).
_FORWARD_ONLY: dict[str, Any] = (
    {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {}
)

# Query tile of the chunk call's block mask (flex's default sparse block; its kernels tile by it).
Q_TILE = 128

FlexFn = Callable[..., torch.Tensor]


def flex_unavailable(device: torch.device) -> str | None:
    """Why the flex backend cannot run on ``device`` (None: it can)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "flex_attention on CUDA needs triton, which is not installed"
    if device.type not in ("cuda", "cpu"):
        return f"flex_attention is not supported on {device.type}"
    return None


@cache
def _compiled() -> FlexFn:
    return cast(FlexFn, torch.compile(flex_attention, dynamic=True))


# Devices whose flex_attention runs compiled. CPU is left out, measured (docs/benchmarks.md,
# "Attention backends"): its compile takes over a minute per variant on 2 cores, and eager flex
# scores the whole pool. ``python -m worker.bench.attention --cpu-compile`` adds it.
COMPILED_DEVICES: set[str] = {"cuda"}


def _flex_fn(device: torch.device) -> FlexFn:
    """Compiled where COMPILED_DEVICES says (on CUDA its Triton kernels are what makes it fast)."""
    return _compiled() if device.type in COMPILED_DEVICES else cast(FlexFn, flex_attention)


def _softcap_mod(cap: float) -> Callable[..., torch.Tensor]:
    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


@dataclass
class FlexPlan:
    """The step's flex indices, shared by every layer; block masks built once per window."""

    block_size: int
    pool_len: int  # num_blocks * block_size: the pool viewed as one sequence
    block_pos: torch.Tensor  # [num_blocks + 1] int64: logical index of each physical block, -1 = unlisted
    # Decode rows (None without any).
    dec_table: torch.Tensor | None  # [B, W] int64, the padding -1
    dec_lengths: torch.Tensor | None  # [B] int64
    # Prompt chunks, flattened (None without any).
    chunk_tokens: torch.Tensor | None = None  # [Tc] int64: positions in the flattened step
    chunk_of: torch.Tensor | None = None  # [Tc] int64: the token's chunk
    chunk_pos: torch.Tensor | None = None  # [Tc] int64: the token's KV position
    chunk_table: torch.Tensor | None = None  # [C, Wc] int64, the padding -1
    chunk_kv_num: torch.Tensor | None = None  # [1, 1, ceil(Tc / Q_TILE)] int32
    chunk_kv_indices: torch.Tensor | None = None  # [1, 1, ceil(Tc / Q_TILE), num_blocks] int32
    _decode_masks: dict[int | None, BlockMask] = field(default_factory=dict)
    _chunk_masks: dict[int | None, BlockMask] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> BlockMask:
        mask = self._decode_masks.get(window)
        if mask is None:
            assert self.dec_table is not None and self.dec_lengths is not None
            table, lengths, block_pos, bs = self.dec_table, self.dec_lengths, self.block_pos, self.block_size
            last = table.shape[1] - 1

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                blk = kv // bs
                lp = block_pos[blk]
                pos = lp * bs + kv % bs
                length = lengths[b]
                ok = (lp >= 0) & (pos < length) & (table[b, lp.clamp(0, last)] == blk)
                return ok & (pos >= length - window) if window is not None else ok

            rows = table.shape[0]
            num = (-(-lengths // bs)).to(torch.int32).view(rows, 1, 1)
            # kv_indices spans every KV block of the (pool) sequence, as flex requires; the tail is unread.
            indices = torch.zeros((rows, 1, 1, self.pool_len // bs), dtype=torch.int32, device=table.device)
            indices[:, 0, 0, : table.shape[1]] = table.clamp(min=0)
            mask = self._decode_masks[window] = BlockMask.from_kv_blocks(
                num,
                indices,
                BLOCK_SIZE=(Q_TILE, bs),
                mask_mod=mask_mod,
                seq_lengths=(1, self.pool_len),
                **_FORWARD_ONLY,
            )
        return mask

    def chunk_mask(self, window: int | None) -> BlockMask:
        mask = self._chunk_masks.get(window)
        if mask is None:
            assert self.chunk_of is not None and self.chunk_pos is not None and self.chunk_table is not None
            assert self.chunk_kv_num is not None and self.chunk_kv_indices is not None
            chunk_of, chunk_pos, table = self.chunk_of, self.chunk_pos, self.chunk_table
            block_pos, bs, last = self.block_pos, self.block_size, self.chunk_table.shape[1] - 1

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                blk = kv // bs
                lp = block_pos[blk]
                pos = lp * bs + kv % bs
                query_pos = chunk_pos[q]
                ok = (lp >= 0) & (pos <= query_pos) & (table[chunk_of[q], lp.clamp(0, last)] == blk)
                return ok & (pos > query_pos - window) if window is not None else ok

            mask = self._chunk_masks[window] = BlockMask.from_kv_blocks(
                self.chunk_kv_num,
                self.chunk_kv_indices,
                BLOCK_SIZE=(Q_TILE, bs),
                mask_mod=mask_mod,
                seq_lengths=(chunk_of.shape[0], self.pool_len),
                **_FORWARD_ONLY,
            )
        return mask


def build_plan(meta: StepMetadata) -> FlexPlan:
    """The step's plan from its metadata's device tensors (a few small kernels, no host sync)."""
    k_cache = meta.k_cache[0]
    _kvh, num_blocks, bs, _dim = k_cache.shape
    device = k_cache.device
    block_pos = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=device)
    dec_table = None
    rows = meta.decode
    if rows is not None:
        width = rows.block_table.shape[1]
        cols = torch.arange(width, device=device)
        valid = cols[None, :] < (-(-rows.lengths // bs))[:, None]
        dec_table = torch.where(valid, rows.block_table, -1)
        # Padding scatters into the spare last entry, which no slot reads.
        block_pos.scatter_(
            0, torch.where(valid, rows.block_table, num_blocks).view(-1), cols.expand_as(valid).reshape(-1)
        )
    plan = FlexPlan(bs, num_blocks * bs, block_pos, dec_table, None if rows is None else rows.lengths)
    if meta.chunks:
        tables = [c.blocks for c in meta.chunks]
        for blocks in tables:
            block_pos[blocks] = torch.arange(blocks.shape[0], device=device)
        chunk_table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True, padding_value=-1)
        tokens = torch.cat(
            [torch.arange(c.token_start, c.token_start + c.num_tokens, device=device) for c in meta.chunks]
        )
        chunk_pos = torch.cat(
            [torch.arange(c.start_pos, c.start_pos + c.num_tokens, device=device) for c in meta.chunks]
        )
        sizes = torch.tensor([c.num_tokens for c in meta.chunks], device=device)
        chunk_of = torch.repeat_interleave(torch.arange(len(tables), device=device), sizes, output_size=tokens.shape[0])
        # Each query tile visits the union of its tokens' visible blocks: a dense [tiles, blocks] map.
        cand = chunk_table[chunk_of]  # [Tc, Wc]
        visible = (torch.arange(cand.shape[1], device=device)[None, :] <= (chunk_pos // bs)[:, None]) & (cand >= 0)
        tiles = -(-tokens.shape[0] // Q_TILE)
        dense = torch.zeros((tiles, num_blocks + 1), dtype=torch.bool, device=device)
        tile_of = (torch.arange(tokens.shape[0], device=device) // Q_TILE)[:, None].expand_as(cand)
        dense[tile_of, torch.where(visible, cand, num_blocks)] = True
        dense = dense[:, :num_blocks]
        kv_num = dense.sum(-1, dtype=torch.int32).view(1, 1, tiles)
        kv_indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        plan.chunk_tokens, plan.chunk_of, plan.chunk_pos, plan.chunk_table = tokens, chunk_of, chunk_pos, chunk_table
        plan.chunk_kv_num, plan.chunk_kv_indices = kv_num, kv_indices.view(1, 1, tiles, -1)
    return plan


def flex_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: FlexPlan,
    meta: StepMetadata,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D] (the step's tokens, their K/V already in the pool) -> [T, H, D]."""
    kv_heads, num_blocks, bs, dim = k_cache.shape
    keys = k_cache.view(1, kv_heads, num_blocks * bs, dim)
    values = v_cache.view(1, kv_heads, num_blocks * bs, dim)
    flex = _flex_fn(q.device)
    gqa = q.shape[1] != kv_heads
    score_mod = _softcap_mod(softcap) if softcap else None
    out = q.new_empty(q.shape)
    if meta.decode is not None:
        row_q = q.index_select(0, meta.decode.token_index).unsqueeze(2)  # [B, H, 1, D]
        attended = flex(
            row_q, keys, values, score_mod=score_mod, block_mask=plan.decode_mask(window), scale=scale, enable_gqa=gqa
        )
        out.index_copy_(0, meta.decode.token_index, attended.squeeze(2))
    if plan.chunk_tokens is not None:
        chunk_q = q.index_select(0, plan.chunk_tokens).transpose(0, 1).unsqueeze(0)  # [1, H, Tc, D]
        attended = flex(
            chunk_q, keys, values, score_mod=score_mod, block_mask=plan.chunk_mask(window), scale=scale, enable_gqa=gqa
        )
        out.index_copy_(0, plan.chunk_tokens, attended[0].transpose(0, 1))
    return out
