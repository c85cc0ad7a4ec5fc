"""Cascade attention: decode rows that share leading KV blocks attend that prefix once.

Chat traffic (system prompts, few-shot templates) and ``n > 1`` siblings put the same cached
blocks at the head of many rows' block tables. Row-by-row attention gathers that prefix once per
row per layer, and on CPU the gather dominates a decode step. The vLLM v1 / FlashInfer cascade
splits each row's keys in two: the shared prefix, gathered once per layer and attended by every
row's queries together (one GEMM per KV head), and the row's own remaining blocks. Both parts'
scores share one softmax, whose normaliser is the sum of the parts' exp-sums: the log-sum-exp
merge of two partial softmaxes in one pass, so the result is exactly the softmax over the union
of the keys. Softcapping applies per score, so it stays exact. The runner
decides per step (``common_prefix_blocks``); a layer with a sliding window that could cut into
the prefix uses the ordinary path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.block_gather import gather_blocks, head_major

# When cascade pays, measured with ``python -m worker.bench.cascade`` (one layer, 12 heads / 4 KV
# heads, head_dim 64, 48 own tokens, 2 threads): 2 rows lose even at 768 shared tokens (0.6-0.96x),
# 4 rows break even at 128 and win 5x at 768, 8 rows win from 16 shared tokens (1.3x; 12x at 768),
# 32 rows 1.6x at 16 and 4-7x from 128. Rule: >= MIN_ROWS rows and (rows - 1) * shared tokens (the
# prefix copies a step no longer gathers) >= MIN_SAVED_TOKENS. Tests lower both to exercise it.
MIN_ROWS = 4
MIN_SAVED_TOKENS = 256


def cascade_pays(rows: int, shared_tokens: int) -> bool:
    return rows >= MIN_ROWS and (rows - 1) * shared_tokens >= MIN_SAVED_TOKENS


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

    Scores of the two parts, [KVH, B, rep, P] from one GEMM per KV head over the shared prefix and
    [KVH, B, rep, S] per row, sit side by side under one softmax; its normaliser is the sum of
    both parts' exp-sums (the log-sum-exp merge, done in one pass: fewer small ops than two
    partial softmaxes and a merge, which matters on a busy CPU). GQA: the ``rep`` query heads of a
    KV head stay together, so K/V are never repeated. Float32 like SDPA's CPU accumulation.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    rep = heads // kv_heads
    qf = (q.float() * scale).view(batch, kv_heads, rep, dim).transpose(0, 1)  # [KVH, B, rep, D]
    prefix, own = shared.num_tokens, shared.suffix_len
    kp = gather_blocks(k_cache, shared.head_blocks, workspace, "kp").view(kv_heads, prefix, dim).float()
    vp = gather_blocks(v_cache, shared.head_blocks, workspace, "vp").view(kv_heads, prefix, dim).float()
    ks = gather_blocks(k_cache, shared.suffix_head_blocks, workspace, "k").view(kv_heads, batch, -1, dim)[:, :, :own]
    vs = gather_blocks(v_cache, shared.suffix_head_blocks, workspace, "v").view(kv_heads, batch, -1, dim)[:, :, :own]
    prefix_scores = torch.matmul(qf.reshape(kv_heads, batch * rep, dim), kp.transpose(1, 2))
    scores = torch.cat(
        (prefix_scores.view(kv_heads, batch, rep, prefix), torch.matmul(qf, ks.float().transpose(2, 3))), dim=-1
    )
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores[..., prefix:].masked_fill_(~shared.suffix_mask, float("-inf"))  # every row sees its own token
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., :prefix].reshape(kv_heads, batch * rep, prefix), vp).view(kv_heads, batch, rep, dim)
    out += torch.matmul(probs[..., prefix:], vs.float())
    return out.transpose(0, 1).reshape(batch, heads, dim).to(q.dtype)
