"""The attention function the runner plugs into transformers: slot KV storage, flattened steps.

A step's tokens (decode rows and prompt chunks of many requests) arrive as ONE ``[1, T]``
sequence. ``slot_kv_attention`` writes every token's key/value into its request's KV slot, then
attends: all one-token rows together in one SDPA call (per-row length mask), each multi-token
chunk with a causal mask offset by the chunk's start. GQA is handled by packing the query heads
of a KV head together, so keys and values are never repeated.

The runner hands transformers an already-prepared (empty) 4D mask, so transformers builds none
and this function applies causality and row lengths itself. Without the step metadata kwarg
(e.g. inside ``model.generate()``) it falls back to transformers' SDPA; the name is also
registered with SDPA's mask builder, so padded ``generate()`` batches stay exact there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "logitpool_slot_kv"
METADATA_KWARG = "logitpool_step"


@dataclass(frozen=True)
class DecodeRows:
    """All one-token rows of a step, attended in one batched call."""

    token_index: torch.Tensor  # [B] int64: position of the row's token in the flattened step
    slots: torch.Tensor  # [B] int64: KV slot of the row
    mask: torch.Tensor  # [B, 1, 1, max_len] bool: key j visible iff j < the row's length
    max_len: int  # longest row context (KV positions read)


@dataclass(frozen=True)
class PromptChunk:
    """A run of >1 tokens of one request, at KV positions [start_pos, start_pos + num_tokens)."""

    token_start: int  # first position in the flattened step
    num_tokens: int
    slot: int
    start_pos: int
    mask: torch.Tensor  # [num_tokens, start_pos + num_tokens] bool: causal, offset by start_pos


@dataclass(frozen=True)
class StepMetadata:
    """Everything the attention function needs for one step; shared by all layers."""

    k_cache: Sequence[torch.Tensor]  # per layer [slots, kv_heads, max_len, head_dim]
    v_cache: Sequence[torch.Tensor]
    write_slots: torch.Tensor  # [T] int64: KV slot of each flattened token
    write_pos: torch.Tensor  # [T] int64: KV position (= RoPE position) of each flattened token
    decode: DecodeRows | None
    chunks: tuple[PromptChunk, ...]


def register_attention() -> str:
    """Register the slot-KV attention function and its fallback's mask builder; return the name.

    Idempotent. The registries are transformers' process-wide ones (that is their design).
    """
    AttentionInterface.register(ATTENTION_NAME, slot_kv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def prepared_mask_sentinel(device: torch.device) -> torch.Tensor:
    """An empty 4D mask: transformers returns a 4D mask as is, so no mask is built for a step."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def _packed_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """GQA by packing: query [B, H, Q, D] with key/value [B, KVH, L, D] -> [B, H, Q, D].

    Query heads sharing a KV head become extra query rows of that head, so one SDPA call
    covers them without copying K/V. ``mask`` is [B, 1, Q, L] (or broadcastable) per query row.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    packed_q = query.reshape(batch, kv_heads, n_rep * q_len, dim)
    if n_rep > 1 and mask.shape[-2] > 1:
        mask = mask.repeat(1, 1, n_rep, 1)
    out = F.scaled_dot_product_attention(packed_q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, dim)


def slot_kv_attention(
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
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    # Write first, then read everything back from the slots: a row's own new token included.
    k_cache[meta.write_slots, :, meta.write_pos] = key[0].transpose(0, 1)
    v_cache[meta.write_slots, :, meta.write_pos] = value[0].transpose(0, 1)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode
        keys = k_cache[:, :, : rows.max_len].index_select(0, rows.slots)
        values = v_cache[:, :, : rows.max_len].index_select(0, rows.slots)
        row_q = q.index_select(0, rows.token_index).unsqueeze(2)  # [B, H, 1, D]
        out[rows.token_index] = _packed_sdpa(row_q, keys, values, rows.mask, scaling).squeeze(2)
    for chunk in meta.chunks:
        end = chunk.start_pos + chunk.num_tokens
        stop = chunk.token_start + chunk.num_tokens
        chunk_q = q[chunk.token_start : stop].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        keys = k_cache[chunk.slot, :, :end].unsqueeze(0)
        values = v_cache[chunk.slot, :, :end].unsqueeze(0)
        attended = _packed_sdpa(chunk_q, keys, values, chunk.mask[None, None], scaling)
        out[chunk.token_start : stop] = attended[0].transpose(0, 1)
    return out.unsqueeze(0), None
