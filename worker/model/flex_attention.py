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
one-token queries, tiled to divide the KV block; a few compiled variants per engine, bounded by a
test); elsewhere eagerly, which materialises scores over the whole pool: correct,
and the reference-equality tests run it, but slow (docs/benchmarks.md, "Attention backends").
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.torch_version import TorchVersion

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

# The KV tile flex's Triton kernels use by default: 64 tokens on Hopper and Ampere for bf16 at
# head dim 128 (torch/_inductor/template_heuristics). A block mask's KV block must be a multiple of
# the kernel's tile, and here it is the cache block (16 tokens by default), so on CUDA every call
# asks for a tile that divides the block (vLLM's flex backend does the same).
KV_TILE = 64
MIN_TILE = 16  # Triton's tl.dot needs 16 or more along each side of a tile

# Torch before 2.9 skips a decoding-kernel tile larger than the mask's KV block instead of
# shrinking it (no kernel is left: the first decode step fails); 2.9 shrinks it (as vLLM's flex
# backend checks, "supports_small_blocks"). Its own option cannot help there, so such a torch
# needs KV blocks of at least the default tile.
_SHRINKS_TILE = TorchVersion(torch.__version__) >= "2.9.0.dev0"

FlexFn = Callable[..., torch.Tensor]


def flex_unavailable(device: torch.device, block_size: int, *, shrinks_tile: bool = _SHRINKS_TILE) -> str | None:
    """Why the flex backend cannot run on ``device`` at ``block_size`` (None: it can)."""
    if device.type not in ("cuda", "cpu"):
        return f"flex_attention is not supported on {device.type}"
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "flex_attention on CUDA needs triton, which is not installed"
        if block_size % MIN_TILE:
            return f"flex's Triton kernels tile KV by multiples of {MIN_TILE}: block_size {block_size} is not one"
        if not shrinks_tile and block_size % KV_TILE:
            return (
                f"torch {torch.__version__}'s flex kernels need block_size to be a multiple of {KV_TILE} "
                f"(got {block_size}); raise block_size or use torch >= 2.9"
            )
    return None


def kernel_options(device: torch.device, block_size: int) -> dict[str, Any] | None:
    """The Triton tile options of a compiled call on ``device`` (None: flex's own, off CUDA)."""
    if device.type != "cuda":
        return None
    return {"BLOCK_N": math.gcd(KV_TILE, block_size)}


# The compiled variants one engine needs (measured by the churn test in
# tests/worker/test_flex_attention.py: four, whatever the layer kinds): decode with one row and
# with more (dynamo specialises a size of 1), prompt chunks traced once static then dynamic.
# Dynamo's default limit of 8 per function is raised to leave room: past the limit it falls back
# to eager flex, which on a GPU scores the whole pool (out of memory on the first long prompt).
RECOMPILE_LIMIT = 16


@functools.cache
def compiled_flex(backend: str) -> FlexFn:
    """flex_attention under ``torch.compile`` with ``backend`` (Inductor: the Triton kernels)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return cast(FlexFn, torch.compile(flex_attention, dynamic=True, backend=backend))


# Devices whose flex_attention runs compiled, with the torch.compile backend. CPU is left out,
# measured (docs/benchmarks.md, "Attention backends"): its compile takes over a minute per variant
# on 2 cores, and eager flex scores the whole pool. ``python -m worker.bench.attention
# --cpu-compile`` adds it; the churn test adds it with dynamo's eager backend (same guards, so the
# same variants, without Inductor's compile).
COMPILED_DEVICES: dict[str, str] = {"cuda": "inductor"}


def _flex_fn(device: torch.device) -> FlexFn:
    """Compiled where COMPILED_DEVICES says (on CUDA its Triton kernels are what makes it fast)."""
    backend = COMPILED_DEVICES.get(device.type)
    return cast(FlexFn, flex_attention) if backend is None else compiled_flex(backend)


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

    def _window(self, window: int | None) -> torch.Tensor:
        """The window as a 0-d device tensor (a fill kernel, no copy), ``pool_len`` for none: the
        mask_mod is then the same code and closure for windowed and full layers, so one compiled
        variant serves both (a Python int in its closure would be a constant: one variant each)."""
        return torch.full((), self.pool_len if window is None else window, device=self.block_pos.device)

    def decode_mask(self, window: int | None) -> BlockMask:
        mask = self._decode_masks.get(window)
        if mask is None:
            assert self.dec_table is not None and self.dec_lengths is not None
            table, lengths, block_pos, bs = self.dec_table, self.dec_lengths, self.block_pos, self.block_size
            span = self._window(window)

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                blk = kv // bs
                lp = block_pos[blk]
                pos = lp * bs + kv % bs
                length = lengths[b]
                row_blk = table[b, lp.clamp(0, table.shape[1] - 1)]
                return (lp >= 0) & (pos < length) & (row_blk == blk) & (pos >= length - span)

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
            _dynamic(mask, table, lengths)
        return mask

    def chunk_mask(self, window: int | None) -> BlockMask:
        mask = self._chunk_masks.get(window)
        if mask is None:
            assert self.chunk_of is not None and self.chunk_pos is not None and self.chunk_table is not None
            assert self.chunk_kv_num is not None and self.chunk_kv_indices is not None
            chunk_of, chunk_pos, table = self.chunk_of, self.chunk_pos, self.chunk_table
            block_pos, bs, span = self.block_pos, self.block_size, self._window(window)

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                blk = kv // bs
                lp = block_pos[blk]
                pos = lp * bs + kv % bs
                query_pos = chunk_pos[q]
                row_blk = table[chunk_of[q], lp.clamp(0, table.shape[1] - 1)]
                return (lp >= 0) & (pos <= query_pos) & (row_blk == blk) & (pos > query_pos - span)

            mask = self._chunk_masks[window] = BlockMask.from_kv_blocks(
                self.chunk_kv_num,
                self.chunk_kv_indices,
                BLOCK_SIZE=(Q_TILE, bs),
                mask_mod=mask_mod,
                seq_lengths=(chunk_of.shape[0], self.pool_len),
                **_FORWARD_ONLY,
            )
            _dynamic(mask, chunk_of, chunk_pos, table)
        return mask


def _dynamic(mask: BlockMask, *closure: torch.Tensor) -> None:
    """Mark every size of a step's mask and mask_mod tensors dynamic for ``torch.compile``: traced
    static first, as dynamo does unasked, each size a step varies (rows, table width, chunk
    tokens) cost one more compiled variant, and their number grew with the order steps came in."""
    for t in (mask.kv_num_blocks, mask.kv_indices, *closure):
        torch._dynamo.maybe_mark_dynamic(t, list(range(t.dim())))


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
        chunk_of = torch.cat([torch.full((c.num_tokens,), i, device=device) for i, c in enumerate(meta.chunks)])
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
    flex = functools.partial(
        _flex_fn(q.device),
        score_mod=_softcap_mod(softcap) if softcap else None,
        scale=scale,
        enable_gqa=q.shape[1] != kv_heads,
        kernel_options=kernel_options(q.device, bs),
    )
    out = q.new_empty(q.shape)
    if meta.decode is not None:
        row_q = q.index_select(0, meta.decode.token_index).unsqueeze(2)  # [B, H, 1, D]
        torch._dynamo.maybe_mark_dynamic(row_q, 0)
        attended = flex(row_q, keys, values, block_mask=plan.decode_mask(window))
        out.index_copy_(0, meta.decode.token_index, attended.squeeze(2))
    if plan.chunk_tokens is not None:
        chunk_q = q.index_select(0, plan.chunk_tokens).transpose(0, 1).unsqueeze(0)  # [1, H, Tc, D]
        torch._dynamo.maybe_mark_dynamic(chunk_q, 2)
        attended = flex(chunk_q, keys, values, block_mask=plan.chunk_mask(window))
        out.index_copy_(0, plan.chunk_tokens, attended[0].transpose(0, 1))
    return out
