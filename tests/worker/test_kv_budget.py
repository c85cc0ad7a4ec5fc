"""KV pool sizing on a GPU: a share of the device's total memory less the weights and the
profiled activation peak, so two replicas at 0.45 share one GPU (issue 20, bug 1).

The engines, their profile run and their KV pools are real (on CPU); only the GPU's memory
figures are given by the test (``FakeGpu``): its total, and what each engine on it holds, booked
by the test from the engine's real weights and KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from cluster.config import LogitpoolConfig
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.cascade import cascade_pays, common_prefix_blocks
from worker.model.loader import LoadedModel
from worker.model.memory import KVBudget, MemorySnapshot, weight_bytes
from worker.model.profile import ProfileRun, cascade_profile_step, profile_step, profiled_kv_budget
from worker.model.runner import block_bytes
from worker.ops.staging import int64_tensor
from worker.sampling_params import SamplingParams

MIB = 2**20
TOTAL = 256 * MIB
PEAK = 8 * MIB  # the activation peak the fake device reports for each profile run
SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 96, "max_model_len": 64, "load_entry_points": False}


@dataclass
class FakeGpu:
    """One device's figures: its total, and the bytes each process on it holds."""

    total: int
    held: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeMemory:
    """``DeviceMemory`` of one engine's process on a FakeGpu (weights already loaded)."""

    gpu: FakeGpu
    name: str
    weights: int
    peak_reset: bool = False

    def __post_init__(self) -> None:
        self.gpu.held[self.name] = self.weights

    def snapshot(self) -> MemorySnapshot:
        held = self.gpu.held[self.name]
        peak = held + (PEAK if self.peak_reset else 0)
        return MemorySnapshot(self.gpu.total, self.gpu.total - sum(self.gpu.held.values()), held, held, peak)

    def reset_peak(self) -> None:
        self.peak_reset = True

    def release_cached(self) -> None:
        pass


def engine_on(gpu: FakeGpu, name: str, loaded: LoadedModel, fraction: float) -> LLMEngine:
    """An engine sized by ``gpu``'s figures; what it holds afterwards is booked on the device."""
    memory = FakeMemory(gpu, name, weight_bytes(loaded.model))
    engine = LLMEngine(EngineConfig(kv_cache_memory_fraction=fraction, **SMALL), loaded=loaded, memory=memory)
    gpu.held[name] = memory.weights + engine.runner.kv_cache_bytes + PEAK  # the activations come back at run time
    return engine


def test_two_engines_at_045_share_one_gpu(tiny_model: LoadedModel) -> None:
    gpu = FakeGpu(TOTAL)
    first = engine_on(gpu, "a", tiny_model, 0.45)
    second = engine_on(gpu, "b", tiny_model, 0.45)
    weights = weight_bytes(tiny_model.model)
    per_block = block_bytes(tiny_model, 16)
    expected = (int(0.45 * TOTAL) - weights - PEAK) // per_block * per_block
    # By total, not free: the second gets what the first got, and both fit on the device.
    assert first.runner.kv_cache_bytes == second.runner.kv_cache_bytes == expected > 0
    assert sum(gpu.held.values()) <= TOTAL
    assert first.kv_budget is not None and first.kv_budget.activation_peak == PEAK
    tokens = []
    for engine in (first, second):  # both serve
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        outs = [o for _ in range(8) for o in engine.step()]
        tokens.append([t for o in outs for t in o.outputs[0].token_ids])
    assert len(tokens[0]) == 3 and tokens[0] == tokens[1]


def test_an_engine_beside_another_that_took_its_room_fails_clearly(tiny_model: LoadedModel) -> None:
    gpu = FakeGpu(TOTAL)
    engine_on(gpu, "a", tiny_model, 0.45)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction: .* free .* replicas sharing a GPU"):
        engine_on(gpu, "b", tiny_model, 0.9)


def test_a_share_too_small_for_weights_and_activations_fails_clearly(tiny_model: LoadedModel) -> None:
    small = weight_bytes(tiny_model.model) + PEAK  # 0.5 x this cannot even hold the weights
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction: .* no room for one KV block"):
        engine_on(FakeGpu(2 * small), "a", tiny_model, 0.5)


def test_no_figures_are_read_when_the_pool_size_is_given(tiny_model: LoadedModel) -> None:
    gpu = FakeGpu(0)  # any reading would fail: nothing fits in 0 bytes
    memory = FakeMemory(gpu, "a", 0)
    cfg = EngineConfig(kv_cache_bytes=64 * block_bytes(tiny_model, 16), **SMALL)
    assert LLMEngine(cfg, loaded=tiny_model, memory=memory).runner.num_blocks == 64 and not memory.peak_reset


@pytest.mark.parametrize("fraction", [1.0, 1.5, 0.0, -0.1])
def test_a_fraction_outside_0_1_is_a_config_error(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction: must be in \(0, 1\)"):
        EngineConfig(kv_cache_memory_fraction=fraction)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        LogitpoolConfig.model_validate({"engine": {"kv_cache_memory_fraction": fraction}})


@pytest.mark.parametrize(("tokens", "seqs", "max_len", "bs"), [(96, 4, 64, 16), (2048, 64, 4096, 16), (8, 8, 5, 4)])
def test_profile_step_is_the_largest_step(tokens: int, seqs: int, max_len: int, bs: int) -> None:
    step = profile_step(tokens, seqs, max_len, bs)
    decode, chunks = step.seqs[: step.decode_rows], step.seqs[step.decode_rows :]
    # max_num_seqs rows at full context, then prompt chunks: max_num_batched_tokens in all.
    assert step.decode_rows == min(seqs, tokens)
    assert all(len(s.token_ids) == 1 and s.start_pos == max_len - 1 for s in decode)
    assert sum(len(s.token_ids) for s in step.seqs) == tokens == step.decode_rows + step.chunk_tokens
    assert all(len(s.token_ids) <= max_len and s.start_pos == 0 for s in chunks)
    # Every block a row writes is its own, and the rows share no leading block with row 0
    # (no cascade shortcut: the gather of every row's full context is what is measured).
    written = [s.block_ids[-1] for s in decode] + [b for s in chunks for b in s.block_ids]
    assert len(written) == len(set(written)) and max(written) < step.num_blocks
    if len(decode) > 1 and len(decode[0].block_ids) > 1:
        assert decode[0].block_ids[0] != decode[1].block_ids[0]


@pytest.mark.parametrize(("tokens", "seqs", "max_len", "bs"), [(96, 20, 64, 16), (2048, 64, 4096, 16), (64, 8, 160, 4)])
def test_cascade_profile_step_shares_the_fewest_blocks_cascade_takes(
    tokens: int, seqs: int, max_len: int, bs: int
) -> None:
    step = cascade_profile_step(tokens, seqs, max_len, bs)
    assert step is not None
    decode = step.seqs[: step.decode_rows]
    table = torch.tensor([s.block_ids for s in decode])
    lengths = int64_tensor([s.start_pos + 1 for s in decode])
    shared = common_prefix_blocks(table, lengths, bs)
    # The shortest prefix that cascade takes at this many rows: the most own keys per row.
    assert cascade_pays(len(decode), shared * bs) and not cascade_pays(len(decode), (shared - 1) * bs)
    assert all(s.start_pos == max_len - 1 and len(s.token_ids) == 1 for s in decode)
    written = [s.block_ids[-1] for s in decode] + [b for s in step.seqs[step.decode_rows :] for b in s.block_ids]
    assert len(written) == len(set(written)) and max(written) < step.num_blocks
    for col in range(table.shape[1] - 1):  # a shared block sits at its own column in every table
        assert col == shared or (table[:, col] == col).all()


def test_no_cascade_profile_step_where_cascade_never_pays() -> None:
    assert cascade_profile_step(96, 4, 64, 16) is None  # 4 rows of 4 blocks: 3 x 48 tokens < 256 saved


def test_the_profile_runs_the_cascade_path_where_it_can_pay(tiny_model: LoadedModel) -> None:
    """A step of many long rows behind a short shared prefix (a system prompt) takes cascade
    attention at run time, whose fp32 copies of each row's own keys and values the plain
    profile step never made: the profile runs that step too, through the real runner."""
    profile = ProfileRun(tiny_model, EngineConfig(**{**SMALL, "max_num_seqs": 20}), 64)
    profile.run()
    assert profile.cascade_step is not None and profile._runner.num_cascade_steps == 1


def test_the_cuda_graphs_pool_is_reserved_in_the_budget(tiny_model: LoadedModel) -> None:
    """Captured decode graphs hold a private pool for the engine's life (the largest graph's
    activations), next to the activations of dynamic steps: with graphs on, the profile runs the
    largest bucket's forward (max_num_seqs one-token rows, through the real runner) and its peak
    comes off the KV budget, and out of what must be free."""
    memory = FakeMemory(FakeGpu(TOTAL), "a", weight_bytes(tiny_model.model))
    cfg = EngineConfig(kv_cache_memory_fraction=0.45, **SMALL)
    plain = profiled_kv_budget(tiny_model, cfg, 64, memory, memory.snapshot())
    graphs = profiled_kv_budget(tiny_model, cfg, 64, memory, memory.snapshot(), graphs=True)
    assert plain.graph_pool == 0 and graphs.graph_pool == PEAK
    assert graphs.kv_bytes == plain.kv_bytes - PEAK
    assert "CUDA graph pool" in graphs.describe() and "CUDA graph pool" not in plain.describe()
    profile = ProfileRun(tiny_model, cfg, 64, graphs=True)
    assert profile.graph_step is not None and len(profile.graph_step) == SMALL["max_num_seqs"]
    profile.run_graph_step()
    no_room = KVBudget(0.5, TOTAL, 0, PEAK, 0, free=int(0.5 * TOTAL) - PEAK, graph_pool=PEAK)
    with pytest.raises(ValueError, match=r"only .* free"):
        no_room.check(block_bytes(tiny_model, 16))


def test_the_profile_runs_through_the_real_runner_and_sampler(tiny_model: LoadedModel) -> None:
    profile = ProfileRun(tiny_model, EngineConfig(**SMALL), 64)
    profile.run()
    assert profile.step.decode_rows == 4 and profile.step.chunk_tokens == 92
