"""KV sized per tensor-parallel rank on GPUs (issue 15 item 5, issue 20 bug 1): each rank's budget
from its own device, the group runs the smallest, and the start-up log names what each rank holds
and the largest model that fits. The ranks, their profile run and their pools are real (gloo, 2
processes on CPU); only the devices' memory figures are given by the test (``FakeDevices``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from tests.worker.test_model_matrix import _build
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.executor.tensor_parallel import GroupMemory, RankReport, TensorParallelRunner
from worker.model.loader import LoadedModel
from worker.model.memory import KVBudget, MemorySnapshot, weight_bytes
from worker.model.profile import KVSize
from worker.model.runner import block_bytes
from worker.model.shard import CommStats, ShardLayout
from worker.model.shard_loader import load_then_slice

MIB = 2**20
PEAK = 4 * MIB  # the activation peak each fake device reports for the profile run
TOTALS = (64 * MIB, 48 * MIB)  # rank 1's device is the smaller: the group runs its blocks


@dataclass
class FakeDevice:
    """One rank's device figures: a total, nothing else on it, ``PEAK`` during the profile run."""

    total: int
    profiling: bool = False

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.total, self.total, 0, 0, PEAK if self.profiling else 0)

    def reset_peak(self) -> None:
        self.profiling = True

    def release_cached(self) -> None:
        pass


@dataclass(frozen=True)
class FakeDevices:
    """``RankMemory``: rank r's device is a FakeDevice of ``totals[r]`` (sent to the rank processes)."""

    totals: tuple[int, ...]

    def __call__(self, rank: int, device: torch.device) -> FakeDevice:
        return FakeDevice(self.totals[rank])


def _budget(total: int, weights: int) -> KVBudget:
    return KVBudget(fraction=0.5, total=total, weights=weights, activation_peak=PEAK, outside_torch=0, free=total)


def test_the_largest_model_is_the_smallest_rank_share_times_n() -> None:
    one_seq = 2 * MIB
    reports = [
        RankReport(0, 10 * MIB, KVSize(100, _budget(TOTALS[0], 10 * MIB))),
        RankReport(1, 10 * MIB, KVSize(60, _budget(TOTALS[1], 10 * MIB))),
    ]
    memory = GroupMemory(reports, 60, one_seq)
    # 0.5 x 48 MiB - 4 MiB peak - 2 MiB of one sequence's KV = 18 MiB on the smaller rank, x 2 ranks
    assert memory.largest_model() == 2 * (24 * MIB - PEAK - one_seq)
    line = memory.describe()
    assert "60 KV blocks on every rank" in line and "rank 1: 10.0 MiB weights, room for 60 KV blocks" in line
    assert "the largest model that fits at this tensor_parallel_size: 0.04 GiB" in line
    cpu = GroupMemory([RankReport(r, MIB, KVSize(8, None)) for r in range(2)], 8, one_seq)
    assert cpu.largest_model() is None and "largest" not in cpu.describe()


def test_each_rank_sizes_kv_on_its_device_and_the_group_takes_the_min(
    tmp_path, tiny_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    _build("llama", tmp_path, tiny_model.tokenizer)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        load_entry_points=False,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_cache_memory_fraction=0.5,
        collective_timeout_s=120,
    )
    with caplog.at_level(logging.INFO, logger="worker.executor.tensor_parallel"):
        engine = LLMEngine(config, rank_memory=FakeDevices(TOTALS))
    try:
        layouts = [ShardLayout.of(engine.loaded.config, r, 2) for r in range(2)]
        shards = [load_then_slice(str(tmp_path), "float32", torch.device("cpu"), lay, CommStats()) for lay in layouts]
        per_block = block_bytes(shards[0], 16)
        want = [(int(0.5 * t) - weight_bytes(s.model) - PEAK) // per_block for t, s in zip(TOTALS, shards)]
        assert want[1] < want[0]
        assert engine.runner.num_blocks == min(want)  # rank 1's device bounds the group
        assert engine.kv_budget is not None and engine.kv_budget.total == TOTALS[0]
        runner = engine.runner
        assert isinstance(runner, TensorParallelRunner)
        report = runner.group.memory
        assert [r.kv.num_blocks for r in report.reports] == want
        assert [r.weights for r in report.reports] == [weight_bytes(s.model) for s in shards]
        assert f"{min(want)} KV blocks on every rank" in caplog.text and "largest model that fits" in caplog.text
    finally:
        engine.close()
