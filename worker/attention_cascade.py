"""Cascade attention: decode rows that share leading KV blocks attend that prefix once.

Chat traffic (system prompts, few-shot templates) and ``n > 1`` siblings put the same cached
blocks at the head of many rows' block tables. Row-by-row attention gathers that prefix once per
row per layer, and on CPU the gather dominates a decode step. The vLLM v1 / FlashInfer cascade
splits each row's keys in two: the shared prefix, gathered once per layer and attended by every
row's queries together (one GEMM per KV head), and the row's own remaining blocks. Each part is
a partial softmax (output and log-sum-exp) and merging by log-sum-exp is exact: it is the softmax
over the union of the keys. Softcapping applies per score, so it stays exact per part. The runner
decides per step (``common_prefix_blocks``); a layer with a sliding window that could cut into
the prefix uses the ordinary path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.block_gather import gather_blocks, head_major

# Below this many shared blocks (or 2 rows) the ordinary path is as fast: measured with
# ``python -m worker.bench.cascade`` (32 rows, 12 heads / 4 KV heads, head_dim 64, 2 threads).
MIN_SHARED_BLOCKS = 4


@dataclass(frozen=True)
class SharedPrefix:
    """The leading blocks common to every decode row of a step, and each row's remainder."""

    num_tokens: int  # P = shared blocks * block_size; < every row's length, so both parts are non-empty
    head_blocks: torch.Tensor  # head_major(shared block ids): gathered once per layer
    suffix_head_blocks: torch.Tensor  # head_major(block_table[:, shared:]) for all rows
    suffix_mask: torch.Tensor  # [1, B, 1, S] bool: own key j visible iff P + j < row length
    suffix_len: int  # S = longest row context - P


def common_prefix_blocks(table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> int:
    """Leading columns of the block table [B, W] equal in every row, each row keeping >= 1 own token.

    Vectorised over the table; the cap by the shortest row also keeps a row's padding (block 0)
    out of the prefix.
    """
    if table.shape[0] < 2 or table.shape[1] == 0:
        return 0
    same = (table == table[:1]).all(dim=0)
    run = int(same.to(torch.int32).cumprod(0).sum())
    return min(run, (int(lengths.min()) - 1) // block_size)


def shared_prefix(
    table: torch.Tensor, lengths: torch.Tensor, max_len: int, shared_blocks: int, block_size: int, num_blocks: int,
    kv_heads: int,
) -> SharedPrefix:
    """The cascade split of decode rows (block table [B, W], context lengths [B]) sharing ``shared_blocks``."""
    prefix = shared_blocks * block_size
    own = torch.arange(max_len - prefix, device=table.device)
    return SharedPrefix(
        prefix,
        head_major(table[0, :shared_blocks], kv_heads, num_blocks),
        head_major(table[:, shared_blocks:].reshape(-1), kv_heads, num_blocks),
        (own[None, :] < (lengths - prefix)[:, None])[None, :, None, :],
        max_len - prefix,
    )


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the given keys only: (output [..., Q, D], log-sum-exp [..., Q, 1]).

    Float32 throughout (the caller casts back), like SDPA's CPU accumulation. Every query must see
    at least one key, or its log-sum-exp is -inf and the merge NaN.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).exp_()  # one exp pass; logsumexp would take a second
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(total), total.log_().add_(peak)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """The softmax over keys A and B together from the two partial results (exact)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp_() + out_b * (lse_b - lse).exp_()


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared: SharedPrefix,
    workspace: dict[str, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, H, D] (one query per row) -> [B, H, D], attending prefix + each row's own blocks.

    GQA: the ``rep`` query heads of a KV head stay together, so K/V are never repeated; the
    prefix GEMM takes all rows' queries of a KV head as one [B * rep, D] matrix.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    rep = heads // kv_heads
    qf = q.float().view(batch, kv_heads, rep, dim).transpose(0, 1)  # [KVH, B, rep, D]
    prefix = shared.num_tokens
    kp = gather_blocks(k_cache, shared.head_blocks, workspace, "kp").view(kv_heads, prefix, dim).float()
    vp = gather_blocks(v_cache, shared.head_blocks, workspace, "vp").view(kv_heads, prefix, dim).float()
    out_p, lse_p = partial_attention(qf.reshape(kv_heads, batch * rep, dim), kp, vp, None, scale, softcap)
    own = shared.suffix_len
    ks = gather_blocks(k_cache, shared.suffix_head_blocks, workspace, "k").view(kv_heads, batch, -1, dim)
    vs = gather_blocks(v_cache, shared.suffix_head_blocks, workspace, "v").view(kv_heads, batch, -1, dim)
    out_s, lse_s = partial_attention(qf, ks[:, :, :own].float(), vs[:, :, :own].float(), shared.suffix_mask,
                                     scale, softcap)
    shape = (kv_heads, batch, rep, dim)
    out = merge_partials(out_p.view(shape), lse_p.view(*shape[:3], 1), out_s, lse_s)
    return out.transpose(0, 1).reshape(batch, heads, dim).to(q.dtype)
