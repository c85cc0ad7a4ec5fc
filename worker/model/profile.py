"""The profile run that sizes the KV pool on a GPU (``worker.model.memory`` says why by total).

Before the pool exists, one dummy step of the largest kind the scheduler can build runs through
the real runner, then the sampler over ``max_num_seqs`` rows (vLLM's profile run); the
allocator's peak above what was allocated before it (the weights, the profile's own small KV)
is the activation memory every later step needs next to the pool. This engine's attention
gathers each decode row's context, so the step also carries ``max_num_seqs`` decode rows at
``max_model_len`` context besides the prompt chunks filling ``max_num_batched_tokens``: the
gather buffers of the fullest batch are in the peak too. The rows share their leading blocks
(all but row 0, so no cascade shortcut is taken), so the profile's own KV stays small. A second
step runs the same rows through cascade attention, where it can pay, at the shortest shared
prefix it takes: its fp32 copies of every row's own keys and values are then the largest (up to
twice the gather), and a step of that shape comes at run time with a short system prompt.
Where decode steps replay as CUDA graphs, their private pool is held for the engine's life on
top: it is profiled as the peak of a forward of ``max_num_seqs`` one-token rows (the largest
bucket; the gather workspace the graphs read is allocated outside the pool, so the rows' context
is one block) and reserved in the budget too.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from worker.batch import PersistentBatch
from worker.config import EngineConfig
from worker.logits_processor.registry import build_logits_processors
from worker.model.cascade import cascade_pays
from worker.model.loader import LoadedModel
from worker.model.memory import DeviceMemory, KVBudget, MemorySnapshot, weight_bytes
from worker.model.runner import ModelRunner, ScheduledSeq, block_bytes, num_blocks_for
from worker.model.static_decode import resolve_mode
from worker.sampler import Sampler
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileStep:
    seqs: list[ScheduledSeq]
    num_blocks: int  # blocks the step's tables name
    decode_rows: int  # one-token rows at full context (first in ``seqs``)
    chunk_tokens: int  # prompt tokens in the chunks after them


def profile_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> ProfileStep:
    """The largest step: ``max_num_seqs`` decode rows at ``max_model_len`` context, then prompt
    chunks (each as long as the context allows) for the rest of ``max_num_batched_tokens``."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    per_row = -(-max_model_len // block_size)
    shared = list(range(1, per_row))  # rows 1.. share these leading blocks; row 0 starts on block 0
    next_block = per_row
    seqs: list[ScheduledSeq] = []
    for r in range(rows):
        lead = shared if r else [0, *shared[1:]]
        table = [*lead[: per_row - 1], next_block]
        next_block += 1
        seqs.append(ScheduledSeq(table, [0], max_model_len - 1, True))
    return _with_chunks(seqs, next_block, max_num_batched_tokens - rows, max_model_len, block_size)


def cascade_profile_step(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> ProfileStep | None:
    """``profile_step``'s rows sharing exactly the fewest leading blocks cascade attention takes
    (None where it never pays at this many rows): column c of every table is block c but for
    column ``shared`` (a block of the row's own, which ends the common run) and the last (the
    block the row writes). Block c sits at column c in every table that lists it, as prefix
    caching places blocks."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    per_row = -(-max_model_len // block_size)
    shared = next((k for k in range(1, per_row) if cascade_pays(rows, k * block_size)), None)
    if shared is None:
        return None
    next_block = per_row - 1
    seqs: list[ScheduledSeq] = []
    for _ in range(rows):
        table = list(range(per_row - 1))
        if shared < per_row - 1:
            table[shared] = next_block
            next_block += 1
        seqs.append(ScheduledSeq([*table, next_block], [0], max_model_len - 1, True))
        next_block += 1
    return _with_chunks(seqs, next_block, max_num_batched_tokens - rows, max_model_len, block_size)


def graph_profile_step(max_num_seqs: int) -> list[ScheduledSeq]:
    """The largest decode graph's step: ``max_num_seqs`` one-token rows, each on a block of its own."""
    return [ScheduledSeq([r], [0], 0, True) for r in range(max_num_seqs)]


def _with_chunks(
    seqs: list[ScheduledSeq], next_block: int, left: int, max_model_len: int, block_size: int
) -> ProfileStep:
    """The decode rows ``seqs``, then prompt chunks of ``left`` tokens on blocks of their own."""
    rows, chunk_tokens = len(seqs), left
    while left > 0:
        n = min(left, max_model_len)
        used = -(-n // block_size)
        seqs.append(ScheduledSeq(list(range(next_block, next_block + used)), [0] * n, 0, True))
        next_block += used
        left -= n
    return ProfileStep(seqs, next_block, rows, chunk_tokens)


def _worst_case_params(config: EngineConfig) -> SamplingParams:
    """A row taking every sampler path that holds memory: penalties, top-k/top-p sort, logprobs."""
    return SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=config.max_logprobs,
    )


class ProfileRun:
    """The profile step and the sampler, set up on ``loaded``'s device (its KV, batch and
    processors allocated here, so the peak of ``run`` is the activations alone)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        max_model_len: int,
        *,
        sample: bool = True,
        graphs: bool = False,
    ) -> None:
        """``graphs``: the engine replays decode steps as CUDA graphs (``run_graph_step`` then
        measures their pool)."""
        bs = config.block_size
        sizes = (config.max_num_batched_tokens, config.max_num_seqs, max_model_len, bs)
        self.step = profile_step(*sizes)
        self.cascade_step = cascade_profile_step(*sizes)
        self.graph_step = graph_profile_step(config.max_num_seqs) if graphs else None
        blocks = max(
            self.step.num_blocks,
            self.cascade_step.num_blocks if self.cascade_step else 0,
            len(self.graph_step) if self.graph_step else 0,
        )
        self._runner = ModelRunner(loaded, num_blocks=blocks, block_size=bs, max_model_len=max_model_len)
        pin = loaded.device.type == "cuda"
        self._procs = build_logits_processors(config, loaded.device, pin, entry_points=False)
        self._batch = PersistentBatch(self.step.decode_rows, device=loaded.device, pin_memory=pin)
        params = _worst_case_params(config)
        added = [(f"profile-{i}", params, [0], [0]) for i in range(self.step.decode_rows)]
        self._procs.update_state(self._batch.update([], added))
        self._generator = torch.Generator(device=loaded.device)
        self._sample = sample  # False on tensor-parallel ranks 1..N-1: rank 0 alone samples

    def run(self) -> None:
        if self.cascade_step is not None:
            self._runner.execute(self.cascade_step.seqs)
        logits = self._runner.execute(self.step.seqs)[: self.step.decode_rows].float()
        if not self._sample:
            return
        with torch.inference_mode():
            Sampler(self._procs, generator=self._generator)(logits, self._batch.sampling_metadata())

    def run_graph_step(self) -> None:
        """The largest decode graph's forward, eagerly (its peak is what the graph's pool holds)."""
        assert self.graph_step is not None
        self._runner.execute(self.graph_step)


def profiled_kv_budget(
    loaded: LoadedModel,
    config: EngineConfig,
    max_model_len: int,
    memory: DeviceMemory,
    start: MemorySnapshot,
    *,
    sample: bool = True,
    graphs: bool = False,
) -> KVBudget:
    """The KV budget of an engine on ``loaded``'s device; ``start`` was read before it loaded.
    A tensor-parallel rank runs it with every other rank at once (the forward's collectives).
    ``graphs``: decode steps replay as CUDA graphs, whose pool is reserved too."""
    profile = ProfileRun(loaded, config, max_model_len, sample=sample, graphs=graphs)
    memory.reset_peak()
    before = memory.snapshot()
    profile.run()
    peak = memory.snapshot().peak
    graph_pool = 0
    if graphs:
        memory.reset_peak()
        at = memory.snapshot()
        profile.run_graph_step()
        graph_pool = max(0, memory.snapshot().peak - at.allocated)
    del profile
    gc.collect()  # the profile's runner, batch and processors: their device memory goes back
    memory.release_cached()
    now = memory.snapshot()
    return KVBudget(
        fraction=config.kv_cache_memory_fraction,
        total=now.total,
        weights=weight_bytes(loaded.model),
        activation_peak=max(0, peak - before.allocated),
        outside_torch=max(0, now.outside_torch - start.outside_torch),
        free=now.free,
        graph_pool=graph_pool,
    )


@dataclass(frozen=True)
class KVSize:
    """An engine's (or one rank's) KV pool: its blocks and, on a GPU, the budget they came from."""

    num_blocks: int
    budget: KVBudget | None  # None: kv_cache_bytes, or CPU's max_num_seqs x max_model_len


def kv_size(
    loaded: LoadedModel,
    config: EngineConfig,
    max_model_len: int,
    memory: DeviceMemory | None,
    start: MemorySnapshot | None,
    *,
    sample: bool = True,
) -> KVSize:
    """The KV pool of ``loaded`` (a whole model or one rank's shard): profiled on a GPU
    (``memory``), else ``kv_cache_bytes`` or room for ``max_num_seqs`` full sequences."""
    kv_bytes, budget = config.kv_cache_bytes, None
    if memory is not None and start is not None:
        graphs = resolve_mode(config.cuda_graphs, loaded.device, sharded=loaded.shard is not None) == "graphs"
        budget = profiled_kv_budget(loaded, config, max_model_len, memory, start, sample=sample, graphs=graphs)
        logger.info("%s%s", f"rank {loaded.shard.rank}: " if loaded.shard else "", budget.describe())
        kv_bytes = budget.check(block_bytes(loaded, config.block_size))
    blocks = num_blocks_for(
        loaded, config.block_size, kv_cache_bytes=kv_bytes, default_tokens=config.max_num_seqs * max_model_len
    )
    return KVSize(blocks, budget)
