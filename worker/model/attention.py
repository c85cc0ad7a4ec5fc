"""The attention function the runner plugs into transformers: paged KV storage, flattened steps.

A step's tokens (decode rows and prompt chunks of many requests) arrive as ONE ``[1, T]``
sequence. ``paged_kv_attention`` writes every token's key/value into its slot of the block pool
(``slot = block * block_size + offset``), then attends: all one-token rows together in one call
(keys gathered through the padded block table, per-row length mask), each multi-token chunk
over its own blocks with a causal mask offset by the chunk's start. When the rows (or the
chunks) of a step share leading blocks — a cached system prompt, ``n > 1`` siblings — the
runner marks the split and ``worker.model.cascade`` attends that prefix once for all of them.
GQA is handled by packing the query heads of a KV head together, so K/V are never repeated.

Per-layer sliding windows (Mistral, Gemma 2/3 local layers) are extra mask terms, built once
per step per window size; attention logit softcapping (Gemma 2) replaces SDPA with an explicit
``tanh`` softmax. Both arrive as the keyword arguments transformers passes every attention
function (``sliding_window``, ``softcap``).

The runner hands transformers an already-prepared (empty) 4D mask, so transformers builds none
and this function applies causality and row lengths itself. Without the step metadata kwarg
(e.g. inside ``model.generate()``) it falls back to transformers' SDPA; the name is also
registered with SDPA's mask builder, so padded ``generate()`` batches stay exact there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from worker.model.cascade import SharedChunks, SharedPrefix, cascade_chunks, cascade_decode
from worker.model.flex_attention import FlexPlan, build_plan, flex_paged_attention, flex_unavailable
from worker.model.gather import gather_blocks

ATTENTION_NAME = "logitpool_paged_kv"
METADATA_KWARG = "logitpool_step"

# The backends a runner resolves ``EngineConfig.attention_backend`` to: "torch" gathers each row's
# blocks and runs SDPA (this module; the reference), "flex" reads the pool in place
# (worker.model.flex_attention).
AttentionBackend = Literal["torch", "flex"]


def resolve_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """``auto`` -> the measured best for the device (docs/benchmarks.md, "Attention backends"):
    torch, on CPU (where eager flex scores the whole pool) and, until flex is measured on a GPU,
    on CUDA too (flex there is opt-in). A backend that cannot run on ``device`` is refused with
    one line naming the field."""
    if name == "auto":
        name = "torch"
    if name == "flex":
        reason = flex_unavailable(device, block_size)
        if reason is not None:
            raise ValueError(f"attention_backend: flex cannot run on {device}: {reason}")
        return "flex"
    if name != "torch":
        raise ValueError(f"attention_backend: must be one of auto, torch, flex, got {name!r}")
    return "torch"


@dataclass(frozen=True)
class DecodeRows:
    """All one-token rows of a step, attended in one batched call."""

    token_index: torch.Tensor  # [B] int64: position of the row's token in the flattened step
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    head_blocks: torch.Tensor  # [KVH * B * max_blocks] int64: ``head_major(block_table)``
    lengths: torch.Tensor  # [B] int64: tokens in the row's context, its new token included
    max_len: int  # longest row context (KV positions read), <= max_blocks * block_size
    shared: SharedPrefix | None = None  # leading blocks common to all rows: cascade attention


@dataclass(frozen=True)
class PromptChunk:
    """A run of >1 tokens of one request, at KV positions [start_pos, start_pos + num_tokens)."""

    token_start: int  # first position in the flattened step
    num_tokens: int
    start_pos: int
    blocks: torch.Tensor  # [ceil((start_pos + num_tokens) / block_size)] int64: the blocks read
    head_blocks: torch.Tensor  # ``head_major(blocks)``


@dataclass
class StepMetadata:
    """Everything the attention function needs for one step; shared by all layers."""

    k_cache: Sequence[torch.Tensor]  # per layer [kv_heads, num_blocks, block_size, head_dim]
    v_cache: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each flattened token
    decode: DecodeRows | None
    chunks: tuple[PromptChunk, ...]
    # Gather buffers, owned by the runner and reused by every layer and step (see gather_blocks).
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)
    shared_chunks: SharedChunks | None = None  # all chunks past one shared prefix: cascade attention
    backend: AttentionBackend = "torch"
    _flex_plan: FlexPlan | None = None  # built by the first layer (flex backend)
    # Masks per sliding window (None = full causal), built by the first layer that needs them.
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _chunk_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, max_len] bool: key j visible iff j < length (and j >= length - window)."""
        mask = self._decode_masks.get(window)
        if mask is None:
            rows = self.decode
            assert rows is not None
            keys = torch.arange(rows.max_len, device=rows.lengths.device)[None, :]
            mask = keys < rows.lengths[:, None]
            if window is not None:
                mask &= keys >= (rows.lengths - window)[:, None]
            mask = self._decode_masks[window] = mask[:, None, None, :]
        return mask

    def chunk_mask(self, index: int, window: int | None) -> torch.Tensor:
        """[n, start + n] bool: causal, offset by the chunk's start (and within the window)."""
        mask = self._chunk_masks.get((index, window))
        if mask is None:
            chunk = self.chunks[index]
            end = chunk.start_pos + chunk.num_tokens
            device = chunk.blocks.device
            keys = torch.arange(end, device=device)[None, :]
            queries = torch.arange(chunk.start_pos, end, device=device)[:, None]
            mask = keys <= queries
            if window is not None:
                mask &= keys > queries - window
            self._chunk_masks[(index, window)] = mask
        return mask


def register_attention() -> str:
    """Register the paged-KV attention function and its fallback's mask builder; return the name.

    Idempotent. The registries are transformers' process-wide ones (that is their design).
    """
    AttentionInterface.register(ATTENTION_NAME, paged_kv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def prepared_mask_sentinel(device: torch.device) -> torch.Tensor:
    """An empty 4D mask: transformers returns a 4D mask as is, so no mask is built for a step."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Explicit softmax(cap * tanh(q k^T * scale / cap)) v, in float32 like the eager reference."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """GQA by packing: query [B, H, Q, D] with key/value [B, KVH, L, D] -> [B, H, Q, D].

    Query heads sharing a KV head become extra query rows of that head, so one call covers them
    without copying K/V. ``mask`` is [B, 1, Q, L] (or broadcastable) per query row.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    packed_q = query.reshape(batch, kv_heads, n_rep * q_len, dim)
    if n_rep > 1 and mask.shape[-2] > 1:
        mask = mask.repeat(1, 1, n_rep, 1)
    if softcap:
        scale = dim**-0.5 if scaling is None else scaling
        out = _softcapped_attention(packed_q, key, value, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(packed_q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, dim)


def _window(kwargs: dict) -> int | None:
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """All one-token rows of the step: q [T, H, D] -> [B, H, D] in ``token_index`` order.

    Cascade when the rows share leading blocks and no window of this layer cuts into them;
    else every row's context is gathered (head-major blocks: each (row, head) becomes one
    contiguous [L, D] matrix, as SDPA likes it) and attended in one packed call.
    """
    rows = meta.decode
    assert rows is not None
    row_q = q.index_select(0, rows.token_index)  # [B, H, D]
    kv_heads, _, _, dim = k_cache.shape
    if rows.shared is not None and (window is None or rows.max_len <= window):
        scale = dim**-0.5 if scaling is None else scaling
        return cascade_decode(row_q, k_cache, v_cache, rows.shared, meta.workspace, scale, softcap)
    batch, ws = rows.block_table.shape[0], meta.workspace
    keys = gather_blocks(k_cache, rows.head_blocks, ws, "k").view(kv_heads, batch, -1, dim)[:, :, : rows.max_len]
    values = gather_blocks(v_cache, rows.head_blocks, ws, "v").view(kv_heads, batch, -1, dim)[:, :, : rows.max_len]
    attended = _packed_attention(
        row_q.unsqueeze(2), keys.transpose(0, 1), values.transpose(0, 1), meta.decode_mask(window), scaling, softcap
    )
    return attended.squeeze(2)


def paged_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, KVH, T, D] (RoPE applied) -> ([1, T, H, D], None)."""
    meta: StepMetadata | None = kwargs.pop(METADATA_KWARG, None)
    if meta is None:
        if kwargs.get("softcap"):  # SDPA cannot softcap: the model's own eager path can
            eager = sys.modules[type(module).__module__].eager_attention_forward
            if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds its mask
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min
                )
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = cast(int, module.layer_idx)  # every transformers attention module carries its layer's index
    window, softcap = _window(kwargs), kwargs.get("softcap")
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    kv_heads, _num_blocks, _block_size, dim = k_cache.shape
    # Write first, then read everything back from the blocks: a row's own new token included.
    k_cache.view(kv_heads, -1, dim).index_copy_(1, meta.slot_mapping, key[0])
    v_cache.view(kv_heads, -1, dim).index_copy_(1, meta.slot_mapping, value[0])

    q = query[0].transpose(0, 1)  # [T, H, D]
    if meta.backend == "flex":
        if meta._flex_plan is None:
            meta._flex_plan = build_plan(meta)
        scale = dim**-0.5 if scaling is None else scaling
        out = flex_paged_attention(q, k_cache, v_cache, meta._flex_plan, meta, window, scale, softcap)
        return out.unsqueeze(0), None
    out = q.new_empty(q.shape)
    if meta.decode is not None:
        out.index_copy_(0, meta.decode.token_index, _decode(q, k_cache, v_cache, meta, window, scaling, softcap))
    shared = meta.shared_chunks
    if shared is not None and (window is None or shared.num_tokens + shared.own_len <= window):
        scale = dim**-0.5 if scaling is None else scaling
        out.index_copy_(0, shared.tokens, cascade_chunks(q, k_cache, v_cache, shared, meta.workspace, scale, softcap))
        return out.unsqueeze(0), None
    for i, chunk in enumerate(meta.chunks):
        end = chunk.start_pos + chunk.num_tokens
        stop = chunk.token_start + chunk.num_tokens
        chunk_q = q[chunk.token_start : stop].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        keys = gather_blocks(k_cache, chunk.head_blocks, meta.workspace, "k").view(1, kv_heads, -1, dim)[:, :, :end]
        values = gather_blocks(v_cache, chunk.head_blocks, meta.workspace, "v").view(1, kv_heads, -1, dim)[:, :, :end]
        attended = _packed_attention(chunk_q, keys, values, meta.chunk_mask(i, window)[None, None], scaling, softcap)
        out[chunk.token_start : stop] = attended[0].transpose(0, 1)
    return out.unsqueeze(0), None
