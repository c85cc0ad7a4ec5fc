"""Tensor parallelism on CPU (gloo, 2 ranks as processes): tokens at TP = 2 equal TP = 1.

Each family's tiny random fp32 model (the model matrix's recipe) is served at TP = 1 in this
process and at TP = 2 (rank 0 here, rank 1 a spawned process) through the same workload: a shared
prompt prefix (prefix-cache hits), a KV pool tight enough to preempt, requests arriving a step
apart, and for Llama a seeded sampled request and a custom batch-level processor that records
the logits it sees. Each TP = 2 engine costs a process start (~10-40 s on a loaded 2-core box),
so the scenarios share one engine per family.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from typing import Any, ClassVar

import pytest
import torch

from tests.worker.model_fixtures import engine_config
from tests.worker.test_model_matrix import _build
from tests.worker.test_paged_engine import _engine, _run
from worker.async_engine import AsyncEngine, EngineDeadError
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.executor.tensor_parallel import TensorParallelRunner, decode_step, encode_step
from worker.logits_processor import BatchUpdate, LogitsProcessor
from worker.model.loader import LoadedModel
from worker.model.runner import ScheduledSeq, block_bytes
from worker.model.shard import ShardLayout
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams

BLOCKS, BLOCK_SIZE = 14, 4
# Measured: the largest |TP2 - TP1| logit over the Llama workload is 2.1e-6 (fp32, |logits| <= 3.5; the all-reduce
# adds the halves in another order, so no step is bitwise equal); the bound leaves 10x.
LOGIT_TOLERANCE = 2e-5


class RecordLogits(LogitsProcessor):
    """A batch-level processor that keeps a copy of every logits batch it is applied to."""

    seen: ClassVar[list[torch.Tensor]] = []

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy rows too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).seen.append(logits.clone())
        return logits


def _workload(seeded: bool) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(10, 2900, (24,), generator=g).tolist()
    prompts = [prefix + torch.randint(10, 2900, (int(n),), generator=g).tolist() for n in (5, 9, 3, 14, 7)]
    prompts[1] = list(prompts[0])
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)) for p in prompts]
    if seeded:
        reqs.append((prompts[2], SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)))
    return reqs


def _tp2(path: str, loaded: LoadedModel, **kw: Any) -> LLMEngine:
    return LLMEngine(_tp2_config(path, loaded, **kw))


def _tp2_config(path: str, loaded: LoadedModel, **kw: Any) -> EngineConfig:
    """The TP = 2 engine's: the TP = 1 engine's limits, and a KV pool of the same number of blocks."""
    per_rank = dataclasses.replace(loaded, shard=ShardLayout.of(loaded.config, 0, 2))
    fields: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 24,
        "kv_cache_bytes": BLOCKS * block_bytes(per_rank, BLOCK_SIZE),
        "collective_timeout_s": 120,
    }
    return EngineConfig(
        model=path,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        load_entry_points=False,
        block_size=BLOCK_SIZE,
        **{**fields, **kw},
    )


def _tokens(done: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: list(out.outputs[0].token_ids) for rid, out in sorted(done.items())}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral_window", "gemma2", "qwen3_moe"])
def test_tp2_tokens_equal_tp1(family: str, tmp_path, tiny_model: LoadedModel) -> None:
    loaded = _build(family, tmp_path, tiny_model.tokenizer)
    oracle = family == "llama"
    procs = (RecordLogits,) if oracle else ()
    reqs = _workload(seeded=oracle)
    RecordLogits.seen.clear()
    one = _engine(loaded, blocks=BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=24, logits_processors=procs)
    want = _run(one, reqs, stagger=1)
    seen_one = list(RecordLogits.seen)
    RecordLogits.seen.clear()
    two = _tp2(str(tmp_path), loaded, logits_processors=procs)
    try:
        got = _run(two, reqs, stagger=1)
        stats = two.kv_stats()
    finally:
        two.close()
    assert stats["num_preemptions"] > 0 and stats["prefix_hit_tokens"] > 0, "the workload must preempt and hit"
    assert _tokens(got) == _tokens(want), family
    for rid, out in want.items():  # the built-in logprobs agree as well
        for a, b in zip(out.outputs[0].logprobs or [], got[rid].outputs[0].logprobs or []):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) <= LOGIT_TOLERANCE for t in a)
    if oracle:  # the processor saw the full (rows, vocab) logits, the same ones, every step
        assert len(RecordLogits.seen) == len(seen_one) > 0
        for x, y in zip(seen_one, RecordLogits.seen):
            assert x.shape == y.shape == (x.shape[0], loaded.vocab_size)
            assert torch.allclose(x, y, rtol=0, atol=LOGIT_TOLERANCE), (x - y).abs().max().item()


def test_step_broadcast_round_trips() -> None:
    """What rank 0 encodes, every other rank decodes to the same sequences (tables cut to the step's)."""
    seqs = [
        ScheduledSeq([3, 4, 9], [7, 8, 9, 10, 11], 0, True, 4),
        ScheduledSeq([1, 2], [42], 5, True, 0),
        ScheduledSeq([6, 5, 0, 0], [1, 2, 3], 2, False, 0),
    ]
    buf = torch.zeros(64, dtype=torch.int32)
    encode_step(seqs, buf, block_size=4)
    back = decode_step(buf)
    assert back == [
        ScheduledSeq([3, 4], [7, 8, 9, 10, 11], 0, True, 4),
        ScheduledSeq([1, 2], [42], 5, True, 0),
        ScheduledSeq([6, 5], [1, 2, 3], 2, False, 0),
    ]
    with pytest.raises(ValueError, match="exceeds"):
        encode_step(seqs, torch.zeros(8, dtype=torch.int32), block_size=4)


def test_layout_splits_or_replicates_kv_heads() -> None:
    class Cfg:
        def __init__(self, heads: int, kv: int) -> None:
            self.num_attention_heads, self.num_key_value_heads, self.hidden_size = heads, kv, 64 * heads

        def get_text_config(self) -> Any:
            return self

    split = [ShardLayout.of(Cfg(8, 4), r, 2) for r in range(2)]
    assert [(list(s.q_heads()), list(s.kv_heads())) for s in split] == [([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])]
    shared = [ShardLayout.of(Cfg(8, 2), r, 4) for r in range(4)]
    assert [list(s.kv_heads()) for s in shared] == [[0], [0], [1], [1]]  # replicated, each to its q heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ShardLayout.of(Cfg(6, 2), 0, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ShardLayout.of(Cfg(12, 3), 0, 2)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs are visible: the group would start")
def test_gpu_ranks_need_their_gpus_visible(tmp_path) -> None:
    """Rank r runs on cuda:r; fewer visible GPUs than ranks (a Ray replica sees one) is refused at once."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 ranks need 2 visible GPUs"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", tensor_parallel_size=2))


def test_a_dead_rank_fails_the_requests_and_health(tmp_path, tiny_model: LoadedModel) -> None:
    loaded = _build("llama", tmp_path, tiny_model.tokenizer)
    engine = _tp2(str(tmp_path), loaded)
    try:
        runner = engine.runner
        assert isinstance(runner, TensorParallelRunner) and runner.healthy()
        prompt = list(range(20, 40))
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        engine.step()
        engine.step()
        (rank1,) = runner.group._procs
        assert rank1.pid is not None
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(30)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        final = outs[-1].outputs[0]
        assert final.finish_reason == "error" and "tensor-parallel" in (final.error or "")
        assert not runner.healthy()
        with pytest.raises(ValueError, match="tensor_parallel_size"):  # a loaded model cannot be sharded over ranks
            LLMEngine(engine_config(tensor_parallel_size=2), loaded=loaded)
    finally:
        engine.close()


def test_a_dead_rank_kills_the_async_engine_with_engine_dead_error(tmp_path, tiny_model: LoadedModel) -> None:
    """Served, the in-flight request fails with EngineDeadError (503 / UNAVAILABLE), not a finish
    reason, and health turns false: the replica is replaced as a whole."""
    loaded = _build("llama", tmp_path, tiny_model.tokenizer)

    async def main() -> None:
        engine = AsyncEngine(_tp2_config(str(tmp_path), loaded))
        try:
            runner = engine.engine.runner
            assert isinstance(runner, TensorParallelRunner) and engine.healthy()
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            seen = 0
            with pytest.raises(EngineDeadError, match="tensor-parallel"):
                async for out in engine.generate("r", list(range(20, 30)), params, delta=True):
                    seen += len(out.outputs[0].token_ids)
                    if seen == 2:
                        (rank1,) = runner.group._procs
                        assert rank1.pid is not None
                        os.kill(rank1.pid, signal.SIGKILL)
            assert 2 <= seen < 40 and not engine.healthy()
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 300))


def test_tp2_tokens_equal_tp1_through_cascade_steps(tmp_path, tiny_model: LoadedModel) -> None:
    """Six requests behind one 128-token prefix: decode rows share 32 leading blocks, which pays
    for cascade attention at the default thresholds (worker.model.cascade.cascade_pays), decided on
    every rank from the same broadcast step; the tokens still equal TP = 1's."""
    loaded = _build("llama", tmp_path, tiny_model.tokenizer)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(10, 2900, (128,), generator=g).tolist()
    reqs = [
        (prefix + torch.randint(10, 2900, (3,), generator=g).tolist(), SamplingParams(temperature=0.0, max_tokens=6))
        for _ in range(6)
    ]
    blocks, batched = 96, 160
    one = _engine(loaded, blocks=blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=batched)
    want = _run(one, reqs)
    assert one.runner.num_cascade_steps > 0, "the workload must take cascade steps"
    per_rank = dataclasses.replace(loaded, shard=ShardLayout.of(loaded.config, 0, 2))
    two = _tp2(
        str(tmp_path), loaded, max_num_batched_tokens=batched, kv_cache_bytes=blocks * block_bytes(per_rank, BLOCK_SIZE)
    )
    try:
        got = _run(two, reqs)
        cascades = two.runner.num_cascade_steps
    finally:
        two.close()
    assert cascades > 0 and _tokens(got) == _tokens(want)
