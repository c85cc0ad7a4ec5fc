"""ModelRunner against independent oracles on a real tiny model.

Oracles: ``model.generate(do_sample=False)`` per request (transformers' own cache and SDPA), and
a plain cache-free forward of the full sequence. The runner is driven directly, with a small
scheduler in this file that produces churn: joins mid-way, prompts chunked under a token budget
and mixed with decode rows in one forward, rows reordered every step, KV blocks freed and reused
(handed out in a shuffled order, so a request's blocks are scattered over the pool).
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.kv.block_pool import BlockPool
from worker.model.loader import LoadedModel, load_model
from worker.model.runner import ModelRunner, ScheduledSeq, block_bytes, num_blocks_for

ATOL = 2e-4  # float32; batched vs single-request logits differ by ~2e-5 on this model
TIE_GAP = 1e-4  # greedy picks closer than this may flip with summation order


def _corpus_ids(loaded: LoadedModel) -> list[int]:
    return loaded.tokenizer(inspect.getsource(inspect), add_special_tokens=False)["input_ids"]


def _plain_last_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of a cache-free forward over the whole sequence."""
    with torch.inference_mode():
        ids = torch.tensor([tokens], device=loaded.device)
        return loaded.model(input_ids=ids, use_cache=False).logits[0, -1]


# ----------------------------------------------------------------------------- churn vs generate


@dataclass
class _Req:
    prompt: list[int]
    max_new: int
    arrival: int
    blocks: list[int] | None = None
    computed: int = 0  # tokens in the KV blocks
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    done: bool = False


def _reference(loaded: LoadedModel, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device=loaded.device)
    out = loaded.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0]


def _assert_matches_reference(loaded: LoadedModel, reqs: list[_Req]) -> None:
    """Tokens equal and logits close, per request, up to a near-tie of the reference's top two.

    Past a top-1/top-2 gap below TIE_GAP the greedy pick may legitimately differ by float noise,
    and both continuations are then conditioned on different tokens; most steps must be compared.
    """
    compared = total = 0
    for r in reqs:
        tokens, logits = _reference(loaded, r.prompt, r.max_new)
        top2 = logits.float().topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < TIE_GAP).nonzero()
        upto = int(ties[0]) if len(ties) else len(tokens)
        assert r.output[:upto] == tokens[:upto]
        if upto == len(tokens):
            assert r.output == tokens  # same length: both stopped at the same EOS or max_new
        rows = min(upto + 1, len(tokens))
        torch.testing.assert_close(torch.stack(r.logits[:rows]), logits[:rows].float(), rtol=0, atol=ATOL)
        compared, total = compared + rows, total + len(tokens)
    assert compared >= 0.8 * total


def _run_with_churn(
    runner: ModelRunner, reqs: list[_Req], eos: frozenset[int], budget: int, rng: random.Random
) -> dict[str, int]:
    """Drive the runner like an engine would; return counters proving what was exercised.

    Each admitted request reserves blocks for its whole length up front (simple, not the
    engine's policy); the pool's free order is shuffled so block tables are not contiguous.
    """
    seen = {"mixed_steps": 0, "split_chunks": 0, "block_reuses": 0}
    pool = BlockPool(runner.num_blocks, enable_caching=False)
    pool.free(rng.sample(pool.allocate(runner.num_blocks), runner.num_blocks))  # scatter the free order
    used_blocks: set[int] = set()
    waiting: list[_Req] = []
    step = 0
    while not all(r.done for r in reqs):
        waiting += [r for r in reqs if r.arrival == step]
        while waiting:
            need = -(-(len(waiting[0].prompt) + waiting[0].max_new) // runner.block_size)
            if need > pool.num_free:
                break
            req = waiting.pop(0)
            req.blocks = pool.allocate(need)
            seen["block_reuses"] += bool(used_blocks & set(req.blocks))
            used_blocks |= set(req.blocks)
        running = [r for r in reqs if r.blocks is not None and not r.done]
        left = budget
        plan: list[tuple[_Req, ScheduledSeq]] = []
        for r in running:  # decode rows first, one token each
            if r.computed >= len(r.prompt):
                plan.append((r, ScheduledSeq(r.blocks, [r.output[-1]], r.computed, True)))
                left -= 1
        for r in running:  # then prompt chunks under what is left of the budget
            n = min(len(r.prompt) - r.computed, left)
            if r.computed < len(r.prompt) and n > 0:
                end = r.computed + n
                plan.append((r, ScheduledSeq(r.blocks, r.prompt[r.computed : end], r.computed, end == len(r.prompt))))
                seen["split_chunks"] += r.computed > 0
                left -= n
        rng.shuffle(plan)  # the persistent batch reorders rows; KV must follow the blocks, not the row
        kinds = {len(s.token_ids) > 1 for _, s in plan}
        seen["mixed_steps"] += kinds == {True, False}
        if plan:
            logits = runner.execute([s for _, s in plan])
            sampled = [r for r, s in plan if s.sample]
            assert logits.shape == (len(sampled), runner.vocab_size)
            for r, s in plan:
                r.computed = s.start_pos + len(s.token_ids)
            for r, row in zip(sampled, logits):
                r.logits.append(row.float())
                r.output.append(int(row.argmax()))
                if r.output[-1] in eos or len(r.output) == r.max_new:
                    r.done = True
                    pool.free(reversed(r.blocks))
        step += 1
        assert step < 500, "scheduler made no progress"
    return seen


def test_greedy_matches_generate_under_churn(tiny_model: LoadedModel) -> None:
    rng = random.Random(1234)
    corpus = _corpus_ids(tiny_model)
    bos = tiny_model.tokenizer.bos_token_id
    reqs = []
    for i in range(14):
        length, offset = rng.randint(10, 100), rng.randrange(len(corpus) - 100)
        prompt = [bos, *corpus[offset : offset + length - 1]]
        reqs.append(_Req(prompt, max_new=rng.randint(1, 24), arrival=rng.randint(0, 20) if i > 2 else 0))
    runner = ModelRunner(tiny_model, num_blocks=36, block_size=16, max_model_len=160)
    seen = _run_with_churn(runner, reqs, tiny_model.eos_token_ids, budget=48, rng=rng)

    # The scenario really exercised what it claims to.
    assert seen["mixed_steps"] > 0 and seen["split_chunks"] > 0 and seen["block_reuses"] > 0
    # generate() runs on the same model object: the runner's attention falls back to SDPA there.
    _assert_matches_reference(tiny_model, reqs)
    assert len({tuple(r.output) for r in reqs}) > len(reqs) // 2


# ----------------------------------------------------------------------------- mixed == separate


_seq_shapes = st.lists(
    st.tuples(st.integers(0, 60), st.integers(1, 40), st.booleans()),  # (context, new tokens, sample)
    min_size=1,
    max_size=6,
)


def _prefilled(loaded: LoadedModel, contexts: list[list[int]], block_size: int) -> tuple[ModelRunner, list[list[int]]]:
    per_seq = -(-128 // block_size)
    runner = ModelRunner(loaded, num_blocks=per_seq * len(contexts), block_size=block_size, max_model_len=128)
    order = list(range(runner.num_blocks))[::-1]  # tables not in block order
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(contexts))]
    for table, ctx in zip(tables, contexts):
        if ctx:
            runner.execute([ScheduledSeq(table, ctx, 0, False)])
    return runner, tables


@settings(max_examples=15, deadline=None)
@given(shapes=_seq_shapes, seed=st.integers(0, 2**16), block_size=st.sampled_from([1, 5, 16]))
def test_mixed_step_equals_separate_steps(tiny_model: LoadedModel, shapes, seed: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tiny_model.tokenizer)
    contexts = [torch.randint(vocab, (c,), generator=gen).tolist() for c, _, _ in shapes]
    news = [torch.randint(vocab, (n,), generator=gen).tolist() for _, n, _ in shapes]
    samples = [s for _, _, s in shapes]

    mixed_runner, tables = _prefilled(tiny_model, contexts, block_size)
    step = [ScheduledSeq(t, new, len(ctx), s) for t, ctx, new, s in zip(tables, contexts, news, samples)]
    mixed = mixed_runner.execute(step)

    alone_runner, _ = _prefilled(tiny_model, contexts, block_size)
    alone = [alone_runner.execute([seq]) for seq in step]
    expected = torch.cat(alone)
    assert mixed.shape == (sum(samples), tiny_model.vocab_size)
    torch.testing.assert_close(mixed, expected, rtol=0, atol=ATOL)

    plain = [_plain_last_logits(tiny_model, c + n) for c, n, s in zip(contexts, news, samples) if s]
    if plain:
        torch.testing.assert_close(mixed, torch.stack(plain), rtol=0, atol=ATOL)


def test_rewriting_blocks_from_an_earlier_position(tiny_model: LoadedModel) -> None:
    """Positions >= start_pos are overwritten, earlier ones kept (mid-block, too)."""
    runner = ModelRunner(tiny_model, num_blocks=4, block_size=16, max_model_len=64)
    table = [2, 0, 3]
    runner.execute([ScheduledSeq(table, list(range(100, 130)), 0, False)])
    new = list(range(500, 510))
    got = runner.execute([ScheduledSeq(table, new, 20, True)])[0]
    torch.testing.assert_close(got, _plain_last_logits(tiny_model, list(range(100, 120)) + new), rtol=0, atol=ATOL)


def test_a_shared_prefix_block_is_read_by_two_sequences(tiny_model: LoadedModel) -> None:
    """Prefix caching at the runner level: two tables list the same blocks; only suffixes run."""
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=8, max_model_len=64)
    prefix = list(range(300, 324))  # 3 full blocks
    runner.execute([ScheduledSeq([5, 1, 6], prefix, 0, False)])
    a, b = list(range(700, 705)), list(range(900, 911))
    got = runner.execute([ScheduledSeq([5, 1, 6, 0], a, 24, True), ScheduledSeq([5, 1, 6, 2, 3], b, 24, True)])
    plain = torch.stack([_plain_last_logits(tiny_model, prefix + a), _plain_last_logits(tiny_model, prefix + b)])
    torch.testing.assert_close(got, plain, rtol=0, atol=ATOL)


def test_other_architecture_qwen2_with_qkv_bias(tmp_path, tiny_model: LoadedModel) -> None:
    """Not Llama-only: Qwen2 (q/k/v biases, explicit head_dim, tied embeddings) matches generate."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tiny_model.tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
        eos_token_id=tiny_model.tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device=tiny_model.device)
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    prompts = [[1, *range(40, 75)], [1, *range(300, 312)]]
    reqs = [_Req(p, max_new=10, arrival=0) for p in prompts]
    _run_with_churn(runner, reqs, frozenset(), budget=30, rng=random.Random(0))
    _assert_matches_reference(loaded, reqs)


# ----------------------------------------------------------------------------- sizing and checks


def test_kv_pool_is_sized_once_from_blocks(tiny_model: LoadedModel) -> None:
    cfg = tiny_model.config
    runner = ModelRunner(tiny_model, num_blocks=7, block_size=16, max_model_len=100)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 7 * 16 * cfg.num_key_value_heads * head_dim * 4  # float32
    assert runner.kv_cache_bytes == 2 * cfg.num_hidden_layers * per_layer == 7 * block_bytes(tiny_model, 16)
    assert runner.capacity_tokens == 112


def test_budget_in_bytes_gives_whole_blocks(tiny_model: LoadedModel) -> None:
    per = block_bytes(tiny_model, 16)
    assert num_blocks_for(tiny_model, 16, kv_cache_bytes=10 * per + per - 1, default_tokens=0) == 10
    assert num_blocks_for(tiny_model, 16, kv_cache_bytes=None, default_tokens=33) == 3
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        num_blocks_for(tiny_model, 16, kv_cache_bytes=per - 1, default_tokens=0)


def test_execute_rejects_inconsistent_steps(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, num_blocks=4, block_size=4, max_model_len=16)
    bad = {
        "block ids must be in": [ScheduledSeq([9], [5], 0, True)],
        "written by two sequences": [ScheduledSeq([0], [5], 0, False), ScheduledSeq([0], [6], 1, True)],
        "no tokens": [ScheduledSeq([0], [], 0, True)],
        "cannot hold 5 tokens": [ScheduledSeq([0], [1, 2, 3, 4, 5], 0, True)],
        "exceed max_model_len": [ScheduledSeq([0, 1, 2, 3, 3], list(range(17)), 0, True)],
    }
    for message, seqs in bad.items():
        with pytest.raises(ValueError, match=message):
            runner.execute(seqs)
    assert runner.execute([]).shape == (0, tiny_model.vocab_size)
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(tiny_model, num_blocks=1, max_model_len=tiny_model.max_model_len + 1)


# ----------------------------------------------------------------------------- the shared model object


def test_padded_generate_batch_stays_exact_after_the_runner_took_the_model(tiny_model: LoadedModel) -> None:
    """generate() is the oracle other tests use: a left-padded batch must equal one-by-one runs."""
    ModelRunner(tiny_model, num_blocks=1, max_model_len=8)  # switches the model's attention
    pad, bos = tiny_model.tokenizer.pad_token_id, tiny_model.tokenizer.bos_token_id
    prompts = [[bos, *range(200, 230)], [bos, *range(700, 705)], [bos, *range(900, 915)]]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=tiny_model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=tiny_model.device)
    batch = tiny_model.model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    for row, prompt in zip(batch, prompts):
        one = tiny_model.model.generate(
            torch.tensor([prompt], device=tiny_model.device), max_new_tokens=6, do_sample=False, min_new_tokens=6
        )
        assert row[width:].tolist() == one[0, len(prompt) :].tolist()


def test_a_runner_step_builds_no_transformers_mask(tiny_model: LoadedModel) -> None:
    """The attention function masks by itself; an O(T^2) mask per step would be pure waste."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from worker.model.attention import ATTENTION_NAME, register_attention

    runner = ModelRunner(tiny_model, num_blocks=8, block_size=16, max_model_len=64)
    calls = []

    def counting_mask(*args, **kwargs):
        calls.append(1)
        return sdpa_mask(*args, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, counting_mask)
    try:
        runner.execute(
            [ScheduledSeq([0, 1], list(range(10, 40)), 0, True), ScheduledSeq([2], list(range(50, 60)), 0, True)]
        )
        assert calls == []
        tiny_model.model(input_ids=torch.tensor([[1, 2, 3]], device=tiny_model.device))  # the fallback path
        assert calls  # proves the spy was live
    finally:
        register_attention()


# ----------------------------------------------------------------------------- the persistent block table


@dataclass
class _Live:
    blocks: list[int]
    tokens: list[int] = field(default_factory=list)  # in the KV blocks
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet run


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 3, 8]),
    padded=st.booleans(),
    steps=st.integers(4, 24),
)
def test_steps_through_the_persistent_block_table_equal_a_plain_forward(
    tiny_model: LoadedModel, seed: int, block_size: int, padded: bool, steps: int
) -> None:
    """Rows join, leave, grow into new blocks, are preempted (a new block list) and reordered;
    each step's logits equal a cache-free forward of each sampled row's whole sequence, whichever
    of the dynamic or the padded path ran it."""
    rng = random.Random(seed)
    vocab = len(tiny_model.tokenizer)
    max_len = 48
    runner = ModelRunner(
        tiny_model,
        num_blocks=6 * -(-max_len // block_size) + 1,
        block_size=block_size,
        max_model_len=max_len,
        cuda_graphs=padded,
        max_num_seqs=6,
    )
    free = rng.sample(range(runner.num_blocks), runner.num_blocks)
    live: list[_Live] = []
    for _ in range(steps):
        for r in [r for r in live if len(r.tokens) + 1 >= max_len or rng.random() < 0.1]:  # finish
            live.remove(r)
            free += r.blocks
        for r in [r for r in live if rng.random() < 0.1]:  # preempted: blocks freed, the list rebound
            free += r.blocks
            r.pending, r.tokens, r.blocks = r.tokens + r.pending, [], []
        if len(live) < 6 and rng.random() < 0.6:
            live.append(_Live([], pending=[rng.randrange(vocab) for _ in range(rng.randint(1, 20))]))
        if rng.random() < 0.3:  # the batch reorders its rows
            rng.shuffle(live)
        if rng.random() < 0.3 and len(live) > 1:
            i, j = rng.sample(range(len(live)), 2)
            live[i], live[j] = live[j], live[i]
        plan: list[tuple[_Live, list[int]]] = []
        for r in live:
            new = r.pending[: rng.randint(1, 12)] if r.pending else [rng.randrange(vocab)]
            new = new[: max_len - len(r.tokens)]
            r.blocks.extend(free.pop() for _ in range(-(-(len(r.tokens) + len(new)) // block_size) - len(r.blocks)))
            plan.append((r, new))
        if not plan:
            continue
        seqs = [ScheduledSeq(r.blocks, new, len(r.tokens), True) for r, new in plan]
        got = runner.execute(seqs)
        for r, new in plan:
            r.tokens += new
            r.pending = r.pending[len(new) :]  # a prompt chunk ran (a decode row has none pending)
        want = torch.stack([_plain_last_logits(tiny_model, r.tokens) for r, _ in plan])
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_a_step_writes_only_the_table_entries_that_changed(tiny_model: LoadedModel) -> None:
    """Host work O(changed rows): steady decode rows rewrite no table row; crossing a block
    boundary appends one entry; a reordered batch swaps rows instead of rewriting them."""
    runner = ModelRunner(tiny_model, num_blocks=64, block_size=4, max_model_len=64)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    runner.execute([ScheduledSeq(t, list(range(100, 109)), 0, True) for t in tables])  # 9 tokens each
    table = runner.block_table
    start = (table.num_rewrites, table.num_appended, table.num_swaps)
    assert start[0] == 4  # the first step wrote every row once
    for pos in (9, 10, 11):  # within the rows' third block
        runner.execute([ScheduledSeq(t, [7], pos, True) for t in tables])
    assert (table.num_rewrites, table.num_appended, table.num_swaps) == start
    for t, b in zip(tables, (12, 13, 14, 15)):
        t.append(b)
    runner.execute([ScheduledSeq(t, [7], 12, True) for t in tables])  # into a fourth block
    assert (table.num_rewrites, table.num_appended) == (start[0], start[1] + 4)
    order = [tables[3], tables[1], tables[2], tables[0]]
    runner.execute([ScheduledSeq(t, [7], 13, True) for t in order])
    assert table.num_rewrites == start[0] and table.num_swaps == start[2] + 1
    assert table.table[:4, :4].tolist() == order
