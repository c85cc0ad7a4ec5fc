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

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from worker.model.gather import gather_blocks, head_major
from worker.ops.staging import to_device

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
    table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    shared_blocks: int,
    block_size: int,
    num_blocks: int,
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


@dataclass(frozen=True)
class SharedChunks:
    """Prompt chunks of a step that all start past a shared prefix, padded to one batch.

    C chunks, each padded to ``width`` query tokens (padding repeats a chunk's first token and is
    dropped); each chunk's own keys are its blocks after the prefix, padded to S tokens.
    """

    num_tokens: int  # P = shared blocks * block_size, <= every chunk's start
    head_blocks: torch.Tensor  # head_major(shared block ids)
    own_head_blocks: torch.Tensor  # head_major(own block tables [C, W_own], padded with block 0)
    token_index: torch.Tensor  # [C * width]: each padded query's position in the flattened step
    valid: torch.Tensor  # [N]: which of the C * width padded queries are real, in step order
    tokens: torch.Tensor  # [N]: their positions in the flattened step
    own_mask: torch.Tensor  # [1, C, width, 1, S] bool: causal over the chunk's own keys
    width: int
    own_len: int  # S


def shared_chunks(
    chunks: Sequence[tuple[int, int, int, Sequence[int]]],
    block_size: int,
    num_blocks: int,
    kv_heads: int,
    device: torch.device,
) -> SharedChunks | None:
    """Chunks (flattened start, tokens, KV start, block table) sharing leading blocks, or None if it doesn't pay."""
    if not cascade_pays(len(chunks), min(start for _, _, start, _ in chunks)):
        return None
    tables = [list(blocks) for *_, blocks in chunks]
    width_blocks = max(map(len, tables))
    table = torch.tensor([t + [0] * (width_blocks - len(t)) for t in tables], dtype=torch.long)
    start_list = [start for _, _, start, _ in chunks]
    starts = torch.tensor(start_list)
    shared = common_prefix_blocks(table, starts + 1, block_size)  # the prefix ends at or before every start
    prefix = shared * block_size
    if not shared or not cascade_pays(len(chunks), prefix):
        return None
    width = max(n for _, n, _, _ in chunks)
    index = [tok + min(i, n - 1) for tok, n, _, _ in chunks for i in range(width)]
    valid = [c * width + i for c, (_, n, _, _) in enumerate(chunks) for i in range(n)]
    tokens = [tok + i for tok, n, _, _ in chunks for i in range(n)]
    own = table[:, shared:]
    own_len = max(start + n for _, n, start, _ in chunks) - prefix
    parts = [index, valid, tokens, own.reshape(-1).tolist(), table[0, :shared].tolist(), start_list]
    flat = to_device(list(chain.from_iterable(parts)), torch.long, device)  # one copy, pinned: no sync
    t_index, t_valid, t_tokens, t_own, t_prefix, t_starts = flat.split([len(p) for p in parts])
    queries = t_starts[:, None] + torch.arange(width, device=device)[None, :]  # [C, width] KV positions
    keys = prefix + torch.arange(own_len, device=device)
    mask = keys[None, None, :] <= queries[:, :, None]
    return SharedChunks(
        prefix,
        head_major(t_prefix, kv_heads, num_blocks),
        head_major(t_own, kv_heads, num_blocks),
        t_index,
        t_valid,
        t_tokens,
        mask[None, :, :, None, :],
        width,
        own_len,
    )


def _two_part_attention(
    qf: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: tuple[torch.Tensor, int],
    own: tuple[torch.Tensor, int],
    own_mask: torch.Tensor,
    softcap: float | None,
    ws: dict[str, torch.Tensor],
) -> torch.Tensor:
    """qf [KVH, G, R, D] (pre-scaled; G groups of R query rows) -> [KVH, G, R, D].

    ``prefix`` = (head-major block rows, P): keys every group sees; ``own`` = (head-major block
    rows of all G groups, S): each group's own keys, ``own_mask`` over [KVH, G, R, S]. Both parts'
    scores sit side by side under one softmax, whose normaliser is the sum of the parts'
    exp-sums: the log-sum-exp merge of two partial softmaxes in one pass (fewer small ops than
    two partials and a merge, which matters on a busy CPU). The prefix is one GEMM per KV head
    over every group's queries. Float32 like SDPA's CPU accumulation.
    """
    kv_heads, groups, rows, dim = qf.shape
    (prefix_rows, p), (own_rows, s) = prefix, own
    kp = gather_blocks(k_cache, prefix_rows, ws, "kp").view(kv_heads, p, dim).float()
    vp = gather_blocks(v_cache, prefix_rows, ws, "vp").view(kv_heads, p, dim).float()
    ko = gather_blocks(k_cache, own_rows, ws, "k").view(kv_heads, groups, -1, dim)[:, :, :s].float()
    vo = gather_blocks(v_cache, own_rows, ws, "v").view(kv_heads, groups, -1, dim)[:, :, :s].float()
    prefix_scores = torch.matmul(qf.reshape(kv_heads, groups * rows, dim), kp.transpose(1, 2))
    scores = torch.cat((prefix_scores.view(kv_heads, groups, rows, p), torch.matmul(qf, ko.transpose(2, 3))), -1)
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores[..., p:].masked_fill_(~own_mask, float("-inf"))  # prefix keys: visible to every query
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., :p].reshape(kv_heads, groups * rows, p), vp)
    return out.view(kv_heads, groups, rows, dim).add_(torch.matmul(probs[..., p:], vo))


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared: SharedPrefix,
    workspace: dict[str, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, H, D] (one query per row) -> [B, H, D]: each row is a group of its ``rep`` query heads.

    GQA: the query heads of a KV head stay together, so K/V are never repeated.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    qf = (q.float() * scale).view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [KVH, B, rep, D]
    out = _two_part_attention(
        qf,
        k_cache,
        v_cache,
        (shared.head_blocks, shared.num_tokens),
        (shared.suffix_head_blocks, shared.suffix_len),
        shared.suffix_mask,
        softcap,
        workspace,
    )
    return out.transpose(0, 1).reshape(batch, heads, dim).to(q.dtype)


def cascade_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared: SharedChunks,
    workspace: dict[str, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D] (the whole step) -> [N, H, D] for the chunks' tokens, in ``shared.tokens`` order.

    Each chunk is a group of its padded queries x ``rep`` query heads; its own keys are causal.
    """
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[0]
    rep = heads // kv_heads
    chunks, width = shared.own_mask.shape[1], shared.width
    padded = q.index_select(0, shared.token_index).float().mul_(scale)  # [C * width, H, D]
    qf = padded.view(chunks, width, kv_heads, rep, dim).permute(2, 0, 1, 3, 4).reshape(kv_heads, chunks, -1, dim)
    mask = shared.own_mask.expand(-1, -1, -1, rep, -1).reshape(1, chunks, width * rep, -1)
    out = _two_part_attention(
        qf,
        k_cache,
        v_cache,
        (shared.head_blocks, shared.num_tokens),
        (shared.own_head_blocks, shared.own_len),
        mask,
        softcap,
        workspace,
    )
    out = out.view(kv_heads, chunks, width, rep, dim).permute(1, 2, 0, 3, 4).reshape(chunks * width, heads, dim)
    return out.index_select(0, shared.valid).to(q.dtype)
