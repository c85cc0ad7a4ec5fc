"""The engine on paged KV: prefix caching, n > 1 sharing, preemption by recomputation.

Oracles: transformers' generate() per request (greedy), the same requests through an engine
whose pool never runs short (preemption must change no greedy or seeded token), and batch-of-one
processor references driven by the engine's own BatchUpdates (a preempted request is removed
and later re-added with its live output list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from tests.worker.model_fixtures import engine_config
from tests.worker.test_engine import hf_greedy, prompts_of
from worker.engine import LLMEngine
from worker.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.model.runner import block_bytes
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams


def _engine(loaded, *, blocks: int | None = None, block_size: int = 8, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    if blocks is not None:
        kw["kv_cache_bytes"] = blocks * block_bytes(loaded, block_size)
    cfg = engine_config(load_entry_points=False, block_size=block_size, **kw)
    return LLMEngine(cfg, loaded=loaded)


def _run(
    engine: LLMEngine,
    requests: list[tuple[list[int], SamplingParams]],
    stagger: int = 0,
    check_delta: Callable[[RequestOutput, bool], None] | None = None,
    abort: dict[int, int] | None = None,
    on_step: Callable[[], None] | None = None,
) -> dict[str, RequestOutput]:
    """Add the requests (every ``stagger`` steps one, or all at once), step to the end; outputs by id.

    ``check_delta(delta, first)`` sees every delta, and whether it is its request's first.
    ``abort``: request index -> the step at which it is aborted. ``on_step`` runs after each step.
    """
    accs: dict[str, OutputAccumulator] = {}
    done: dict[str, RequestOutput] = {}
    seen: set[str] = set()
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished():
        while pending and (not stagger or steps % stagger == 0):
            i, (prompt, params) = pending.pop(0)
            accs[engine.add_request(f"r{i}", prompt, params)] = OutputAccumulator()
            if stagger:
                break
        for i, at in (abort or {}).items():
            if at == steps:
                engine.abort_request(f"r{i}")
        for delta in engine.step():
            if check_delta is not None:
                check_delta(delta, delta.request_id not in seen)
            seen.add(delta.request_id)
            out = accs[delta.request_id].add(delta)
            if out.finished:
                done[delta.request_id] = out
        if on_step is not None:
            on_step()
        steps += 1
        assert steps < 3000, "no progress"
    return done


def _shared_prefix_prompts(loaded, n: int, prefix_len: int, seed: int) -> list[list[int]]:
    prefix = prompts_of(loaded, 1, lo=prefix_len, hi=prefix_len + 1, seed=seed)[0]
    tails = prompts_of(loaded, n, lo=1, hi=20, seed=seed + 1)
    prompts = [prefix + t for t in tails]
    prompts[1] = list(prompts[0])  # an exact repeat: a full-prompt hit (its last token is recomputed)
    return prompts


def test_greedy_equals_generate_with_prefix_hits_and_preemptions(tiny_model) -> None:
    prompts = _shared_prefix_prompts(tiny_model, 8, 37, seed=40) + prompts_of(tiny_model, 3, lo=20, hi=50, seed=41)
    max_new = [4 + (i * 5) % 13 for i in range(len(prompts))]
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_new)]
    engine = _engine(tiny_model, blocks=14, block_size=8, max_num_batched_tokens=40)
    done = _run(engine, reqs, stagger=1)
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0, "the pool must be tight enough to preempt"
    assert stats["prefix_hit_tokens"] >= 4 * 32, "later requests must reuse the shared prefix"
    assert stats["blocks_used"] == 0
    for i, (prompt, m) in enumerate(zip(prompts, max_new)):
        assert done[f"r{i}"].outputs[0].token_ids == hf_greedy(tiny_model, prompt, m)[0], f"request {i}"


def test_cascade_attention_keeps_greedy_equal_to_generate(tiny_model) -> None:
    """Prompt chunks and decode rows over a shared cached prefix attend it once per step (cascade), exactly."""
    prompts = _shared_prefix_prompts(tiny_model, 8, 61, seed=44)  # 7 shared blocks of 8
    max_new = [10 + i % 5 for i in range(len(prompts))]
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_new)]
    engine = _engine(tiny_model, blocks=64, block_size=8, max_num_batched_tokens=256)
    done = _run(engine, reqs)
    assert engine.runner.num_cascade_steps >= 5, "the rows share 7 blocks: decode steps must cascade"
    assert engine.runner.num_cascade_chunk_steps >= 1, "the prompts after the first hit the prefix together"
    for i, (prompt, m) in enumerate(zip(prompts, max_new)):
        assert done[f"r{i}"].outputs[0].token_ids == hf_greedy(tiny_model, prompt, m)[0], f"request {i}"


def test_preemption_leaves_greedy_and_seeded_outputs_bit_identical(tiny_model) -> None:
    prompts = prompts_of(tiny_model, 8, lo=20, hi=60, seed=42)
    reqs = []
    for i, p in enumerate(prompts):
        if i % 2:
            params = SamplingParams(
                temperature=0.9,
                top_k=40,
                seed=100 + i,
                max_tokens=20,
                ignore_eos=True,
                repetition_penalty=1.3,
                min_tokens=5,
                logprobs=1,
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
        reqs.append((p, params))
    roomy = _engine(tiny_model, enable_prefix_caching=False)
    tight = _engine(tiny_model, blocks=20, block_size=8, enable_prefix_caching=False)
    a, b = _run(roomy, reqs), _run(tight, reqs)
    assert roomy.kv_stats()["num_preemptions"] == 0 and tight.kv_stats()["num_preemptions"] >= 3
    for rid in a:
        assert b[rid].outputs[0].token_ids == a[rid].outputs[0].token_ids, rid
        got = [max(p.values(), key=lambda lp: lp.logprob).logprob for p in b[rid].outputs[0].logprobs]
        ref = [max(p.values(), key=lambda lp: lp.logprob).logprob for p in a[rid].outputs[0].logprobs]
        assert got == pytest.approx(ref, abs=1e-4)


def test_n_children_share_the_prompt_blocks(tiny_model) -> None:
    prompt = prompts_of(tiny_model, 1, lo=50, hi=51, seed=43)[0]  # 6 full blocks of 8 + 2 tokens
    engine = _engine(tiny_model, blocks=64, block_size=8)
    engine.add_request("n", prompt, SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True))
    while len(engine.batch.req_ids) < 4:
        engine.step()
    children = engine.scheduler.running
    shared = children[0].block_ids[:6]
    assert all(c.block_ids[:6] == shared for c in children)
    assert len({b for c in children for b in c.block_ids[6:]}) == sum(len(c.block_ids) - 6 for c in children)
    used = engine.kv_stats()["blocks_used"]
    assert used == 6 + sum(len(c.block_ids) - 6 for c in children)  # counted once, not four times
    assert engine.kv_stats()["prefix_hit_tokens"] == 3 * 48
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_stats()["blocks_used"] == 0 and engine.kv_stats()["blocks_cached"] >= 6


def test_prefix_caching_off_computes_every_prompt(tiny_model) -> None:
    prompts = _shared_prefix_prompts(tiny_model, 4, 40, seed=44)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)) for p in prompts]
    on, off = _engine(tiny_model), _engine(tiny_model, enable_prefix_caching=False)
    a, b = _run(on, reqs, stagger=3), _run(off, reqs, stagger=3)
    assert {k: v.outputs[0].token_ids for k, v in a.items()} == {k: v.outputs[0].token_ids for k, v in b.items()}
    assert on.kv_stats()["prefix_hit_rate"] > 0.5
    assert off.kv_stats()["prefix_hit_tokens"] == 0 and off.kv_stats()["blocks_cached"] == 0


def test_a_request_larger_than_the_pool_is_rejected_at_validation(tiny_model) -> None:
    engine = _engine(tiny_model, blocks=4, block_size=8)  # 32 tokens in all
    with pytest.raises(ValueError, match=r"max_tokens: .*more than the whole pool \(32 tokens\)"):
        engine.add_request("big", list(range(10, 30)), SamplingParams(max_tokens=13))
    out = _run(engine, [(list(range(10, 30)), SamplingParams(max_tokens=12, ignore_eos=True))])
    assert len(out["r0"].outputs[0].token_ids) == 12


def test_kv_stats_and_capacity_log(tiny_model, caplog) -> None:
    with caplog.at_level("INFO", logger="worker.engine"):
        engine = _engine(tiny_model, blocks=10, block_size=16)
    assert "10 blocks x 16 tokens = 160 tokens" in caplog.text
    stats = engine.kv_stats()
    assert stats["blocks_total"] == 10 and stats["blocks_used"] == 0 and stats["num_preemptions"] == 0
    assert set(stats) >= {"blocks_total", "blocks_used", "blocks_cached", "prefix_hit_rate", "num_preemptions"}


# ----------------------------------------------------------------------------- processor oracle

_INNER = (MinTokensLogitsProcessor, PenaltiesLogitsProcessor, LogitBiasLogitsProcessor)


class OracleProcessor(LogitsProcessor):
    """Observes only: runs real processors batched and per request, from the engine's BatchUpdates.

    Each row's batched result must equal a reference instance that saw only that request
    (added at row 0 when it joined, ``update_state(None)`` after). Logits pass through unchanged.
    """

    instances: ClassVar[list[OracleProcessor]] = []

    def __init__(self, config, device, is_pin_memory) -> None:
        self.args = (config, device, is_pin_memory)
        self.inner = [cls(*self.args) for cls in _INNER]
        self.rows: dict[int, tuple[list[LogitsProcessor], list[int]]] = {}  # row -> (refs, live output)
        self.readded = self.removed = self.compared = 0
        self.mismatches: list[str] = []
        OracleProcessor.instances.append(self)

    @classmethod
    def validate_params(cls, params) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for p in self.inner:
            p.update_state(batch_update)
        touched = set()
        if batch_update is not None:
            for index, params, prompt, output in batch_update.added:
                refs = [cls(*self.args) for cls in _INNER]
                for r in refs:
                    r.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params, prompt, output)]))
                self.rows[index] = (refs, output)
                self.readded += bool(output)
                touched.add(index)
            for index in batch_update.removed:
                self.rows.pop(index, None)
                self.removed += 1
            for src, dst, kind in batch_update.moved:
                a, b = self.rows.pop(src, None), self.rows.pop(dst, None)
                if a is not None:
                    self.rows[dst] = a
                if kind == MoveDirectionality.SWAP and b is not None:
                    self.rows[src] = b
                touched |= {src, dst}
        for index, (refs, _) in self.rows.items():
            if index not in touched or batch_update is None:
                for r in refs:
                    r.update_state(None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        given = torch.randn(logits.shape, generator=torch.Generator().manual_seed(logits.shape[0]))
        batched = given.clone()
        for p in self.inner:
            batched = p.apply(batched)
        for row in range(logits.shape[0]):
            alone = given[row : row + 1].clone()
            for r in self.rows[row][0]:
                alone = r.apply(alone)
            if not torch.equal(alone[0], batched[row]):
                self.mismatches.append(f"row {row}")
            self.compared += 1
        return logits


def test_processors_see_preemption_as_removal_and_re_add(tiny_model) -> None:
    """check_processor-style oracle, driven by a real engine's BatchUpdates under preemption."""
    OracleProcessor.instances.clear()
    prompts = prompts_of(tiny_model, 8, lo=20, hi=60, seed=45)
    reqs = [
        (
            p,
            SamplingParams(
                temperature=0.7,
                seed=i,
                max_tokens=18,
                min_tokens=i % 4 * 3,
                ignore_eos=True,
                presence_penalty=0.5 * (i % 3),
                logit_bias={7: 3.0} if i % 2 else None,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    engine = _engine(tiny_model, blocks=18, block_size=8, logits_processors=(OracleProcessor,))
    accs = {engine.add_request(f"r{i}", p, sp): OutputAccumulator() for i, (p, sp) in enumerate(reqs)}
    oracle = OracleProcessor.instances[-1]
    while engine.has_unfinished():
        for delta in engine.step():
            accs[delta.request_id].add(delta)
        live = {row: out for row, (_, out) in oracle.rows.items()}
        assert sorted(live) == list(range(engine.batch.num_reqs))  # the oracle tracks the batch's rows
        assert all(live[row] is engine.batch.output_ids_of(row) for row in live)
    assert engine.kv_stats()["num_preemptions"] > 0 and oracle.readded > 0
    assert oracle.compared > 100 and oracle.mismatches == []


# ----------------------------------------------------------------------------- soak and CUDA


def test_short_soak_frees_every_block_and_keeps_rss_flat(tiny_model) -> None:
    """150 requests with churn, prefix hits and preemptions (the bench's --soak runs 1,000)."""
    from worker.bench.engine import rss_mib

    g = torch.Generator().manual_seed(9)
    heads = [torch.randint(10, 2900, (24,), generator=g).tolist() for _ in range(3)]
    engine = _engine(tiny_model, blocks=40, block_size=8, max_num_seqs=12)
    rss_after_warmup = 0.0
    for i in range(150):
        own = torch.randint(10, 2900, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(
            temperature=0.8 if i % 2 else 0.0,
            seed=i if i % 3 else None,
            ignore_eos=True,
            max_tokens=int(torch.randint(1, 12, (1,), generator=g)),
        )
        engine.add_request(f"s{i}", heads[i % 3] + own, params)
        if i % 3 == 2:  # three arrivals per step: the pool runs short
            engine.step()
        if i == 50:
            rss_after_warmup = rss_mib()[0]
    while engine.has_unfinished():
        engine.step()
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_hit_rate"] > 0.2, stats
    assert stats["blocks_used"] == 0 and all(r == 0 for r in engine.kv.pool.refcount)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert rss_mib()[0] - rss_after_warmup < 32  # MiB: no per-request growth


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_equals_generate_with_preemption(tiny_model_dir) -> None:
    from worker.model.loader import load_model

    loaded = load_model(tiny_model_dir, device="cuda", dtype="float32")
    prompts = _shared_prefix_prompts(loaded, 6, 37, seed=46)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts]
    engine = _engine(loaded, blocks=16, block_size=8, max_num_batched_tokens=40)
    done = _run(engine, reqs, stagger=1)
    assert engine.kv_stats()["prefix_hit_tokens"] > 0
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].outputs[0].token_ids == hf_greedy(loaded, p, 12)[0], f"request {i}"


def test_num_cached_tokens_counts_the_prefix_cache_hits_of_each_prompt(tiny_model) -> None:
    """RequestOutput.num_cached_tokens (OpenAI's usage.prompt_tokens_details.cached_tokens): the
    prompt tokens the prefix cache served when the request was admitted, in whole blocks, never
    the last prompt token (it is always computed)."""
    prompt = prompts_of(tiny_model, 1, lo=37, hi=38, seed=45)[0]  # 4 full blocks of 8 + 5 tokens
    other = prompts_of(tiny_model, 1, lo=30, hi=31, seed=46)[0]

    def params(**kw: object) -> SamplingParams:
        return SamplingParams(**{"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, **kw})  # type: ignore[arg-type]  # a test's keyword mix

    deltas: dict[str, list[int | None]] = {}
    engine = _engine(tiny_model, blocks=64, block_size=8)
    requests = [
        (prompt, params()),  # r0: cold
        (prompt, params()),  # r1: an exact repeat, 4 blocks
        (prompt[:20] + other[:10], params()),  # r2: shares 2 blocks
        (other, params(n=3, seed=1, temperature=1.0)),  # r3: cold; its siblings' sharing is not a hit
        (prompt, params(prompt_logprobs=1)),  # r4: prompt logprobs reuse no cached prefix
    ]
    done = _run(
        engine,
        requests,
        stagger=8,
        check_delta=lambda d, _: deltas.setdefault(d.request_id, []).append(d.num_cached_tokens),
    )
    assert [done[f"r{i}"].num_cached_tokens for i in range(5)] == [0, 32, 16, 0, 0]
    assert all(len(set(seen)) == 1 for seen in deltas.values()), deltas  # every delta says the same

    off = _engine(tiny_model, blocks=64, block_size=8, enable_prefix_caching=False)
    again = _run(off, [(prompt, params()), (prompt, params())], stagger=8)
    assert [again[f"r{i}"].num_cached_tokens for i in range(2)] == [0, 0]
