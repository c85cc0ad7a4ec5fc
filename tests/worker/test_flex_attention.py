"""The flex attention backend (the pool read in place) equals the torch backend (gather + SDPA).

Reference: today's torch path, ``paged_kv_attention`` with ``backend="torch"``, on the same step.
Steps are random: decode rows and prompt chunks mixed in one step in shuffled order, every
sequence's blocks drawn from a shuffled pool after a run of leading blocks shared by all of them
(a cached prefix), GQA, sliding windows, softcap. The runner-level test drives the tiny model
greedily through both backends under churn (joins, chunked prompts, block reuse) and compares
tokens with each other and with ``generate()``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from tests.worker.test_attention_cascade import attend_step
from tests.worker.test_model_matrix import _build
from tests.worker.test_runner import _assert_matches_reference, _corpus_ids, _Req, _run_with_churn
from worker.config import EngineConfig
from worker.model import flex_attention
from worker.model.attention import DecodeRows, PromptChunk, StepMetadata, resolve_backend
from worker.model.gather import head_major
from worker.model.loader import LoadedModel
from worker.model.runner import ModelRunner


@st.composite
def mixed_steps(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    rep = draw(st.sampled_from([1, 3]))
    dim = draw(st.sampled_from([4, 8]))
    bs = draw(st.sampled_from([2, 4]))
    shared = draw(st.integers(0, 3))
    decode = draw(st.integers(0, 4))
    chunks = draw(st.integers(0 if decode else 1, 3))
    before = draw(st.lists(st.integers(0, 3 * bs), min_size=decode + chunks, max_size=decode + chunks))
    sizes = [1] * decode + draw(st.lists(st.integers(2, 2 * bs + 1), min_size=chunks, max_size=chunks))
    own_blocks = [-(-(b + n) // bs) for b, n in zip(before, sizes)]
    num_blocks = shared + sum(own_blocks) + draw(st.integers(0, 3))
    ids = list(draw(st.permutations(range(num_blocks))))
    prefix, rest = ids[:shared], ids[shared:]
    seqs = []
    for b, n, own in zip(before, sizes, own_blocks):
        seqs.append((prefix + rest[:own], shared * bs + b, n))
        rest = rest[own:]
    order = draw(st.permutations(range(len(seqs))))
    softcap = draw(st.sampled_from([None, 1.5]))
    window = draw(st.sampled_from([None, 1, bs + 1, 1000]))
    return kv_heads, rep, dim, bs, num_blocks, [seqs[i] for i in order], softcap, window


def _metadata(seqs, bs: int, num_blocks: int, kv_heads: int, caches, backend: str) -> StepMetadata:
    """The runner's StepMetadata for a step of (table, start, tokens) seqs (no cascade)."""
    slots, dec_index, dec_lens, dec_tables, chunks = [], [], [], [], []
    tok = 0
    for table, start, n in seqs:
        end = start + n
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        used = table[: -(-end // bs)]
        if n == 1:
            dec_index.append(tok)
            dec_lens.append(end)
            dec_tables.append(used)
        else:
            blocks = torch.tensor(used)
            chunks.append(PromptChunk(tok, n, start, blocks, head_major(blocks, kv_heads, num_blocks)))
        tok += n
    decode = None
    if dec_index:
        width = max(map(len, dec_tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables])
        decode = DecodeRows(
            torch.tensor(dec_index),
            table,
            head_major(table.view(-1), kv_heads, num_blocks),
            torch.tensor(dec_lens),
            max(dec_lens),
        )
    k_cache, v_cache = caches
    return StepMetadata([k_cache], [v_cache], torch.tensor(slots), decode, tuple(chunks), {}, None, backend)


@settings(max_examples=20, deadline=None)
@given(mixed_steps(), st.integers(0, 2**16))
def test_flex_equals_the_torch_path_on_mixed_steps(step, seed) -> None:
    kv_heads, rep, dim, bs, num_blocks, seqs, softcap, window = step
    g = torch.Generator().manual_seed(seed)
    total = sum(n for *_, n in seqs)
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks, bs, dim, generator=g)
    query = 2 * torch.randn(1, kv_heads * rep, total, dim, generator=g)  # peaky softmax: a wrong key shows
    key, value = torch.randn(1, kv_heads, total, dim, generator=g), torch.randn(1, kv_heads, total, dim, generator=g)
    outs, pools = [], []
    for backend in ("torch", "flex"):
        caches = (k_cache.clone(), v_cache.clone())
        meta = _metadata(seqs, bs, num_blocks, kv_heads, caches, backend)
        out = attend_step(meta, query, key, value, window, softcap)
        outs.append(out)
        pools.append(caches)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=2e-6)
    for want, got in zip(pools[0], pools[1]):
        assert torch.equal(want, got), "both backends write the same slots"


def test_greedy_tokens_equal_between_backends_under_churn(tiny_model: LoadedModel) -> None:
    corpus = _corpus_ids(tiny_model)
    bos = tiny_model.tokenizer.bos_token_id
    outputs = []
    for backend in ("torch", "flex"):
        rng = random.Random(99)
        reqs = []
        for i in range(4):
            length, offset = rng.randint(10, 60), rng.randrange(len(corpus) - 60)
            reqs.append(
                _Req([bos, *corpus[offset : offset + length - 1]], rng.randint(1, 8), rng.randint(0, 4) * (i > 1))
            )
        runner = ModelRunner(tiny_model, num_blocks=24, block_size=8, max_model_len=96, attention_backend=backend)
        assert runner.attention_backend == backend
        seen = _run_with_churn(runner, reqs, tiny_model.eos_token_ids, budget=32, rng=rng)
        assert seen["mixed_steps"] > 0 and seen["split_chunks"] > 0
        _assert_matches_reference(tiny_model, reqs)
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1]


def test_backend_choice_per_device() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 16) == "torch", "measured: eager flex scores the whole pool on CPU"
    assert resolve_backend("flex", cpu, 16) == "flex"
    with pytest.raises(ValueError, match=r"^attention_backend: flex cannot run on meta"):
        resolve_backend("flex", torch.device("meta"), 16)
    with pytest.raises(ValueError, match="attention_backend: must be one of auto, torch, flex, got 'triton'"):
        EngineConfig(attention_backend="triton")  # type: ignore[arg-type]  # the wrong value is the test


def test_the_engine_runs_the_flex_backend_with_the_same_greedy_tokens(tiny_model) -> None:
    """engine.attention_backend reaches the engine's runner: flex gives the torch path's tokens."""
    from tests.worker.test_engine import make_llm, prompts_of
    from worker import SamplingParams

    prompts = prompts_of(tiny_model, 3, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for backend in ("torch", "flex"):
        llm = make_llm(tiny_model, attention_backend=backend)
        assert llm.engine.runner.attention_backend == backend
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs["flex"] == runs["torch"]


def _churn_run(model: LoadedModel, corpus: list[int], seed: int, backend: str) -> list[_Req]:
    rng = random.Random(seed)
    reqs = [
        _Req([1, *corpus[o : o + n - 1]], rng.randint(1, 12), rng.randint(0, 6) * (i > 1))
        for i, (n, o) in enumerate((rng.randint(2, 70), rng.randrange(len(corpus) - 70)) for _ in range(8))
    ]
    runner = ModelRunner(model, num_blocks=64, block_size=8, max_model_len=96, attention_backend=backend)
    seen = _run_with_churn(runner, reqs, model.eos_token_ids, budget=rng.choice([16, 32]), rng=rng)
    assert seen["mixed_steps"] > 0 and seen["split_chunks"] > 0
    return reqs


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_flex_keeps_to_a_few_variants_under_churn(
    family: str, tiny_model: LoadedModel, tmp_path, monkeypatch
) -> None:
    """On CUDA flex runs compiled, and past dynamo's recompile limit it would fall back to eager
    flex, which scores the whole pool there. Dynamo's eager backend has the same guards as
    Inductor, so on CPU it shows how many variants random steps compile: four, for full layers
    (llama) and for windowed and full layers with softcap (gemma2) alike; what is left are
    dynamo's specialisations of sizes of one. Before, the window was a Python int in the
    mask_mod's closure (a variant per layer kind) and sizes were traced static first (a variant
    per size that changed, in the order steps came): seven or eight for gemma, at the limit.
    The compiled runs give the torch backend's tokens and logits (the matrix test checks that
    one against ``generate()`` for every family)."""
    model = tiny_model if family == "llama" else _build(family, tmp_path, tiny_model.tokenizer)
    corpus = _corpus_ids(tiny_model)
    want = [_churn_run(model, corpus, seed, "torch") for seed in range(2)]
    monkeypatch.setitem(flex_attention.COMPILED_DEVICES, "cpu", "eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        got = [_churn_run(model, corpus, seed, "flex") for seed in range(2)]
        assert counters["frames"]["total"] <= 4, dict(counters["frames"])
        assert torch._dynamo.config.recompile_limit >= flex_attention.RECOMPILE_LIMIT
    finally:
        torch._dynamo.reset()
    for run_want, run_got in zip(want, got):
        for w, g in zip(run_want, run_got):
            assert g.output == w.output
            torch.testing.assert_close(torch.stack(g.logits), torch.stack(w.logits), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128, 256])
def test_flex_on_cuda_tiles_kv_by_a_divisor_of_the_block(block_size: int) -> None:
    """flex's Triton kernels need the block mask's KV block (here the cache block) to be a
    multiple of their KV tile, 64 by default on Hopper: at block_size 16 the prompt-chunk kernel
    had no config left and raised. Every CUDA call now asks for a tile that divides the block."""
    options = flex_attention.kernel_options(torch.device("cuda"), block_size)
    assert options is not None
    tile = options["BLOCK_N"]
    assert block_size % tile == 0 and flex_attention.MIN_TILE <= tile <= flex_attention.KV_TILE
    assert flex_attention.kernel_options(torch.device("cpu"), block_size) is None


def test_flex_refused_at_start_up_where_torch_cannot_shrink_the_tile() -> None:
    """Torch before 2.9 skips a decoding tile larger than the KV block instead of shrinking it (no
    kernel left): flex on such a torch needs blocks of at least the tile, and says so at start-up."""
    cuda = torch.device("cuda")
    reason = flex_attention.flex_unavailable(cuda, 16, shrinks_tile=False)
    assert reason is not None and "block_size" in reason and "2.9" in reason
    assert flex_attention.flex_unavailable(cuda, 64, shrinks_tile=False) is None
    assert flex_attention.flex_unavailable(cuda, 16, shrinks_tile=True) is None
    assert flex_attention.flex_unavailable(torch.device("cpu"), 16, shrinks_tile=False) is None
    small = flex_attention.flex_unavailable(cuda, 8, shrinks_tile=True)  # a tile of 8 cannot be a tl.dot
    assert small is not None and "block_size 8" in small
    assert flex_attention.flex_unavailable(torch.device("cpu"), 8) is None
