"""The paged-KV workloads of `logitpool bench engine --workload ...`.

- shared-prefix: N requests sharing a long common prefix + a few own tokens: prefix caching on
  against off (the slot engine's behaviour: every prompt computed in full) and HF's padded batch.
- capacity: a KV budget equal to the slot engine's (64 slots x 1024 tokens): how many
  concurrent requests of a given length run (peak rows of the batch), and their tok/s.
- pressure: a budget that forces preemption: everything finishes, outputs equal an unpressured
  run token for token, and how many preemptions it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.host_threads import on_own_thread
from worker.model.loader import LoadedModel
from worker.model.runner import block_bytes
from worker.sampling_params import SamplingParams

# transformers' batched generate() timed: (model, prompts, new tokens) -> output tokens/s.
HFBatch = Callable[[LoadedModel, list[list[int]], int], float]


@dataclass
class Drive:
    tokens: dict[str, list[int]]
    seconds: float
    peak_running: int
    preemptions: int
    hit_rate: float

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.tokens.values())) / self.seconds


def drive(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_bytes: int | None = None,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
) -> Drive:
    """All requests at once through a fresh LLMEngine (these EngineConfig fields), stepped
    synchronously to the end, on a thread that ends with it (its OpenMP team too: host_threads)."""
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        load_entry_points=False,
    )
    return on_own_thread(_drive, config, loaded, prompts, params)


def _drive(config: EngineConfig, loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> Drive:
    engine = LLMEngine(config, loaded=loaded)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        peak = max(peak, engine.batch.num_reqs)
    stats = engine.kv_stats()
    return Drive(tokens, time.perf_counter() - t0, peak, int(stats["num_preemptions"]), float(stats["prefix_hit_rate"]))


def random_prompts(loaded: LoadedModel, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, loaded.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def _greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def shared_prefix(
    loaded: LoadedModel, hf_batch: HFBatch | None, *, n: int, prefix: int, own: int, new: int, budget: int
) -> tuple[str, list[list[int]], Drive]:
    """The table row, the prompts and the caching-on run (for the vLLM-cpu column). ``hf_batch`` None: untimed."""
    head = random_prompts(loaded, 1, prefix, seed=1)[0]
    prompts = [head + tail for tail in random_prompts(loaded, n, own, seed=2)]
    drive(loaded, prompts[:2], _greedy(2), max_num_seqs=n, max_num_batched_tokens=budget)  # warm-up, untimed
    on = drive(loaded, prompts, _greedy(new), max_num_seqs=n, max_num_batched_tokens=budget)
    off = drive(
        loaded, prompts, _greedy(new), max_num_seqs=n, max_num_batched_tokens=budget, enable_prefix_caching=False
    )
    hf = f"HF batch {hf_batch(loaded, prompts, new):.0f} tok/s" if hf_batch else "HF not timed"
    assert on.tokens == off.tokens, "prefix caching changed greedy outputs"
    return (
        (
            f"| shared-prefix ({n} x {prefix}+{own} prompt, {new} new) | caching on {on.seconds:.1f} s, "
            f"{on.tok_s:.0f} tok/s, hit rate {on.hit_rate:.2f} | caching off {off.seconds:.1f} s "
            f"| {hf} | on/off speed-up {off.seconds / on.seconds:.1f}x |"
        ),
        prompts,
        on,
    )


def capacity(loaded: LoadedModel, *, slots: int, slot_len: int, prompt: int, new: int, n: int, budget: int) -> str:
    kv_bytes = slots * slot_len // 16 * block_bytes(loaded, 16)
    prompts = random_prompts(loaded, n, prompt, seed=3)
    run = drive(
        loaded,
        prompts,
        _greedy(new),
        max_num_seqs=n,
        max_num_batched_tokens=max(budget, n),
        kv_cache_bytes=kv_bytes,
        max_model_len=slot_len,
    )
    return (
        f"| capacity (KV = {slots} x {slot_len} tokens; {n} requests of {prompt}+{new}) | peak concurrent "
        f"{run.peak_running} (slot engine: {slots}; {run.peak_running / slots:.1f}x) | {run.tok_s:.0f} tok/s "
        f"| preemptions {run.preemptions} |"
    )


def pressure(loaded: LoadedModel, *, n: int, prompt: int, new: int, blocks: int, budget: int) -> str:
    prompts = random_prompts(loaded, n, prompt, seed=4)
    params = _greedy(new)
    roomy = drive(loaded, prompts, params, max_num_seqs=n, max_num_batched_tokens=budget)
    tight = drive(
        loaded,
        prompts,
        params,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        kv_cache_bytes=blocks * block_bytes(loaded, 16),
        enable_prefix_caching=False,
    )
    same = roomy.tokens == tight.tokens and all(len(t) == new for t in tight.tokens.values())
    return (
        f"| pressure ({n} x {prompt}+{new}, {blocks} blocks = {blocks * 16} tokens) | all finished, outputs "
        f"{'identical' if same else 'DIFFERENT'} | preemptions {tight.preemptions} | {tight.tok_s:.0f} tok/s "
        f"(unpressured {roomy.tok_s:.0f}) |"
    )
