"""Cascade attention (shared prefix once, own blocks per row, log-sum-exp merge) is exact.

Oracle: plain per-row attention in float64, reading each row's context position by position
through its block table, repeating KV heads for GQA, softcap and sliding window as the eager
reference does. Block tables are random: a shared run of leading blocks, own blocks per row in a
shuffled pool, rows of different lengths padded with block 0 (which may itself be a shared block).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.model import cascade as attention_cascade
from worker.model.attention import DecodeRows, PromptChunk, StepMetadata, _decode, paged_kv_attention
from worker.model.cascade import common_prefix_blocks, shared_chunks, shared_prefix
from worker.model.gather import head_major


def reference_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: list[int],
    length: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """One row, float64: q [H, D] -> [H, D] over positions 0..length-1 of its block table."""
    kv_heads, _, bs, _ = k_cache.shape
    rep = q.shape[0] // kv_heads
    keys = torch.stack([k_cache[:, table[p // bs], p % bs] for p in range(length)], dim=1).double()
    values = torch.stack([v_cache[:, table[p // bs], p % bs] for p in range(length)], dim=1).double()
    keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)  # [H, L, D]
    scores = torch.einsum("hd,hld->hl", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[:, : max(0, length - window)] = -math.inf
    return torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), values)


def reference_common_prefix(tables: list[list[int]], lengths: list[int], bs: int) -> int:
    run = 0
    while all(run < len(t) for t in tables) and all(t[run] == tables[0][run] for t in tables):
        run += 1
    return min(run, (min(lengths) - 1) // bs)


@st.composite
def decode_steps(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    rep = draw(st.sampled_from([1, 2, 3]))
    dim = draw(st.sampled_from([4, 8, 16]))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    batch = draw(st.integers(2, 6))
    shared = draw(st.integers(0, 5))
    own = draw(st.lists(st.integers(1, 3 * bs + 2), min_size=batch, max_size=batch))
    own_blocks = [-(-n // bs) for n in own]
    num_blocks = shared + sum(own_blocks) + draw(st.integers(0, 3))
    ids = draw(st.permutations(range(num_blocks)))
    prefix, rest = list(ids[:shared]), list(ids[shared:])
    tables = []
    for n in own_blocks:
        tables.append(prefix + rest[:n])
        rest = rest[n:]
    lengths = [shared * bs + n for n in own]
    softcap = draw(st.sampled_from([None, 1.5, 30.0]))
    window = draw(st.sampled_from([None, 1, bs + 1, 1000]))
    seed = draw(st.integers(0, 2**16))
    return kv_heads, rep, dim, bs, num_blocks, tables, lengths, softcap, window, seed


@settings(max_examples=120, deadline=None)
@given(decode_steps())
def test_cascade_equals_per_row_reference(step) -> None:
    kv_heads, rep, dim, bs, num_blocks, tables, lengths, softcap, window, seed = step
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    batch, heads = len(tables), kv_heads * rep
    q = 2 * torch.randn(batch, heads, dim, generator=g)  # peaky softmax: a wrong key shows
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    t_lengths = torch.tensor(lengths)

    run = common_prefix_blocks(table, t_lengths, bs)
    assert run == reference_common_prefix(tables, lengths, bs)
    split = None
    if run:
        split = shared_prefix(table, t_lengths, max(lengths), run, bs, num_blocks, kv_heads)
    rows = DecodeRows(
        torch.arange(batch), table, head_major(table.view(-1), kv_heads, num_blocks), t_lengths, max(lengths), split
    )
    meta = StepMetadata([k_cache], [v_cache], torch.empty(0, dtype=torch.long), rows, ())
    with torch.inference_mode():
        got = _decode(q, k_cache, v_cache, meta, window, None, softcap)
    scale = dim**-0.5
    for b in range(batch):
        want = reference_row(q[b], k_cache, v_cache, tables[b], lengths[b], scale, softcap, window)
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=2e-6, msg=f"row {b}")


def test_padding_block_zero_equal_to_a_shared_block_stays_out_of_the_prefix() -> None:
    # Row 1 is shorter: its padded column holds 0, the same id as row 0's third block.
    table = torch.tensor([[5, 6, 0, 7], [5, 6, 1, 0]])
    assert common_prefix_blocks(table, torch.tensor([13, 10]), 4) == 2
    assert common_prefix_blocks(torch.tensor([[5, 6, 0], [5, 6, 0]]), torch.tensor([12, 9]), 4) == 2
    assert common_prefix_blocks(torch.tensor([[5, 6, 3]]), torch.tensor([12]), 4) == 0, "one row: nothing to share"
    assert common_prefix_blocks(torch.tensor([[5, 6], [4, 6]]), torch.tensor([8, 8]), 4) == 0


def attend_step(
    meta: StepMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One layer of the step through the attention function, as transformers calls it."""
    with torch.inference_mode():
        out, _ = paged_kv_attention(
            SimpleNamespace(layer_idx=0),
            query,
            key,
            value,
            None,
            logitpool_step=meta,
            sliding_window=window,
            softcap=softcap,
        )
    return out


@st.composite
def chunk_steps(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    rep = draw(st.sampled_from([1, 3]))
    dim = draw(st.sampled_from([4, 8]))
    bs = draw(st.sampled_from([2, 4]))
    shared = draw(st.integers(1, 4))
    count = draw(st.integers(2, 4))
    before = draw(st.lists(st.integers(0, 2 * bs), min_size=count, max_size=count))  # own tokens already cached
    sizes = draw(st.lists(st.integers(2, 2 * bs + 1), min_size=count, max_size=count))
    own_blocks = [-(-(b + n) // bs) for b, n in zip(before, sizes)]
    num_blocks = shared + sum(own_blocks) + 1
    ids = list(draw(st.permutations(range(num_blocks))))
    prefix, rest = ids[:shared], ids[shared:]
    tables = []
    for n in own_blocks:
        tables.append(prefix + rest[:n])
        rest = rest[n:]
    softcap = draw(st.sampled_from([None, 1.5]))
    window = draw(st.sampled_from([None, 3, 1000]))
    return kv_heads, rep, dim, bs, num_blocks, shared, tables, [shared * bs + b for b in before], sizes, softcap, window


@settings(max_examples=60, deadline=None)
@given(chunk_steps(), st.integers(0, 2**16))
def test_prompt_chunks_past_a_shared_prefix_equal_the_reference(step, seed) -> None:
    """Several prompt chunks after one cached prefix (prefix hits): cascade and per-chunk paths both exact."""
    kv_heads, rep, dim, bs, num_blocks, shared, tables, starts, sizes, softcap, window = step
    g = torch.Generator().manual_seed(seed)
    heads, total = kv_heads * rep, sum(sizes)
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    query = 2 * torch.randn(1, heads, total, dim, generator=g)
    key, value = torch.randn(1, kv_heads, total, dim, generator=g), torch.randn(1, kv_heads, total, dim, generator=g)
    token_starts = [sum(sizes[:c]) for c in range(len(sizes))]
    slots = [t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, sizes) for p in range(s, s + n)]
    chunks, spans = [], []
    for tok, n, start, table in zip(token_starts, sizes, starts, tables):
        used = torch.tensor(table[: -(-(start + n) // bs)])
        chunks.append(PromptChunk(tok, n, start, used, head_major(used, kv_heads, num_blocks)))
        spans.append((tok, n, start, used.tolist()))
    with pytest.MonkeyPatch.context() as mp:  # cascade for any shared prefix, not only where it pays
        mp.setattr(attention_cascade, "MIN_ROWS", 2)
        mp.setattr(attention_cascade, "MIN_SAVED_TOKENS", 1)
        split = shared_chunks(spans, bs, num_blocks, kv_heads, torch.device("cpu"))
    assert split is not None and split.num_tokens == shared * bs
    outs = []
    for cascade in (split, None):
        meta = StepMetadata([k_cache], [v_cache], torch.tensor(slots), None, tuple(chunks), {}, cascade)
        out = attend_step(meta, query, key, value, window, softcap)
        outs.append(out[0])
    scale = dim**-0.5
    for tok, n, start, table in zip(token_starts, sizes, starts, tables):
        for i in range(n):
            want = reference_row(query[0, :, tok + i], k_cache, v_cache, table, start + i + 1, scale, softcap, window)
            for name, out in zip(("cascade", "per chunk"), outs):
                torch.testing.assert_close(out[tok + i].double(), want, rtol=1e-5, atol=2e-6, msg=f"{name} {tok + i}")
